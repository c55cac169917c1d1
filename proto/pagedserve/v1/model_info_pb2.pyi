from pagedserve.v1 import adapters_pb2 as _adapters_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "quantization", "dtype", "kv_cache_dtype", "block_size", "max_context_length", "vocab_size", "eos_token_ids", "limits", "kv_cache", "scheduler", "has_chat_template", "adapters", "runner", "embedding_size", "pooling_type")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    quantization: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_context_length: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    limits: Limits
    kv_cache: KvCacheStats
    scheduler: SchedulerStats
    has_chat_template: bool
    adapters: _containers.RepeatedCompositeFieldContainer[_adapters_pb2.Adapter]
    runner: str
    embedding_size: int
    pooling_type: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., quantization: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheStats, _Mapping]] = ..., scheduler: _Optional[_Union[SchedulerStats, _Mapping]] = ..., has_chat_template: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[_adapters_pb2.Adapter, _Mapping]]] = ..., runner: _Optional[str] = ..., embedding_size: _Optional[int] = ..., pooling_type: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_queued_requests", "max_message_bytes", "max_n", "max_logprobs")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queued_requests: int
    max_message_bytes: int
    max_n: int
    max_logprobs: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_n: _Optional[int] = ..., max_logprobs: _Optional[int] = ...) -> None: ...

class KvCacheStats(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "used_blocks", "usage", "prefix_cache_queries", "prefix_cache_hits")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    used_blocks: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "num_preemptions", "draining")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    num_preemptions: int
    draining: bool
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
