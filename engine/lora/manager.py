"""The engine's adapters: which names are registered (start-up `LoraConfig.modules` and runtime loads), and which are
loaded (an LRU of `LoraConfig.cpu_capacity` weights; an evicted one is read again from its folder when a request
asks for it, at admission, in the admitting thread: never on the step loop).

A request holds its adapter's `LoraWeights` from admission to its end, so eviction or an unload never changes a
running request. Ids are small integers per registration, never 0 (the base) and never reused, so a name loaded
again from another folder never shares prefix-cache blocks with its predecessor.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict

import torch

from pagedserve.engine.errors import AdapterInUseError, AdapterLoadError, AdapterNotFoundError, InvalidRequestError
from pagedserve.engine.lora.config import AdapterInfo, LoraConfig, LoraModule
from pagedserve.engine.lora.peft_format import read_peft_adapter
from pagedserve.engine.lora.weights import LoraLayout, LoraWeights


class AdapterManager:
    """Thread-safe: admission resolves names on front-end threads while the loop thread registers and unloads."""

    def __init__(self, config: LoraConfig, layout: LoraLayout, dtype: torch.dtype,
                 device: torch.device = torch.device("cpu")):
        self.config, self.layout, self.dtype, self.device = config, layout, dtype, device
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._registered: dict[str, AdapterInfo] = {}
        self._loaded: OrderedDict[str, LoraWeights] = OrderedDict()  # least recently used first
        for module in config.modules:
            self.register(self.read(module))

    def read(self, module: LoraModule) -> LoraWeights | AdapterInfo:
        """Disk reads and validation (any thread): the weights for a new registration, or the registered info when
        the same name is already loaded from the same folder (a no-op load)."""
        with self._lock:
            known = self._registered.get(module.name)
        if known is not None:
            _check_same_folder(known, module.path)
            return known
        info = AdapterInfo(module.name, 0, module.path, 0, ())
        return read_peft_adapter(info, self.layout, self.config.max_lora_rank, self.dtype, self.device)

    def read_allowed(self, module: LoraModule) -> LoraWeights | AdapterInfo:
        """A runtime load's disk half (any thread): the folder must be allowed, readable and fit the base."""
        self.check_allowed(module.path)
        return self.read(module)

    def unload(self, name: str, users: int) -> None:
        """Refused while `users` unfinished requests use it (AdapterInUseError): running requests are never broken."""
        if users and any(info.name == name for info in self.infos()):
            raise AdapterInUseError(f"adapter {name!r} is used by {users} unfinished request(s); unload it when they "
                                    "end")
        self.unregister(name)

    def check_allowed(self, path: str) -> None:
        """Runtime loads come only from under `LoraConfig.allowed_dirs` (when it names any)."""
        if self.config.allowed_dirs:
            allowed_path(path, self.config.allowed_dirs)

    def register(self, read: LoraWeights | AdapterInfo) -> AdapterInfo:
        """Applies a `read` result (on the loop thread, between steps); returns what front ends list."""
        if isinstance(read, AdapterInfo):
            return read
        with self._lock:
            known = self._registered.get(read.name)
            if known is not None:  # registered meanwhile: the same rule as read()
                _check_same_folder(known, read.info.path)
                return known
            info = AdapterInfo(read.name, next(self._ids), read.info.path, read.info.rank, read.info.target_modules)
            self._registered[info.name] = info
            self._keep(LoraWeights(info, read.slots))
        return info

    def resolve(self, name: str | None) -> LoraWeights | None:
        """A request's adapter (admission, caller's thread); an evicted one is read again from its folder."""
        if name is None:
            return None
        with self._lock:
            info = self._registered.get(name)
            weights = self._loaded.get(name)
            if weights is not None:
                self._loaded.move_to_end(name)
                return weights
        if info is None:
            known = ", ".join(self._registered) or "none"
            raise AdapterNotFoundError("adapter", f"no adapter named {name!r} (loaded: {known})")
        weights = read_peft_adapter(info, self.layout, self.config.max_lora_rank, self.dtype, self.device)
        with self._lock:
            if self._registered.get(name) is info:
                self._keep(weights)
        return weights

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise AdapterNotFoundError("lora_name", f"no adapter named {name!r}")
            self._loaded.pop(name, None)

    def infos(self) -> tuple[AdapterInfo, ...]:
        with self._lock:
            return tuple(self._registered.values())

    def _keep(self, weights: LoraWeights) -> None:
        self._loaded[weights.name] = weights
        self._loaded.move_to_end(weights.name)
        while len(self._loaded) > self.config.cpu_capacity:
            self._loaded.popitem(last=False)  # requests holding it keep their reference


def require(manager: AdapterManager | None, field: str, error: type[InvalidRequestError]) -> AdapterManager:
    """The engine's adapter manager, or `error` naming `field` when LoRA is off."""
    if manager is None:
        raise error(field, "LoRA adapters are off on this engine (EngineConfig.lora is None)")
    return manager


def _check_same_folder(known: AdapterInfo, path: str) -> None:
    """Loading a registered name again is a no-op from the same folder, refused from another."""
    if os.path.realpath(known.path) != os.path.realpath(path):
        raise AdapterLoadError("lora_name", f"{known.name!r} is already loaded from {known.path}; unload it first to "
                               "load another folder under that name")


def allowed_path(path: object, allowed_dirs: tuple[str, ...]) -> str:
    """The real path (symlinks and `..` resolved) when it lies inside one of the allowed folders (also resolved), so
    a link inside an allowed folder cannot point the server at any other file."""
    if not isinstance(path, str) or not path:
        raise AdapterLoadError("lora_path", "must be a non-empty string (the adapter's PEFT folder)")
    if "\x00" in path:
        raise AdapterLoadError("lora_path", "must not contain NUL characters")
    real = os.path.realpath(path)
    for folder in allowed_dirs:
        root = os.path.realpath(folder)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise AdapterLoadError("lora_path", f"{path!r} is outside the allowed folders (--allowed-lora-dirs: "
                                        f"{', '.join(allowed_dirs)})")
