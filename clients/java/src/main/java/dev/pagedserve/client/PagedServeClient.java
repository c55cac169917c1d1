package dev.pagedserve.client;

import dev.pagedserve.v1.Adapter;
import dev.pagedserve.v1.AdapterServiceGrpc;
import dev.pagedserve.v1.EmbedRequest;
import dev.pagedserve.v1.EmbedResponse;
import dev.pagedserve.v1.GenerateRequest;
import dev.pagedserve.v1.GenerateResponse;
import dev.pagedserve.v1.GenerationServiceGrpc;
import dev.pagedserve.v1.ListAdaptersRequest;
import dev.pagedserve.v1.ListAdaptersResponse;
import dev.pagedserve.v1.LoadAdapterRequest;
import dev.pagedserve.v1.ModelInfoRequest;
import dev.pagedserve.v1.ModelInfoResponse;
import dev.pagedserve.v1.RerankRequest;
import dev.pagedserve.v1.RerankResponse;
import dev.pagedserve.v1.TokenizeRequest;
import dev.pagedserve.v1.TokenizeResponse;
import dev.pagedserve.v1.UnloadAdapterRequest;
import io.grpc.Channel;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import dev.pagedserve.client.health.v1.HealthCheckRequest;
import dev.pagedserve.client.health.v1.HealthCheckResponse;
import dev.pagedserve.client.health.v1.HealthGrpc;
import io.grpc.stub.AbstractStub;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.Objects;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import java.util.function.Supplier;

/**
 * Client for the pagedserve GenerationService; thread-safe, one connection shared by all calls.
 *
 * <pre>{@code
 * try (PagedServeClient client = PagedServeClient.connect("localhost:50051",
 *     ClientOptions.builder().plaintext().build())) {
 *   try (GenerationStream stream = client.withTimeout(Duration.ofSeconds(30)).generate(request)) {
 *     for (GenerateResponse frame : stream) System.out.print(frame.getDelta().getText());
 *   }
 * }
 * }</pre>
 */
public final class PagedServeClient implements AutoCloseable {
  private final Channel channel;
  private final ManagedChannel owned;
  private final Duration timeout;
  private final Metadata headers; // sent with every call of this view (the W3C trace context), or null

  private PagedServeClient(Channel channel, ManagedChannel owned, Duration timeout, Metadata headers) {
    this.channel = channel;
    this.owned = owned;
    this.timeout = timeout;
    this.headers = headers;
  }

  /**
   * Opens a channel to {@code target}: "host:port", "dns:///name:port" (every address the name resolves to, e.g. a
   * Kubernetes headless Service), an address list "ipv4:10.0.0.1:50051,10.0.0.2:50051" (or "ipv6:..."), or any
   * gRPC target string. Calls are spread round-robin over the resolved addresses by default.
   */
  public static PagedServeClient connect(String target, ClientOptions options) {
    ManagedChannel channel = Channels.open(target, options);
    return new PagedServeClient(channel, channel, options.defaultTimeout().orElse(null), null);
  }

  /** Uses a channel the caller manages (interceptors, custom transport); close() leaves it open. */
  public static PagedServeClient wrap(Channel channel) {
    return new PagedServeClient(Objects.requireNonNull(channel, "channel"), null, null, null);
  }

  /** A view of this client whose calls each get a deadline of {@code timeout}; it shares the channel. */
  public PagedServeClient withTimeout(Duration timeout) {
    if (timeout == null || timeout.isNegative() || timeout.isZero()) {
      throw new IllegalArgumentException("timeout must be positive, got " + timeout);
    }
    return new PagedServeClient(channel, null, timeout, headers);
  }

  /**
   * A view of this client whose calls carry a W3C trace context ({@code traceparent}, and {@code tracestate} when
   * not null): the server's span for each request becomes a child of it. Pass the current span's values from
   * whatever tracer the application uses; the client itself depends on none. It shares the channel.
   */
  public PagedServeClient withTraceContext(String traceparent, String tracestate) {
    Objects.requireNonNull(traceparent, "traceparent");
    Metadata trace = new Metadata();
    trace.put(Metadata.Key.of("traceparent", Metadata.ASCII_STRING_MARSHALLER), traceparent);
    if (tracestate != null && !tracestate.isEmpty()) {
      trace.put(Metadata.Key.of("tracestate", Metadata.ASCII_STRING_MARSHALLER), tracestate);
    }
    return new PagedServeClient(channel, null, timeout, trace);
  }

