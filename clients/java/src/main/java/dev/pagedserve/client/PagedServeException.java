package dev.pagedserve.client;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.BadRequest;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import io.grpc.protobuf.StatusProto;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * A failed call: the gRPC status plus, for INVALID_ARGUMENT (and NOT_FOUND: an unknown LoRA adapter), the request
 * fields the server rejected.
 * It is a {@link StatusRuntimeException}, so code that already handles gRPC errors keeps working.
 */
public final class PagedServeException extends StatusRuntimeException {
  private static final long serialVersionUID = 1L;

  /** One rejected request field, e.g. {@code sampling.temperature}, with the server's reason. */
  public record FieldViolation(String field, String description) {}

  /** Matches "sampling.top_p: must be in (0, 1]" and "stopping.stop_sequences[2]: too long". */
  private static final Pattern FIELD_PREFIX =
      Pattern.compile("([A-Za-z_][A-Za-z0-9_]*(?:\\.[A-Za-z_][A-Za-z0-9_]*|\\[[0-9]+\\])*): (.*)", Pattern.DOTALL);

  private final List<FieldViolation> violations;

  private PagedServeException(Status status, Metadata trailers, List<FieldViolation> violations) {
    super(status, trailers);
    this.violations = List.copyOf(violations);
  }

  /** Wraps any throwable from a gRPC call; non-gRPC throwables become UNKNOWN with the cause kept. */
  public static PagedServeException from(Throwable t) {
    if (t instanceof PagedServeException e) {
      return e;
    }
    Status status = Status.fromThrowable(t);
    Metadata trailers = Status.trailersFromThrowable(t);
    if (!(t instanceof StatusRuntimeException) && !(t instanceof StatusException)) {
      status = status.withCause(t);
    }
    return new PagedServeException(status, trailers, violations(status, trailers));
  }

  public Status.Code code() {
    return getStatus().getCode();
  }

  /** The status description the server sent. */
  public String description() {
    return Optional.ofNullable(getStatus().getDescription()).orElse("");
  }

  /** The first rejected field's path, when the server named one. */
  public Optional<String> field() {
    return violations.stream().findFirst().map(FieldViolation::field);
  }

  public List<FieldViolation> violations() {
    return violations;
  }

  private static List<FieldViolation> violations(Status status, Metadata trailers) {
    List<FieldViolation> out = trailers == null ? new ArrayList<>() : details(status, trailers);
    boolean named = status.getCode() == Status.Code.INVALID_ARGUMENT || status.getCode() == Status.Code.NOT_FOUND;
    if (out.isEmpty() && named && status.getDescription() != null) {
      // Without google.rpc.BadRequest details the server's description starts with "field.path: reason".
      Matcher m = FIELD_PREFIX.matcher(status.getDescription());
      if (m.matches()) {
        out.add(new FieldViolation(m.group(1), m.group(2)));
      }
    }
    return out;
  }

  private static List<FieldViolation> details(Status status, Metadata trailers) {
    List<FieldViolation> out = new ArrayList<>();
    com.google.rpc.Status rich = StatusProto.fromStatusAndTrailers(status, trailers);
    for (Any detail : rich.getDetailsList()) {
      if (!detail.is(BadRequest.class)) {
        continue;
      }
      try {
        for (BadRequest.FieldViolation v : detail.unpack(BadRequest.class).getFieldViolationsList()) {
          out.add(new FieldViolation(v.getField(), v.getDescription()));
        }
      } catch (InvalidProtocolBufferException e) {
        // A malformed detail must not hide the status itself.
      }
    }
    return out;
  }
}
