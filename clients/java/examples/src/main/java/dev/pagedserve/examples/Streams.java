package dev.pagedserve.examples;

import dev.pagedserve.client.GenerationStream;
import dev.pagedserve.client.PagedServeClient;
import dev.pagedserve.client.PagedServeException;
import dev.pagedserve.v1.GenerateRequest;
import dev.pagedserve.v1.GenerateResponse;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;

/** The driver's Generate commands: blocking iteration for one stream, StreamObservers for many. */
final class Streams {
  private final PagedServeClient client;

  Streams(PagedServeClient client) {
    this.client = client;
  }

  private PagedServeClient timed(long timeoutMs) {
    return timeoutMs > 0 ? client.withTimeout(Duration.ofMillis(timeoutMs)) : client;
  }

  /** With cancelAfterTokens > 0 the stream is cancelled after that many tokens; the channel stays open. */
  Map<String, Object> generate(GenerateRequest request, long timeoutMs, long cancelAfterTokens) {
    Result result = new Result();
    try (GenerationStream stream = timed(timeoutMs).generate(request)) {
      for (GenerateResponse frame : stream) {
        result.record(frame);
        if (cancelAfterTokens > 0 && !result.cancelled && result.tokenIds.size() >= cancelAfterTokens) {
          stream.cancel();
          result.cancelled = true;
        }
      }
    } catch (PagedServeException e) {
      result.error = ConformanceDriver.error(e);
    }
    return result.toJson();
  }

  /** Runs {@code count} streams of the same request at once on the one channel, through the async API. */
  Map<String, Object> generateMany(GenerateRequest request, long count, long timeoutMs)  {
    List<Result> results = new ArrayList<>();
    CountDownLatch done = new CountDownLatch((int) count);
    for (int i = 0; i < count; i++) {
      Result result = new Result();
      results.add(result);
      timed(timeoutMs).generateAsync(request, new StreamObserver<>() {
        @Override
        public void onNext(GenerateResponse frame) {
          result.record(frame);
        }

        @Override
        public void onError(Throwable t) {
          result.error = ConformanceDriver.error((PagedServeException) t);
          done.countDown();
        }

        @Override
        public void onCompleted() {
          done.countDown();
        }
      });
    }
    try {
      done.await();
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
    List<Map<String, Object>> out = new ArrayList<>();
    for (Result r : results) {
      synchronized (r) {
        out.add(r.toJson());
      }
    }
    return Map.of("results", out);
  }

  /** What one stream produced, in the same JSON shape as the Go driver. */
  private static final class Result {
    final StringBuilder text = new StringBuilder();
    final List<Integer> tokenIds = new ArrayList<>();
    String finishReason = "";
    String requestId = "";
    boolean cancelled;
    Map<String, Object> error;

    synchronized void record(GenerateResponse frame) {
      switch (frame.getFrameCase()) {
        case STARTED -> requestId = frame.getStarted().getRequestId();
        case DELTA -> {
          text.append(frame.getDelta().getText());
          tokenIds.addAll(frame.getDelta().getTokenIdsList());
        }
        case FINAL -> finishReason = frame.getFinal().getFinishReason().name();
        default -> { }
      }
    }

    Map<String, Object> toJson() {
      Map<String, Object> out = new LinkedHashMap<>();
      out.put("text", text.toString());
      out.put("token_ids", tokenIds);
      out.put("tokens_received", tokenIds.size());
      out.put("finish_reason", finishReason);
      out.put("request_id", requestId);
      out.put("cancelled", cancelled);
      out.put("error", error);
      return out;
    }
  }
}