  /** Starts Generate and returns a blocking, iterate-once stream of frames. */
  public GenerationStream generate(GenerateRequest request) {
    GenerationServiceGrpc.GenerationServiceBlockingStub stub = deadline(GenerationServiceGrpc::newBlockingStub);
    return GenerationStream.start(() -> stub.generate(request));
  }

  /** Starts Generate without blocking; frames go to {@code observer} on gRPC's executor threads. */
  public StreamHandle generateAsync(GenerateRequest request, StreamObserver<GenerateResponse> observer) {
    GenerationServiceGrpc.GenerationServiceStub stub = deadline(GenerationServiceGrpc::newStub);
    return StreamHandle.wrap(observer, relay -> stub.generate(request, relay));
  }

  /** Runs Generate to the end and returns every completion's text, tokens and Final frame. */
  public Completion complete(GenerateRequest request) {
    try (GenerationStream stream = generate(request)) {
      return Completion.collect(stream);
    }
  }

  public TokenizeResponse tokenize(TokenizeRequest request) {
    return unary(() -> deadline(GenerationServiceGrpc::newBlockingStub).tokenize(request));
  }

  /**
   * One vector per input, in order, from an embedding model's server ({@code modelInfo().getRunner()} is
   * "pooling"); a server that generates answers UNIMPLEMENTED.
   */
  public EmbedResponse embed(EmbedRequest request) {
    return unary(() -> deadline(GenerationServiceGrpc::newBlockingStub).embed(request));
  }

  /**
   * The documents' indices and scores, best first, by the cosine similarity of each document's embedding and the
   * query's ({@code top_n} of them; 0: all), from an embedding model's server.
   */
  public RerankResponse rerank(RerankRequest request) {
    return unary(() -> deadline(GenerationServiceGrpc::newBlockingStub).rerank(request));
  }

  /** The served model, its limits and live KV-cache / scheduler counts. */
  public ModelInfoResponse modelInfo() {
    return unary(() -> deadline(GenerationServiceGrpc::newBlockingStub)
        .modelInfo(ModelInfoRequest.getDefaultInstance()));
  }

  /**
   * The LoRA adapters the server holds (a request picks one with {@code GenerateRequest.setAdapter(name)}), and
   * whether it accepts runtime loads.
   */
  public ListAdaptersResponse listAdapters() {
    return unary(() -> deadline(AdapterServiceGrpc::newBlockingStub)
        .listAdapters(ListAdaptersRequest.getDefaultInstance()));
  }

  /**
   * Loads the PEFT folder {@code path} (on the server, inside its --allowed-lora-dirs) as {@code name};
   * FAILED_PRECONDITION when the server runs without --enable-runtime-lora-updates.
   */
  public Adapter loadAdapter(String name, String path) {
    LoadAdapterRequest request = LoadAdapterRequest.newBuilder().setLoraName(name).setLoraPath(path).build();
    return unary(() -> deadline(AdapterServiceGrpc::newBlockingStub).loadAdapter(request)).getAdapter();
  }

  /** Unloads an adapter; FAILED_PRECONDITION while requests using it are unfinished. */
  public void unloadAdapter(String name) {
    UnloadAdapterRequest request = UnloadAdapterRequest.newBuilder().setLoraName(name).build();
    unary(() -> deadline(AdapterServiceGrpc::newBlockingStub).unloadAdapter(request));
  }

  /** The standard grpc.health.v1 check; {@code ""} asks about the whole server. */
  public HealthCheckResponse.ServingStatus health(String service) {
    HealthCheckRequest request = HealthCheckRequest.newBuilder().setService(service).build();
    return unary(() -> deadline(HealthGrpc::newBlockingStub).check(request)).getStatus();
  }

  /** Closes the channel this client opened, waiting briefly for calls in flight. */
  @Override
  public void close() {
    if (owned == null) {
      return;
    }
    owned.shutdown();
    try {
      if (!owned.awaitTermination(5, TimeUnit.SECONDS)) {
        owned.shutdownNow();
      }
    } catch (InterruptedException e) {
      owned.shutdownNow();
      Thread.currentThread().interrupt();
    }
  }

  private <S extends AbstractStub<S>> S deadline(Function<Channel, S> newStub) {
    S stub = newStub.apply(channel);
    if (headers != null) {
      stub = stub.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    return timeout == null ? stub : stub.withDeadlineAfter(timeout.toNanos(), TimeUnit.NANOSECONDS);
  }

  private static <T> T unary(Supplier<T> call) {
    try {
      return call.get();
    } catch (RuntimeException e) {
      throw PagedServeException.from(e);
    }
  }
}
