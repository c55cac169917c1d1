"""Speculative decoding: drafts proposed per sequence (n-gram prompt lookup), verified in the step's one forward."""
