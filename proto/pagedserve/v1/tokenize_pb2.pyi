from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "return_offsets")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    return_offsets: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., return_offsets: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "offsets")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedCompositeFieldContainer[Offset]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[_Union[Offset, _Mapping]]] = ...) -> None: ...

class Offset(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...
