"""vLLM's offline LoRA handle: `llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))`
loads the PEFT folder on first use and runs the prompts through it, as vLLM's LLM does. The name is what the
engine registers the adapter under; the integer id is vLLM's key for it, so one id names one adapter here too."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.lora.config import LoraModule


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ConfigError("lora_request.lora_int_id", f"must be an integer >= 1, got {self.lora_int_id!r}")
        LoraModule(self.lora_name, self.lora_path)  # the name and path checks of a --lora-modules entry

    @property
    def module(self) -> LoraModule:
        return LoraModule(self.lora_name, self.lora_path)


class LoraRequests:
    """The adapters an LLM was asked for by LoRARequest, so each id keeps naming one adapter."""

    def __init__(self) -> None:
        self._names: dict[int, LoRARequest] = {}

    def names(self, requests: list[LoRARequest | None]) -> list[str | None]:
        """Each request's adapter name (None: the base), after checking its id against earlier ones."""
        for request in requests:
            if request is None:
                continue
            if not isinstance(request, LoRARequest):
                raise ConfigError("lora_request", f"must be a LoRARequest or None, got {type(request).__name__}")
            seen = self._names.setdefault(request.lora_int_id, request)
            if (seen.lora_name, seen.lora_path) != (request.lora_name, request.lora_path):
                raise ConfigError("lora_request.lora_int_id", f"{request.lora_int_id} already names "
                                  f"{seen.lora_name!r} ({seen.lora_path}), not {request.lora_name!r}")
        return [None if r is None else r.lora_name for r in requests]
