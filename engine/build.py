"""`build_engine(config)`: every part of an engine made and wired in one place, in the one order their dependencies
allow: names checked against the registries that build them, the model loaded, then the tokenizer, the runner
(sampler and verifier inside), the paged blocks, the scheduler (drafter and stop rules inside), the constraint
compiler and the admission."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve.engine.admission import Admission, ModelLimits
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.block_manager import BlockManager
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduling_policy import SchedulingPolicy
from pagedserve.engine.core.stopping import StopRules
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.loading.chat_template import read_template_file
from pagedserve.engine.loading.model_loader import LoadedModel, load_model
from pagedserve.engine.loading.model_store import ModelSource, resolve_model
from pagedserve.engine.loading.tokenizer import Tokenizer
from pagedserve.engine.lora.layers import lora_dtype
from pagedserve.engine.lora.manager import AdapterManager
from pagedserve.engine.outputs import ModelDescription
from pagedserve.engine.pooling import PoolerConfig
from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.engine.runner.model_runner import ModelRunner
from pagedserve.engine.runner.row_argmax import native_max_argmax, torch_max_argmax
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.spec_decode.drafter import Drafter
from pagedserve.engine.structured_output.compiler import ConstraintCompiler
from pagedserve.engine.structured_output.registry import CONSTRAINT_BACKENDS
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.backends import (
    attention_backend_names, attention_requirements, layer_ops_names, layer_ops_requirements,
)
from pagedserve.quant.head_quant import HEAD_QUANTIZATIONS
from pagedserve.quant.registry import QUANT_METHODS


@dataclass(frozen=True, slots=True)
class EngineParts:
    config: EngineConfig
    source: ModelSource
    loaded: LoadedModel
    tokenizer: Tokenizer
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    constraints: ConstraintCompiler
    admission: Admission
    adapters: AdapterManager | None  # None: LoRA off
    description: ModelDescription


def backend_choices() -> dict[str, tuple[str, ...]]:
    """The names each backend-naming field of EngineConfig accepts, read from the registries that build them (the
    CLI's help lists them too)."""
    return {
        "attention_backend": attention_backend_names(),
        "layer_ops": layer_ops_names(),
        "quantization": tuple(QUANT_METHODS.names()),
        "lm_head_quantization": HEAD_QUANTIZATIONS,
        "structured_output_backend": tuple(CONSTRAINT_BACKENDS.names()),
        "reasoning_parser": tuple(REASONING_FORMATS.names()),
    }


def check_backends(config: EngineConfig) -> None:
    """Each backend name is one its registry has, and each chosen implementation's own rules (kernels/requirements.py)
    hold; ConfigError names the field (and lists the supported names). Runs before anything loads."""
    for name, supported in backend_choices().items():
        value = getattr(config, name)
        if value is not None and value not in supported:
            raise ConfigError(name, f"unknown {value!r}; supported: {', '.join(supported)}")
    for name, needs in (("attention_backend", attention_requirements(config.attention_backend)),
                        ("layer_ops", layer_ops_requirements(config.layer_ops))):
        if needs.cpu_only and config.device != "cpu":
            raise ConfigError(name, f"{getattr(config, name)} runs on CPU tensors only; device is {config.device!r}")
        if config.block_size < needs.min_block_size:
            raise ConfigError("block_size", needs.block_size_reason)


def build_engine(config: EngineConfig) -> EngineParts:
    check_backends(config)
    if config.seed is not None:
        torch.manual_seed(config.seed)  # the default generators (CPU and every CUDA device) unseeded requests use
    device = torch.device(config.device)
    source = resolve_model(config.model, config.tokenizer, config.hub, config.tokenizer_revision)
    override = read_template_file(config.chat_template) if config.chat_template else None  # fail before loading
    pooling = runs_pooling(config, source)
    loaded = load_model(source.weights, config.torch_dtype, config.quantization, device, config.gguf_weights,
                        config.lm_head_quantization, pooling=pooling)
    pooler = PoolerConfig.for_model(source.weights if source.weights.is_dir() else None, loaded.hf_config,
                                    config.pooler_overrides) if pooling else None
    tokenizer = Tokenizer(source.tokenizer_dir, loaded.model.args.vocab_size, override, source.name)
    native_picks = device.type == "cpu" and cpu_native.available()
    sampler = Sampler(tokenizer.eos_token_ids, native_max_argmax if native_picks else torch_max_argmax)
    runner = ModelRunner(loaded, config, device, sampler)
    max_len = runner.max_model_len
    blocks = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching, runner.kv_window)
    lora = config.lora
    adapters = None if lora is None else \
        AdapterManager(lora, runner.lora_layout, lora_dtype(loaded.dtype, device), device)
    drafter = None if config.speculative is None else Drafter(config.speculative, max_len, runner.native_capacity)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens,
                          None if lora is None else lora.max_loras, drafter=drafter, stop=StopRules(tokenizer, max_len),
                          policy=SchedulingPolicy(config.scheduling_policy),
                          long_prefill_token_threshold=config.long_prefill_token_threshold)
    scheduler.long_rope_after = blocks.long_rope_after = runner.long_rope_after  # LongRoPE's switch (None: no switch)
    grammar = functools.partial(CONSTRAINT_BACKENDS.get(config.structured_output_backend), tokenizer.hf,
                                runner.vocab_size, tokenizer.eos_token_ids)
    constraints = ConstraintCompiler(grammar, config.constraint_compile_timeout_s)
    limits = ModelLimits(runner.vocab_size, max_len, _kv_tokens(blocks, config, max_len), loaded.model.args.hidden_size)
    reasoning = REASONING_FORMATS.get(config.reasoning_parser) if config.reasoning_parser else None
    admission = Admission(limits, tokenizer, constraints, adapters, reasoning,
                          priority_scheduling=config.scheduling_policy == SchedulingPolicy.PRIORITY,
                          constraints_in_reasoning=config.constraints_in_reasoning, pooler=pooler)
    description = _describe(config, source, loaded, runner, tokenizer, blocks, pooler)
    return EngineParts(config, source, loaded, tokenizer, runner, blocks, scheduler, constraints, admission, adapters,
                       description)


