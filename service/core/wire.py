"""Raw request bytes -> a validated proto message, with errors that name the offending field.

The servicer receives undecoded bytes so that a malformed request becomes INVALID_ARGUMENT naming the field
(grpc's own deserializer would answer INTERNAL without saying which field), and so that an over-limit message
is refused with the limit in the message rather than a bare transport error.
"""

from __future__ import annotations

from functools import cache
from typing import TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from pagedserve.engine.errors import InvalidRequestError

M = TypeVar("M", bound=Message)


def parse_request(raw: bytes, message_type: type[M], max_bytes: int) -> M:
    if len(raw) > max_bytes:
        raise InvalidRequestError(
            "request", f"message is {len(raw)} bytes, over the server limit of {max_bytes} bytes (--max-message-bytes)")
    try:
        message = message_type.FromString(raw)
    except DecodeError as exc:
        bad = find_invalid_utf8(raw, message_type.DESCRIPTOR)
        if bad is not None:
            raise InvalidRequestError(bad, "string is not valid UTF-8") from None
        raise InvalidRequestError("request", f"cannot parse {message_type.DESCRIPTOR.full_name}: {exc}") from None
    check_enums(message)
    return message


def check_enums(message: Message, prefix: str = "") -> None:
    """proto3 enums are open: an unknown number parses fine, so reject it here by name."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_ENUM:
            values = value if _is_repeated(field) else [value]
            for v in values:
                if v not in field.enum_type.values_by_number:
                    names = ", ".join(e.name for e in field.enum_type.values)
                    raise InvalidRequestError(path, f"unknown enum value {v}; supported: {names}")
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            for i, child in enumerate(value if _is_repeated(field) else [value]):
                check_enums(child, f"{path}[{i}]." if _is_repeated(field) else f"{path}.")


def find_invalid_utf8(raw: bytes, descriptor: Descriptor) -> str | None:
    """Path of the first string field whose bytes are not UTF-8, e.g. `stopping.stop_sequences[1]`."""
    lenient = _lenient_class(descriptor.full_name, descriptor.file)
    try:
        message = lenient.FromString(raw)
    except DecodeError:
        return None
    return _walk_strings(message, descriptor, "")


def _walk_strings(message: Message, original: Descriptor, prefix: str) -> str | None:
    for field, value in message.ListFields():
        spec = original.fields_by_number[field.number]
        path = f"{prefix}{spec.name}"
        values = list(value) if _is_repeated(field) else [value]
        for i, v in enumerate(values):
            item = f"{path}[{i}]" if _is_repeated(field) else path
            if spec.type == FieldDescriptor.TYPE_STRING and not _is_utf8(v):
                return item
            if spec.type == FieldDescriptor.TYPE_MESSAGE and not spec.message_type.GetOptions().map_entry:
                found = _walk_strings(v, spec.message_type, f"{item}.")
                if found:
                    return found
    return None


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


@cache
def _lenient_class(full_name: str, file: FileDescriptor) -> type[Message]:
    """The same message with every string field declared as bytes (same wire format, no UTF-8 check)."""
    pool = descriptor_pool.DescriptorPool()
    for fd in _files_in_dependency_order(file):
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        for msg in proto.message_type:
            _strings_to_bytes(msg)
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _strings_to_bytes(msg: descriptor_pb2.DescriptorProto) -> None:
    # A map key may not be bytes (the pool refuses it), so string keys keep their UTF-8 check: a bad key makes the
    # lenient parse fail too, and the caller reports the message as unparsable instead of naming the field.
    keeps_key = msg.options.map_entry
    for field in msg.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING and not (keeps_key and field.number == 1):
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    for nested in msg.nested_type:
        _strings_to_bytes(nested)


def _files_in_dependency_order(file: FileDescriptor) -> list[FileDescriptor]:
    ordered: list[FileDescriptor] = []

    def visit(fd: FileDescriptor) -> None:
        if fd in ordered:
            return
        for dep in fd.dependencies:
            visit(dep)
        ordered.append(fd)

    visit(file)
    return ordered
