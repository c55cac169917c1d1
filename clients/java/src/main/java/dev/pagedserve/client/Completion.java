package dev.pagedserve.client;

import dev.pagedserve.v1.Final;
import dev.pagedserve.v1.GenerateResponse;
import dev.pagedserve.v1.Started;
import java.util.ArrayList;
import java.util.List;

/** A whole Generate call, collected: one {@link Sequence} per completion index. */
public record Completion(Started started, List<Sequence> sequences) {

  /** One generated sequence: its text, token ids and Final frame. */
  public record Sequence(String text, List<Integer> tokenIds, Final finalFrame) {}

  /** The text of completion 0 (the only one unless the request set n > 1). */
  public String text() {
    return sequences.isEmpty() ? "" : sequences.get(0).text();
  }

  /** Reads frames to the end of the stream. */
  public static Completion collect(Iterable<GenerateResponse> frames) {
    Started started = null;
    List<StringBuilder> texts = new ArrayList<>();
    List<List<Integer>> ids = new ArrayList<>();
    List<Final> finals = new ArrayList<>();
    for (GenerateResponse frame : frames) {
      int i = frame.getIndex();
      while (texts.size() <= i) {
        texts.add(new StringBuilder());
        ids.add(new ArrayList<>());
        finals.add(null);
      }
      switch (frame.getFrameCase()) {
        case STARTED -> started = frame.getStarted();
        case DELTA -> {
          texts.get(i).append(frame.getDelta().getText());
          ids.get(i).addAll(frame.getDelta().getTokenIdsList());
        }
        case FINAL -> finals.set(i, frame.getFinal());
        default -> { }
      }
    }
    List<Sequence> sequences = new ArrayList<>();
    for (int i = 0; i < texts.size(); i++) {
      sequences.add(new Sequence(texts.get(i).toString(), List.copyOf(ids.get(i)), finals.get(i)));
    }
    return new Completion(started, List.copyOf(sequences));
  }
}