def runs_pooling(config: EngineConfig, source: ModelSource) -> bool:
    """The runner `config.runner` names; auto: pooling for a sentence-transformers folder, whose modules.json says
    how its embeddings are pooled."""
    if config.runner != "auto":
        return config.runner == "pooling"
    return source.weights.is_dir() and (source.weights / "modules.json").is_file()


def _kv_tokens(blocks: BlockManager, config: EngineConfig, max_model_len: int) -> int:
    """The most tokens one request may hold in the KV cache (admission's limit)."""
    kv_tokens = blocks.num_blocks * config.block_size
    if blocks.peak_blocks(max_model_len, config.max_num_batched_tokens) <= blocks.num_blocks:
        # Every layer slides: a sequence holds only its window's blocks, so any context fits.
        kv_tokens = max(kv_tokens, max_model_len)
    return kv_tokens


def _describe(config: EngineConfig, source: ModelSource, loaded: LoadedModel, runner: ModelRunner,
              tokenizer: Tokenizer, blocks: BlockManager, pooler: PoolerConfig | None) -> ModelDescription:
    architectures = loaded.hf_config.get("architectures") or [type(loaded.model).__name__]
    return ModelDescription(
        architecture=architectures[0],
        quantization=loaded.quant.describe() + ("" if loaded.lm_head_quantization == "none"
                                                else f", lm_head {loaded.lm_head_quantization}"),
        dtype=str(loaded.dtype).removeprefix("torch."),
        kv_cache_dtype=runner.kv_spec.dtype.value,
        block_size=config.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        num_kv_blocks=blocks.num_blocks,
        model_path=str(source.weights),
        tokenizer_path=str(source.tokenizer_dir),
        model_type=str(loaded.hf_config.get("model_type", "")),
        reasoning_parser=config.reasoning_parser or "",
        runner="generate" if pooler is None else "pooling",
        pooling_type="" if pooler is None else pooler.pooling_type.value,
        embedding_size=0 if pooler is None else loaded.model.args.hidden_size,
    )
