"""Engine configuration: assembled once (CLI or LLM(...)), frozen, validated here. Fields that name a backend
(attention, layer ops, quantization, LM head, grammar library) are checked against the registries that build them,
where they are built (`engine/build.py: check_backends`), so this module imports no backend."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.core.scheduling_policy import SCHEDULING_POLICIES
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.loading.hub_cache import HubCache, is_hub_id
from pagedserve.engine.lora.config import LoraConfig
from pagedserve.engine.pooling import RUNNERS, PoolerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.kernels.kv_cache import ALIASES as KV_DTYPE_ALIASES, KVDtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}

DEFAULT_KV_CACHE_MEMORY = 1 << 30
FIT_KV_CACHE = -1  # max_model_len: vLLM's -1 / "auto", the model's limit or what the KV cache holds if that is less
MAX_CUDA_GRAPH_SIZE = 512  # vLLM's largest default capture size
GGUF_WEIGHTS = ("auto", "packed", "dequantized")  # engine/loading/model_loader.py's packed_gguf_types reads them
# vLLM's tokenizer modes that mean HF's fast tokenizer, the only one this engine loads (slow, mistral and custom
# tokenizers are other libraries)
TOKENIZER_MODES = ("auto", "hf")


def field_choices() -> dict[str, tuple[str, ...]]:
    """The names each named field that is not a backend accepts (backends: `engine/build.py: backend_choices`)."""
    return {"kv_cache_dtype": ("auto", *KV_DTYPE_ALIASES, *(kv.value for kv in KVDtype)), "gguf_weights": GGUF_WEIGHTS,
            "scheduling_policy": SCHEDULING_POLICIES, "runner": RUNNERS, "tokenizer_mode": TOKENIZER_MODES}


def parse_dtype(name: str) -> torch.dtype | None:
    """`auto` -> None (follow the checkpoint); otherwise a torch dtype."""
    name = _DTYPE_ALIASES.get(name, name)
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ConfigError("dtype", f"unknown {name!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model; a hub id is served from the HF cache on disk
    # a folder of HF tokenizer files (or a cached hub id), for checkpoints saved without one
    tokenizer: str | None = None
    # vLLM's --revision / --tokenizer-revision / --download-dir: which cached snapshot of a hub id, and which cache
    # (engine/loading/hub_cache.py). No effect on local paths, as in vLLM
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    tokenizer_mode: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # Bytes for K and V blocks of all layers (vLLM's kv_cache_memory_bytes). None: gpu_memory_utilization sizes the
    # cache on CUDA when given, else DEFAULT_KV_CACHE_MEMORY (engine/runner/kv_budget.py)
    kv_cache_memory: int | None = None
    # vLLM's --gpu-memory-utilization, CUDA only: the share of the device's memory this engine may hold (weights,
    # one full-size step's activations, KV cache); the cache gets what a profiled step leaves of it
    # (engine/runner/kv_budget.py). Ignored when kv_cache_memory is given, as vLLM ignores it then; no effect on CPU
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # vLLM's --long-prefill-token-threshold: a sequence computes at most this many tokens in one step, so a long
    # prompt's chunks share steps with the prompts behind it (engine/core/scheduler.py). 0: no cap but the budget
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # None: the model's own limit; FIT_KV_CACHE: no more than the KV cache holds
    enable_prefix_caching: bool = True
    quantization: str | None = None  # None: whatever the checkpoint says
    # GGUF files: "packed" keeps the file's 4/5/6/8-bit blocks and multiplies from them (CPU); "dequantized" expands
    # every weight into the compute dtype at load; "auto": packed on CPU where the packed kernels build
    gguf_weights: str = "auto"
    # "q8_0": an unquantized LM head is multiplied from int8 blocks made at load (quant/head_quant.py; CPU; it
    # rounds the head's weights, lookups keep the embedding as stored). "auto": q8_0 for GPTQ/AWQ checkpoints on
    # CPU, whose 16-bit head would be a large share of each token's reads; "none" everywhere else
    lm_head_quantization: str = "auto"
    attention_backend: str = "auto"
    # auto: native fused C for 16-bit models on CPU, torch otherwise; and torch whenever attention_backend is
    # "torch", which asks for the pure-torch reference path (see layer_ops_choice).
    layer_ops: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None  # None: leave torch's choice
    # CPU, threads from the budget, spinning pool: fewer threads while other processes hold some of the cores
    adapt_threads: bool = True
    max_queued_requests: int = 1024
    # CPU decode-only steps of at most this many sequences run the whole layer stack in one native call when every
    # linear of the model has a native kernel (engine/runner/native_step.py); 0 turns it off. None: the smallest
    # crossover its linears' kernels declare (NativeLinear.native_max_batch, measured by
    # benchmarks/native_step_crossover.py): past it the torch path's matmuls are faster
    native_step_max_batch: int | None = None
    # A step with speculative drafts runs natively past native_step_max_batch sequences while its rows (1 + drafts
    # per sequence) stay within this, the drafter trimming drafts to fit (engine/runner/native_capacity.py). 0: off,
    # since fewer drafts natively can lose to all drafts on the torch path; docs/speculative-decoding.md has the
    # command that decides it on a host
    native_step_max_rows: int = 0
    chat_template: str | None = None  # a jinja file replacing the model's chat template
    structured_output_backend: str = "llguidance"  # the grammar library (docs/structured-outputs.md)
    constraint_compile_timeout_s: float = 10.0  # a constraint still compiling after this is refused
    # vLLM's --reasoning-parser: the model's thought markers (engine/reasoning.py). Constraints wait for the thought to
    # close; the OpenAI front end answers the thought as `reasoning`. None: output is all content
    reasoning_parser: str | None = None
    # vLLM's structured_outputs_config.enable_in_reasoning: with a reasoning parser, a constraint applies inside the
    # thought too (from the first token) instead of once the thought closes
    constraints_in_reasoning: bool = False
    lora: LoraConfig | None = None  # None: LoRA adapters off (docs/lora.md)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding (docs/speculative-decoding.md)
    # CUDA: decode-only steps replay CUDA graphs captured at start, one per size of cuda_graph_sizes
    # (engine/runner/cuda_graphs.py); True runs every step eagerly. No effect on CPU.
    enforce_eager: bool = False
    # vLLM's --cuda-graph-sizes: () the default (as one value, max_num_seqs rounded up to a multiple of 8, at most
    # MAX_CUDA_GRAPH_SIZE); one value N: 1, 2, 4 and the multiples of 8 up to N; several: exactly those sizes.
    # Sizes past the first one that holds max_num_seqs are not captured. No effect on CPU.
    cuda_graph_sizes: tuple[int, ...] = ()
    # vLLM's --async-scheduling: a decode step is launched before the step in flight's tokens are read, so the host's
    # per-step work overlaps the device's (engine/core/lookahead.py). Steps that sample on the host stay synchronous.
    async_scheduling: bool = False
    # vLLM's --scheduling-policy (engine/core/scheduling_policy.py): "fcfs", or "priority" (requests carry a priority,
    # lower first; without it a non-zero priority is refused)
    scheduling_policy: str = "fcfs"
    # vLLM's --seed: seeds the generators that requests without a seed of their own sample from, once at start, so
    # the same requests in the same order sample the same tokens after a restart. None: seeded from the OS
    seed: int | None = None
    # vLLM's --runner: "generate" samples tokens; "pooling" answers embeddings (engine/pooling.py) and no
    # generations; "auto": pooling for a sentence-transformers folder (modules.json), generate otherwise
    runner: str = "auto"
    # vLLM's --pooler-config, a JSON object: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}, over the
    # model folder's own rule (engine/pooling.py: PoolerConfig.for_model). Only with the pooling runner
    pooler_config: str | None = None

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        for name, supported in field_choices().items():
            value = getattr(self, name)
            if value is not None and value not in supported:
                raise ConfigError(name, f"unknown {value!r}; supported: {', '.join(supported)}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError("block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.native_step_max_batch is not None and (
                not isinstance(self.native_step_max_batch, int) or self.native_step_max_batch < 0):
            raise ConfigError("native_step_max_batch", f"must be None or an integer >= 0, got "
                                                       f"{self.native_step_max_batch!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or isinstance(self.long_prefill_token_threshold, bool) \
                or self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold", f"must be an integer >= 0 (0: off), got "
                                                              f"{self.long_prefill_token_threshold!r}")
        if not isinstance(self.native_step_max_rows, int) or self.native_step_max_rows < 0:
            raise ConfigError("native_step_max_rows", f"must be an integer >= 0, got {self.native_step_max_rows!r}")
        for name in ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_queued_requests"):
            value = getattr(self, name)
            if value is None and name == "kv_cache_memory":
                continue
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, (int, float))
                                        or not 0 < utilization <= 1):
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {utilization!r}")
        if not isinstance(self.constraint_compile_timeout_s, (int, float)) or not self.constraint_compile_timeout_s > 0:
            raise ConfigError("constraint_compile_timeout_s", f"must be > 0, got {self.constraint_compile_timeout_s!r}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ConfigError("lora", f"must be a LoraConfig or None, got {type(self.lora).__name__}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError("speculative",
                              f"must be a SpeculativeConfig or None, got {type(self.speculative).__name__}")
        self._check_cuda_graphs()
        self._check_async_scheduling()
        if self.pooler_config is not None:
            PoolerConfig.parse_json(self.pooler_config)
            if self.runner == "generate":
                raise ConfigError("pooler_config", "applies to the pooling runner (--runner pooling), not generate")
        if self.runner == "pooling" and self.speculative is not None:
            raise ConfigError("speculative", "an embedding model (--runner pooling) generates nothing to speculate on")
        if self.max_model_len is not None and self.max_model_len != FIT_KV_CACHE and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2 (or -1: what the KV cache holds), got "
                                               f"{self.max_model_len}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise ConfigError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", f"must be >= 1, got {self.num_threads}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError("device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir() \
                and not is_hub_id(self.tokenizer):
            raise ConfigError("tokenizer", f"neither a folder nor a hub id: {self.tokenizer}")
        for name in ("revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(name, f"must be a non-empty string, got {value!r}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError("chat_template", f"file not found: {self.chat_template}")
        if self.lm_head_quantization not in ("auto", "none") and self.device != "cpu":
            raise ConfigError("lm_head_quantization", f"a {self.lm_head_quantization} head is computed on CPU only; "
                                                      f"device is {self.device!r}")
        if self.gguf_weights == "packed" and self.device != "cpu":
            raise ConfigError("gguf_weights", f"packed GGUF weights are computed on CPU only; device is {self.device!r}")

    @property
    def hub(self) -> HubCache:
        """Where a hub-id model is looked up, and at which revision."""
        return HubCache(self.download_dir, self.revision)

    def _check_cuda_graphs(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError("enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        sizes = self.cuda_graph_sizes
        if isinstance(sizes, list):  # a command line's or JSON's list; kept as a tuple so the config stays hashable
            object.__setattr__(self, "cuda_graph_sizes", sizes := tuple(sizes))
        if not isinstance(sizes, tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_CUDA_GRAPH_SIZE for s in sizes):
            raise ConfigError("cuda_graph_sizes", f"must be batch sizes from 1 to {MAX_CUDA_GRAPH_SIZE}, got {sizes!r}")
        if len(set(sizes)) != len(sizes):
            raise ConfigError("cuda_graph_sizes", f"lists a size twice: {sizes!r}")

    def _check_async_scheduling(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError("async_scheduling", f"must be true or false, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative is not None:
            raise ConfigError("async_scheduling", "does not combine with speculative decoding: the drafter proposes "
                                                  "from tokens on the host, which a look-ahead step does not wait for")
        if self.async_scheduling and self.lora is not None:
            raise ConfigError("async_scheduling", "does not combine with LoRA: adapters are registered and unloaded "
                                                  "between steps, and a look-ahead step would still be running")

    @property
    def layer_ops_choice(self) -> str:
        """The layer ops to select: `layer_ops`, except that auto follows attention_backend="torch" (the pure-torch
        reference path keeps its layer math in torch too)."""
        if self.layer_ops == "auto" and self.attention_backend == "torch":
            return "torch"
        return self.layer_ops

    @property
    def pooler_overrides(self) -> dict[str, object]:
        return {} if self.pooler_config is None else PoolerConfig.parse_json(self.pooler_config)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)
