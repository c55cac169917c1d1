package dev.pagedserve.client;

import dev.pagedserve.v1.Final;
import dev.pagedserve.v1.GenerateResponse;
import dev.pagedserve.v1.Started;
import java.util.ArrayList;
import java.util.List;

/** A whole Generate call, collected: one {@link Sequence} per completion index. */
public record Completion(Started started, List<Sequence> sequences) {

  /**
   * One generated sequence: its text, token ids and Final frame, and a reasoning model's thought apart from the text
   * (a server started with --reasoning-parser, chat input; empty otherwise).
   */
  public record Sequence(String text, List<Integer> tokenIds, Final finalFrame, String reasoning) {}

  /** The text of completion 0 (the only one unless the request set n > 1). */
  public String text() {
    return sequences.isEmpty() ? "" : sequences.get(0).text();
  }

  /** Reads frames to the end of the stream. */
  public static Completion collect(Iterable<GenerateResponse> frames) {
    Started started = null;
    List<StringBuilder> texts = new ArrayList<>();
    List<StringBuilder> thoughts = new ArrayList<>();
    List<List<Integer>> ids = new ArrayList<>();
    List<Final> finals = new ArrayList<>();
    for (GenerateResponse frame : frames) {
      int i = frame.getIndex();
      while (texts.size() <= i) {
        texts.add(new StringBuilder());
        thoughts.add(new StringBuilder());
        ids.add(new ArrayList<>());
        finals.add(null);
      }
      switch (frame.getFrameCase()) {
        case STARTED -> started = frame.getStarted();
        case DELTA -> {
          texts.get(i).append(frame.getDelta().getText());
          thoughts.get(i).append(frame.getDelta().getReasoning());
          ids.get(i).addAll(frame.getDelta().getTokenIdsList());
        }
        case FINAL -> finals.set(i, frame.getFinal());
        default -> { }
      }
    }
    List<Sequence> sequences = new ArrayList<>();
    for (int i = 0; i < texts.size(); i++) {
      sequences.add(new Sequence(texts.get(i).toString(), List.copyOf(ids.get(i)), finals.get(i),
          thoughts.get(i).toString()));
    }
    return new Completion(started, List.copyOf(sequences));
  }
}
