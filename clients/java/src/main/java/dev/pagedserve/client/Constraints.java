package dev.pagedserve.client;

import dev.pagedserve.v1.Choices;
import dev.pagedserve.v1.Constraint;
import dev.pagedserve.v1.JsonObject;
import java.util.Arrays;
import java.util.List;
import java.util.Objects;

/**
 * Structured outputs: set {@code GenerateRequest.Builder.setConstraint} to one of these and the completion's text
 * follows it. The server compiles the spec; one it cannot compile is INVALID_ARGUMENT naming
 * {@code constraint.<kind>} ({@link PagedServeException#field()}).
 *
 * <pre>{@code
 * GenerateRequest request = GenerateRequest.newBuilder().setText("Is Paris in France? Answer:")
 *     .setConstraint(Constraints.choice("yes", "no")).build();
 * }</pre>
 */
public final class Constraints {
  private Constraints() {}

  /** One JSON value valid against the schema, given as JSON text. */
  public static Constraint jsonSchema(String schemaJson) {
    return Constraint.newBuilder().setJsonSchema(Objects.requireNonNull(schemaJson, "schemaJson")).build();
  }

  /** Any JSON object. */
  public static Constraint jsonObject() {
    return Constraint.newBuilder().setJsonObject(JsonObject.getDefaultInstance()).build();
  }

  /** The whole output matches the pattern. */
  public static Constraint regex(String pattern) {
    return Constraint.newBuilder().setRegex(Objects.requireNonNull(pattern, "pattern")).build();
  }

  /** A sentence of a grammar: Lark (its start rule) or GBNF ({@code root ::= ...}). */
  public static Constraint grammar(String ebnf) {
    return Constraint.newBuilder().setGrammar(Objects.requireNonNull(ebnf, "ebnf")).build();
  }

  /** Exactly one of the choices. */
  public static Constraint choice(String... choices) {
    return choice(Arrays.asList(choices));
  }

  /** Exactly one of the choices. */
  public static Constraint choice(List<String> choices) {
    return Constraint.newBuilder().setChoice(Choices.newBuilder().addAllChoices(choices)).build();
  }

  /** Free text until a trigger, then a tagged JSON segment (vLLM's structural-tag format, as JSON text). */
  public static Constraint structuralTag(String tagJson) {
    return Constraint.newBuilder().setStructuralTag(Objects.requireNonNull(tagJson, "tagJson")).build();
  }
}
