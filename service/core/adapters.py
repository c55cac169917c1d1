"""LoRA adapters as every front end sees them: which names a request may pick, and the runtime load/unload that
OpenAI's `/v1/load_lora_adapter` and pagedserve.v1's AdapterService share (one set of checks, one set of errors).

Runtime updates are off unless the server was started with them (`LoraConfig.runtime_updates`); a load reads only
from under the allowed folders, checked on the path with symlinks and `..` resolved, so a link inside an allowed
folder cannot point the server at any other file.
"""

from __future__ import annotations

from pagedserve.engine.errors import AdapterLoadError, ConfigError, field_map, renamed
from pagedserve.engine.lora.config import AdapterInfo, LoraConfig, LoraModule, check_adapter_name
from pagedserve.engine.lora.manager import allowed_path
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.errors import RuntimeUpdatesOffError

# The engine's names for the adapter in its errors -> the request fields of both protocols (vLLM's names).
_ADMIN_FIELDS = field_map({"adapter": "lora_name"})


class AdapterAdmin:
    """serving: the engine (once loaded) and the state shared with the front ends."""

    def __init__(self, serving: ServingContext):
        self.serving = serving

    @property
    def lora(self) -> LoraConfig | None:
        engine = self.serving.engine
        return engine.config.lora if engine is not None else None

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """Every registered adapter; empty while the model loads or when LoRA is off."""
        return self.serving.engine.adapters() if self.lora is not None else ()

    def find(self, name: str) -> AdapterInfo | None:
        return next((a for a in self.adapters() if a.name == name), None)

    async def load(self, name: object, path: object) -> AdapterInfo:
        lora = self._check_updates()
        module = LoraModule(_name(name), allowed_path(path, lora.allowed_dirs))
        with renamed(_ADMIN_FIELDS):
            return await self.serving.engine.load_adapter(module)

    async def unload(self, name: object) -> None:
        self._check_updates()
        with renamed(_ADMIN_FIELDS):
            await self.serving.engine.unload_adapter(_name(name))

    def _check_updates(self) -> LoraConfig:
        self.serving.state.check_ready()
        lora = self.lora
        if lora is None:
            raise RuntimeUpdatesOffError("LoRA is off: start the server with --enable-lora, "
                                         "--enable-runtime-lora-updates and --allowed-lora-dirs")
        if not lora.runtime_updates:
            raise RuntimeUpdatesOffError("runtime LoRA updates are off: start the server with "
                                         "--enable-runtime-lora-updates and --allowed-lora-dirs")
        return lora


def _name(name: object) -> str:
    try:
        return check_adapter_name(name, "lora_name")
    except ConfigError as exc:
        raise AdapterLoadError("lora_name", str(exc).removeprefix("lora_name: ")) from None
