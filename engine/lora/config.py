"""What the server is told about LoRA adapters: the adapters to load (`LoraModule`) and the limits (`LoraConfig`),
with vLLM's flag names and meanings. `EngineConfig.lora is None` means LoRA is off (vLLM's `--enable-lora` unset)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedserve.engine.errors import ConfigError

# Adapter names travel in comma-separated metric labels (`vllm:lora_requests_info`, whose reader splits on "," without
# trimming) and in OpenAI's `model`: printable ASCII without spaces or commas.
MAX_ADAPTER_NAME_LEN = 128
MAX_SUPPORTED_RANK = 256


def check_adapter_name(name: object, field: str) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(field, "an adapter name must be a non-empty string")
    if len(name) > MAX_ADAPTER_NAME_LEN:
        raise ConfigError(field, f"an adapter name is at most {MAX_ADAPTER_NAME_LEN} characters, got {len(name)}")
    if not all(33 <= ord(c) <= 126 and c != "," for c in name):
        raise ConfigError(field, f"{name!r}: an adapter name is printable ASCII without spaces or commas")
    return name


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter: `--lora-modules name=path`, or a runtime load. `path` is a PEFT folder."""

    name: str
    path: str

    def __post_init__(self) -> None:
        check_adapter_name(self.name, "lora_modules.name")
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("lora_modules.path", "an adapter path must be a non-empty string")

    @classmethod
    def parse(cls, text: str) -> "LoraModule":
        """`name=path`, the form of vLLM's `--lora-modules`."""
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError("lora_modules", f"{text!r}: expected name=path")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """`max_loras`: distinct adapters in one step; `max_lora_rank`: the largest rank accepted at load;
    `max_cpu_loras`: adapters kept loaded (None: as many as `max_loras`), the rest reloaded from their folder on use;
    `runtime_updates`: the load/unload endpoints are on, loading only from under `allowed_dirs`."""

    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runtime_updates: bool = False
    allowed_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError("max_loras", f"must be an integer >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_SUPPORTED_RANK:
            raise ConfigError("max_lora_rank", f"must be an integer in [1, {MAX_SUPPORTED_RANK}], got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise ConfigError("max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        names = [m.name for m in self.modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError("lora_modules", f"adapter names must be unique; repeated: {', '.join(duplicates)}")
        if self.allowed_dirs and not self.runtime_updates:
            raise ConfigError("allowed_lora_dirs", "only meaningful with runtime adapter updates enabled")
        if self.runtime_updates and not self.allowed_dirs:
            raise ConfigError("allowed_lora_dirs", "runtime adapter updates need at least one allowed directory")
        for d in self.allowed_dirs:
            if not os.path.isabs(d):
                raise ConfigError("allowed_lora_dirs", f"{d!r} must be an absolute path")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A loaded (or registered) adapter as the front ends list it: `/v1/models` shows `name` with `parent` = the
    base's served name; `adapter_id` is the small integer KV events and the prefix-cache key carry (never 0: 0 is
    the base)."""

    name: str
    adapter_id: int
    path: str
    rank: int
    target_modules: tuple[str, ...]
