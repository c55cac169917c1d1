"""LoRA adapters as the client sees them (pagedserve.v1 AdapterService): what the server holds, and the runtime
load/unload requests (accepted only by a server started with --enable-runtime-lora-updates)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.v1 import adapters_pb2 as pb


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter; `generate(..., adapter=name)` picks it."""

    name: str
    adapter_id: int
    path: str
    rank: int
    target_modules: tuple[str, ...]

    @classmethod
    def from_proto(cls, a: pb.Adapter) -> Adapter:
        return cls(a.name, a.adapter_id, a.path, a.rank, tuple(a.target_modules))


@dataclass(frozen=True, slots=True)
class AdapterList:
    adapters: tuple[Adapter, ...]
    lora_enabled: bool
    runtime_updates: bool  # load_adapter / unload_adapter accepted
    max_loras: int
    max_lora_rank: int
    base_model: str  # every adapter's parent

    @classmethod
    def from_proto(cls, r: pb.ListAdaptersResponse) -> AdapterList:
        return cls(tuple(Adapter.from_proto(a) for a in r.adapters), r.lora_enabled, r.runtime_updates, r.max_loras,
                   r.max_lora_rank, r.base_model)

    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)


def load_request(name: str, path: str) -> pb.LoadAdapterRequest:
    return pb.LoadAdapterRequest(lora_name=name, lora_path=path)


def unload_request(name: str) -> pb.UnloadAdapterRequest:
    return pb.UnloadAdapterRequest(lora_name=name)
