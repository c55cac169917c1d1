package dev.pagedserve.client;

import dev.pagedserve.v1.GenerateResponse;
import io.grpc.Context;
import java.util.Iterator;
import java.util.NoSuchElementException;
import java.util.function.Supplier;

/**
 * A blocking Generate call: iterate it once, like {@link java.nio.file.DirectoryStream}.
 *
 * <pre>{@code
 * try (GenerationStream stream = client.generate(request)) {
 *   for (GenerateResponse frame : stream) {
 *     System.out.print(frame.getDelta().getText());
 *   }
 * }
 * }</pre>
 *
 * <p>Closing the stream (or {@link #cancel()}, from any thread) aborts the request on the server, which frees
 * its KV cache at once. Iteration throws {@link PagedServeException} for any failure.
 */
public final class GenerationStream implements Iterable<GenerateResponse>, AutoCloseable {
  private final Context.CancellableContext context;
  private final Iterator<GenerateResponse> frames;
  private boolean iterated;
  private boolean finished;

  private GenerationStream(Context.CancellableContext context, Iterator<GenerateResponse> frames) {
    this.context = context;
    this.frames = frames;
  }

  /** Starts the call inside its own cancellable context, so that cancel() reaches exactly this call. */
  static GenerationStream start(Supplier<Iterator<GenerateResponse>> call) {
    Context.CancellableContext context = Context.current().withCancellation();
    Context previous = context.attach();
    try {
      return new GenerationStream(context, call.get());
    } catch (RuntimeException e) {
      context.cancel(e);
      throw PagedServeException.from(e);
    } finally {
      context.detach(previous);
    }
  }

  @Override
  public Iterator<GenerateResponse> iterator() {
    if (iterated) {
      throw new IllegalStateException("a GenerationStream can be iterated only once");
    }
    iterated = true;
    return new Iterator<>() {
      @Override
      public boolean hasNext() {
        return GenerationStream.this.hasNext();
      }

      @Override
      public GenerateResponse next() {
        return GenerationStream.this.next();
      }
    };
  }

  /** Whether another frame follows; blocks until the server sends one or ends the stream. */
  public boolean hasNext() {
    if (finished) {
      return false;
    }
    try {
      boolean more = frames.hasNext();
      finished = !more;
      return more;
    } catch (RuntimeException e) {
      finished = true;
      throw PagedServeException.from(e);
    }
  }

  public GenerateResponse next() {
    if (!hasNext()) {
      throw new NoSuchElementException();
    }
    try {
      return frames.next();
    } catch (RuntimeException e) {
      finished = true;
      throw PagedServeException.from(e);
    }
  }

  /** Aborts the call; safe from any thread and idempotent. A blocked hasNext() then throws CANCELLED. */
  public void cancel() {
    context.cancel(null);
  }

  @Override
  public void close() {
    cancel();
  }
}
