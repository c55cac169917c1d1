package dev.pagedserve.examples;

import dev.pagedserve.client.ClientOptions;
import dev.pagedserve.client.GenerationStream;
import dev.pagedserve.client.PagedServeClient;
import dev.pagedserve.client.PagedServeException;
import dev.pagedserve.v1.Final;
import dev.pagedserve.v1.GenerateRequest;
import dev.pagedserve.v1.GenerateResponse;
import dev.pagedserve.v1.SamplingOptions;
import dev.pagedserve.v1.StoppingOptions;
import java.io.File;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;

/**
 * Streams one completion to stdout.
 *
 * <pre>
 * java -jar target/pagedserve-client-examples.jar --addr localhost:50051 --plaintext --prompt "Hello" --max-new-tokens 32
 * </pre>
 *
 * Flags: --addr, --prompt, --max-new-tokens, --temperature (0 = greedy), --timeout-ms, --plaintext, or TLS with
 * --ca [--cert --key] [--authority]. Errors print their gRPC status and rejected field; exit status 1.
 */
public final class StreamCompletion {
  private StreamCompletion() {}

  public static void main(String[] args) throws Exception {
    Map<String, String> flags = parseFlags(args);
    GenerateRequest.Builder request = GenerateRequest.newBuilder()
        .setText(flags.getOrDefault("prompt", "Hello"))
        .setStopping(StoppingOptions.newBuilder()
            .setMaxNewTokens(Integer.parseInt(flags.getOrDefault("max-new-tokens", "64"))));
    if (flags.containsKey("temperature")) {
      request.setSampling(SamplingOptions.newBuilder()
          .setTemperature(Float.parseFloat(flags.get("temperature"))));
    }
    Duration timeout = Duration.ofMillis(Long.parseLong(flags.getOrDefault("timeout-ms", "60000")));
    try (PagedServeClient client = PagedServeClient.connect(
        flags.getOrDefault("addr", "localhost:50051"), options(flags))) {
      try (GenerationStream stream = client.withTimeout(timeout).generate(request.build())) {
        for (GenerateResponse frame : stream) {
          System.out.print(frame.getDelta().getText());
          System.out.flush();
          if (frame.hasFinal()) {
            Final fin = frame.getFinal();
            System.err.printf("%n[%s, %d prompt + %d generated tokens]%n", fin.getFinishReason(),
                fin.getUsage().getPromptTokens(), fin.getUsage().getCompletionTokens());
          }
        }
      }
    } catch (PagedServeException e) {
      System.err.printf("%s%s: %s%n", e.code(), e.field().map(f -> " (field " + f + ")").orElse(""),
          e.description());
      System.exit(1);
    }
  }

  private static ClientOptions options(Map<String, String> flags) {
    ClientOptions.Builder options = ClientOptions.builder();
    if (flags.containsKey("plaintext")) {
      options.plaintext();
    } else {
      options.mtls(file(flags.get("ca")), file(flags.get("cert")), file(flags.get("key")));
    }
    if (flags.containsKey("authority")) {
      options.authorityOverride(flags.get("authority"));
    }
    return options.build();
  }

  private static File file(String path) {
    return path == null ? null : new File(path);
  }

  private static Map<String, String> parseFlags(String[] args) {
    Map<String, String> flags = new HashMap<>();
    for (int i = 0; i < args.length; i++) {
      if (!args[i].startsWith("--")) {
        throw new IllegalArgumentException("unexpected argument " + args[i]);
      }
      String name = args[i].substring(2);
      boolean hasValue = i + 1 < args.length && !args[i + 1].startsWith("--");
      flags.put(name, hasValue ? args[++i] : "");
    }
    return flags;
  }
}
