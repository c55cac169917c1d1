package dev.pagedserve.client;

import dev.pagedserve.v1.GenerateRequest;
import dev.pagedserve.v1.GenerateResponse;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.util.function.Consumer;

/**
 * An asynchronous Generate call started by {@link PagedServeClient#generateAsync}. The caller's observer
 * sees every frame, then exactly one of onCompleted or onError (always a {@link PagedServeException}).
 */
public final class StreamHandle {
  private final Relay relay;

  private StreamHandle(Relay relay) {
    this.relay = relay;
  }

  static StreamHandle wrap(StreamObserver<GenerateResponse> observer, Consumer<Relay> start) {
    Relay relay = new Relay(observer);
    start.accept(relay);
    return new StreamHandle(relay);
  }

  /**
   * Aborts the call; the server frees the request at once and the observer gets onError(CANCELLED).
   * Safe from any thread, including from inside the observer's callbacks.
   */
  public void cancel() {
    relay.call.cancel("cancelled by the client", null);
  }

  /** Passes frames through and turns every error into a PagedServeException. */
  static final class Relay implements ClientResponseObserver<GenerateRequest, GenerateResponse> {
    private final StreamObserver<GenerateResponse> observer;
    private ClientCallStreamObserver<GenerateRequest> call;

    private Relay(StreamObserver<GenerateResponse> observer) {
      this.observer = observer;
    }

    @Override
    public void beforeStart(ClientCallStreamObserver<GenerateRequest> requestStream) {
      // Called synchronously inside stub.generate, so `call` is set before wrap() returns the handle.
      this.call = requestStream;
    }

    @Override
    public void onNext(GenerateResponse frame) {
      observer.onNext(frame);
    }

    @Override
    public void onError(Throwable t) {
      observer.onError(PagedServeException.from(t));
    }

    @Override
    public void onCompleted() {
      observer.onCompleted();
    }
  }
}
