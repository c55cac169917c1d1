"""Engine outputs (deltas, from service/core/stream.py) and KV events -> vllm.grpc.engine / smg.grpc.common reply
messages."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as vpb

from pagedserve.engine.kv_events import BlockRemoved, BlockStored
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.core.sequence import TokenLogprob
from pagedserve.service.router.kv_events import EventBatch


def chunk(out: RequestOutput, completion: CompletionOutput) -> vpb.GenerateStreamChunk:
    first = completion.num_tokens == len(completion.new_token_ids)  # the sample's first tokens: its first chunk
    return vpb.GenerateStreamChunk(
        token_ids=completion.new_token_ids, prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion.num_tokens, cached_tokens=out.metrics.num_cached_tokens,
        output_logprobs=_logprobs(completion.new_logprobs), index=completion.index,
        input_logprobs=_input_logprobs(out) if first else None)


def complete(out: RequestOutput, completion: CompletionOutput, with_tokens: bool) -> vpb.GenerateComplete:
    """with_tokens=False for a stream's closing message: its chunks already carried every token. A unary reply
    reads the sample's whole history, once, from the finished output."""
    reply = vpb.GenerateComplete(
        output_ids=completion.token_ids if with_tokens else (), finish_reason=completion.finish_reason,
        prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion.num_tokens,
        cached_tokens=out.metrics.num_cached_tokens,
        output_logprobs=_logprobs(completion.logprobs if with_tokens else ()), index=completion.index,
        input_logprobs=_input_logprobs(out) if with_tokens else None)
    stop = completion.stop_reason
    if isinstance(stop, str):
        reply.matched_stop_str = stop
    elif isinstance(stop, int):
        reply.matched_token_id = stop
    return reply


def _logprobs(entries: tuple[TokenLogprob, ...]) -> vpb.OutputLogProbs | None:
    if not entries:
        return None
    return vpb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries],
        top_logprobs=[_top(e) for e in entries])


def _top(entry: TokenLogprob) -> vpb.TopLogProbs:
    return vpb.TopLogProbs(values=[lp for _, lp in entry.top], token_ids=[t for t, _ in entry.top])


def _input_logprobs(out: RequestOutput) -> vpb.InputLogProbs | None:
    """The prompt's logprobs (SamplingParams.prompt_logprobs): the first token's without a value."""
    if out.prompt_logprobs is None:
        return None
    scored = out.prompt_logprobs
    return vpb.InputLogProbs(
        token_logprobs=[vpb.InputTokenLogProb() if e is None else vpb.InputTokenLogProb(value=e.logprob)
                        for e in scored],
        token_ids=out.prompt_token_ids,
        top_logprobs=[vpb.TopLogProbs() if e is None else _top(e) for e in scored])


def kv_batch(batch: EventBatch) -> common_pb2.KvEventBatch:
    """Hashes are the engine's 64-bit chain keys, signed as the proto's int64 fields are. A snapshot goes out as
    vLLM relays send one: a single chunk that starts with a cleared event and re-stores every live block."""
    first = 0 if batch.snapshot else batch.first_event_id  # snapshot events are synthesized: id 0
    events = [_event(e, first + i if first else 0) for i, e in enumerate(batch.events)]
    reply = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0)
    if batch.snapshot:
        reply.events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
        reply.snapshot.CopyFrom(common_pb2.KvSnapshotChunk(index=0, count=1, blocks=len(events)))
    reply.events.extend(events)
    return reply


def _event(event: Any, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[event.block_hash], tier=common_pb2.KV_CACHE_TIER_DEVICE))
    assert isinstance(event, BlockStored)
    block = common_pb2.KvBlock(block_hash=event.block_hash, token_ids=event.token_ids, block_size=event.block_size)
    if event.lora_id is not None:
        block.lora_id = event.lora_id
    stored = common_pb2.KvBlocksStored(blocks=[block], tier=common_pb2.KV_CACHE_TIER_DEVICE)
    if event.parent_hash is not None:
        stored.parent_block_hash = event.parent_hash
    if event.lora_name is not None:
        stored.lora_name = event.lora_name
    return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
