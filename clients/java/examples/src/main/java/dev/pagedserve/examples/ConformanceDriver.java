package dev.pagedserve.examples;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.protobuf.util.JsonFormat;
import dev.pagedserve.client.ClientOptions;
import dev.pagedserve.client.PagedServeClient;
import dev.pagedserve.client.PagedServeException;
import dev.pagedserve.v1.Adapter;
import dev.pagedserve.v1.EmbedRequest;
import dev.pagedserve.v1.EmbedResponse;
import dev.pagedserve.v1.Embedding;
import dev.pagedserve.v1.GenerateRequest;
import dev.pagedserve.v1.ListAdaptersResponse;
import dev.pagedserve.v1.RerankRequest;
import dev.pagedserve.v1.RerankResponse;
import dev.pagedserve.v1.RerankResult;
import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Drives the client from the cross-language tests (tests/test_clients_go_java.py), with the same JSON-lines
 * protocol as the Go driver (clients/go/cmd/pagedserve-conformance): one client, one command per stdin line,
 * one JSON answer per stdout line. Requests arrive as protobuf JSON so every language sends the same bytes.
 * Flags: --addr host:port, and for TLS --ca pem [--cert pem --key pem].
 */
public final class ConformanceDriver {
  private static final Gson GSON = new GsonBuilder().serializeNulls().disableHtmlEscaping().create();

  private ConformanceDriver() {}

  public static void main(String[] args) throws Exception {
    Map<String, String> flags = new LinkedHashMap<>();
    for (int i = 0; i + 1 < args.length; i += 2) {
      flags.put(args[i].replaceFirst("^--", ""), args[i + 1]);
    }
    ClientOptions.Builder options = ClientOptions.builder().plaintext();
    if (flags.containsKey("ca")) {
      options.mtls(file(flags.get("ca")), file(flags.get("cert")), file(flags.get("key")));
    }
    String addr = flags.getOrDefault("addr", "localhost:50051");
    PrintStream out = new PrintStream(System.out, true, StandardCharsets.UTF_8);
    try (PagedServeClient client = PagedServeClient.connect(addr, options.build());
         BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
      Streams streams = new Streams(client);
      for (String line = in.readLine(); line != null; line = in.readLine()) {
        JsonObject cmd = JsonParser.parseString(line).getAsJsonObject();
        String op = cmd.get("op").getAsString();
        if (op.equals("quit")) {
          break;
        }
        out.println(GSON.toJson(handle(client, streams, op, cmd)));
      }
    }
  }

  private static File file(String path) {
    return path == null ? null : new File(path);
  }

  private static Object handle(PagedServeClient client, Streams streams, String op, JsonObject cmd) {
    try {
      return switch (op) {
        case "generate" -> (cmd.has("traceparent") ? new Streams(traced(client, cmd)) : streams).generate(
            request(cmd), intField(cmd, "timeout_ms"), intField(cmd, "cancel_after_tokens"));
        case "generate_many" -> streams.generateMany(request(cmd), intField(cmd, "count"),
            intField(cmd, "timeout_ms"));
        case "health" -> health(client, cmd.has("service") ? cmd.get("service").getAsString() : "");
        case "list_adapters", "load_adapter", "unload_adapter" -> adapters(client, op, cmd);
        case "embed" -> embed(client, cmd);
        case "rerank" -> rerank(client, cmd);
        default -> Map.of("error", error("CLIENT", "unknown op " + op, null));
      };
    } catch (InvalidProtocolBufferException e) {
      return Map.of("error", error("CLIENT", e.getMessage(), null));
    }
  }

  private static Map<String, Object> health(PagedServeClient client, String service) {
    Map<String, Object> out = new LinkedHashMap<>();
    try {
      out.put("status", client.health(service).name());
      out.put("error", null);
    } catch (PagedServeException e) {
      out.put("status", "UNKNOWN");
      out.put("error", error(e));
    }
    return out;
  }

  private static Map<String, Object> adapters(PagedServeClient client, String op, JsonObject cmd) {
    Map<String, Object> out = new LinkedHashMap<>();
    try {
      switch (op) {
        case "list_adapters" -> {
          ListAdaptersResponse list = client.listAdapters();
          out.put("adapters", list.getAdaptersList().stream().map(Adapter::getName).toList());
          out.put("runtime_updates", list.getRuntimeUpdates());
        }
        case "load_adapter" -> {
          Adapter adapter = client.loadAdapter(cmd.get("name").getAsString(), cmd.get("path").getAsString());
          out.put("name", adapter.getName());
          out.put("rank", adapter.getRank());
        }
        default -> client.unloadAdapter(cmd.get("name").getAsString());
      }
      out.put("error", null);
    } catch (PagedServeException e) {
      out.put("error", error(e));
    }
    return out;
  }

  /** Embed: each input's vector and prompt tokens, in order. */
  private static Map<String, Object> embed(PagedServeClient client, JsonObject cmd)
      throws InvalidProtocolBufferException {
    EmbedRequest.Builder builder = EmbedRequest.newBuilder();
    JsonFormat.parser().merge(cmd.get("request").toString(), builder);
    Map<String, Object> out = new LinkedHashMap<>();
    try {
      EmbedResponse reply = client.embed(builder.build());
      out.put("embeddings", reply.getEmbeddingsList().stream().map(Embedding::getValuesList).toList());
      out.put("prompt_tokens", reply.getEmbeddingsList().stream().map(Embedding::getPromptTokens).toList());
      out.put("error", null);
    } catch (PagedServeException e) {
      out.put("error", error(e));
    }
    return out;
  }

  /** Rerank: the results' indices and scores, best first. */
  private static Map<String, Object> rerank(PagedServeClient client, JsonObject cmd)
      throws InvalidProtocolBufferException {
    RerankRequest.Builder builder = RerankRequest.newBuilder();
    JsonFormat.parser().merge(cmd.get("request").toString(), builder);
    Map<String, Object> out = new LinkedHashMap<>();
    try {
      RerankResponse reply = client.rerank(builder.build());
      out.put("indices", reply.getResultsList().stream().map(RerankResult::getIndex).toList());
      out.put("scores", reply.getResultsList().stream().map(RerankResult::getRelevanceScore).toList());
      out.put("prompt_tokens", reply.getPromptTokens());
      out.put("error", null);
    } catch (PagedServeException e) {
      out.put("error", error(e));
    }
    return out;
  }

  /** The client with the command's W3C trace context ("traceparent", optional "tracestate") on its calls. */
  private static PagedServeClient traced(PagedServeClient client, JsonObject cmd) {
    String state = cmd.has("tracestate") ? cmd.get("tracestate").getAsString() : null;
    return client.withTraceContext(cmd.get("traceparent").getAsString(), state);
  }

  private static GenerateRequest request(JsonObject cmd) throws InvalidProtocolBufferException {
    GenerateRequest.Builder builder = GenerateRequest.newBuilder();
    JsonFormat.parser().merge(cmd.get("request").toString(), builder);
    return builder.build();
  }

  private static long intField(JsonObject cmd, String name) {
    return cmd.has(name) && !cmd.get(name).isJsonNull() ? cmd.get(name).getAsLong() : 0;
  }

  static Map<String, Object> error(PagedServeException e) {
    return error(e.code().name(), e.description(), e.field().orElse(""));
  }

  static Map<String, Object> error(String code, String message, String field) {
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("code", code);
    out.put("message", message);
    out.put("field", field == null ? "" : field);
    return out;
  }
}
