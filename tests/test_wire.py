"""service/core/wire.py: raw request bytes -> message, with every failure an InvalidRequestError naming a field."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.service.core.wire import find_invalid_utf8, parse_request
from pagedserve.v1 import generate_pb2 as pb


@pytest.mark.parametrize("message_type", [pb.GenerateRequest, vpb.GenerateRequest, vpb.HealthCheckRequest,
                                          vpb.AbortRequest, vpb.GetLoadsRequest])
def test_unparsable_bytes_name_the_request_for_every_message_type(message_type):
    # b"\x00" is a field number 0 tag: no message parses it. Messages whose files hold map<string, ...> fields
    # used to crash the UTF-8 search with a TypeError (a bytes map key), which the server answered with INTERNAL.
    with pytest.raises(InvalidRequestError) as err:
        parse_request(b"\x00", message_type, 1 << 20)
    assert err.value.field == "request"


def test_bad_utf8_is_named_by_its_field_path():
    good = pb.GenerateRequest(text="x")
    good.stopping.stop_sequences.extend(["ok", "XX"])
    raw = good.SerializeToString().replace(b"XX", b"\xff\xfe")
    assert find_invalid_utf8(raw, pb.GenerateRequest.DESCRIPTOR) == "stopping.stop_sequences[1]"
    with pytest.raises(InvalidRequestError) as err:
        parse_request(raw, pb.GenerateRequest, 1 << 20)
    assert err.value.field == "stopping.stop_sequences[1]"


def test_bad_utf8_in_the_router_protocols_text_is_named():
    raw = vpb.GenerateRequest(text="XX").SerializeToString().replace(b"XX", b"\xc3\x28")
    with pytest.raises(InvalidRequestError) as err:
        parse_request(raw, vpb.GenerateRequest, 1 << 20)
    assert err.value.field == "text"


def test_a_message_over_the_limit_is_refused_before_parsing():
    with pytest.raises(InvalidRequestError) as err:
        parse_request(b"\x00" * 65, pb.GenerateRequest, 64)
    assert err.value.field == "request" and "--max-message-bytes" in err.value.message
