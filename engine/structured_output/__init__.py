"""Structured outputs: a request's `OutputConstraint` compiled once for the model's tokenizer (at admission, off the
step loop) and, per sequence, a matcher whose allowed-token bitmask masks that row's logits before sampling."""
