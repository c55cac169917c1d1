"""Grammar backends by name (EngineConfig.structured_output_backend). Entries load on first use, so the engine
imports a grammar library only when it is chosen."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.engine.structured_output.backend import GrammarBackend
from pagedserve.kernels.registry import Registry

# A backend class: (HF tokenizer, vocabulary width of the logits, EOS ids) -> GrammarBackend
BackendFactory = Callable[..., GrammarBackend]
CONSTRAINT_BACKENDS: Registry[BackendFactory] = Registry("structured-output backend")


def _llguidance() -> BackendFactory:
    from pagedserve.engine.structured_output.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend


CONSTRAINT_BACKENDS.register_lazy("llguidance", _llguidance)
