from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Adapter(_message.Message):
    __slots__ = ("name", "adapter_id", "path", "rank", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_id: int
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., adapter_id: _Optional[int] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "lora_enabled", "runtime_updates", "max_loras", "max_lora_rank", "base_model")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_UPDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    lora_enabled: bool
    runtime_updates: bool
    max_loras: int
    max_lora_rank: int
    base_model: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., lora_enabled: _Optional[bool] = ..., runtime_updates: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., base_model: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
