"""What the speculative decoding tests (test_spec_drafter.py, test_spec_engine.py, test_spec_verifier.py)
share: small engines, and a config that speculates at every batch size they run."""

from __future__ import annotations

from pagedserve.engine.spec_decode.config import SpeculativeConfig


# Each engine's KV cache is allocated up front: small ones keep the module's memory low.
SMALL = {"dtype": "float32", "kv_cache_memory": 32 << 20}


def spec(k: int, **kw) -> SpeculativeConfig:
    """Speculation at every batch size these tests run (the default, a lone sequence, has a test of its own)."""
    lo, hi = kw.pop("lo", 1), kw.pop("hi", 3)
    kw.setdefault("disable_by_batch_size", 32)
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi, **kw)
