"""The engine's command-line flags: one per EngineConfig field (a new field shows up as a flag without touching
this file), vLLM's spellings, byte sizes with units, and the help text of each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from pagedserve.engine.build import backend_choices
from pagedserve.engine.config import FIT_KV_CACHE, EngineConfig, field_choices
from pagedserve.engine.errors import ConfigError
from pagedserve.service.lora_flags import add_lora_flags
from pagedserve.service.spec_flags import add_speculative_flags

# EngineConfig fields with their own flag group instead of one flag each.
GROUPED_FIELDS = {"lora": add_lora_flags, "speculative": add_speculative_flags}

# vLLM's spellings of fields whose own flag says more (the first name sets the field).
_ALIASES = {"kv_cache_memory": ("--kv-cache-memory-bytes",)}

# Help for EngineConfig fields; every field becomes a flag (a new field shows up without touching this file).
_ENGINE_HELP = {
    "model": "HF folder (safetensors), .gguf file (or a folder holding one), a hub id already in the HF cache "
             "(org/name, or org/name:Q4_K_M for a GGUF repository; never downloaded), or an embedded model "
             "(SmolLM2-135M-Instruct, gemma-3-270m); default: the bundled SmolLM2-135M-Instruct GGUF",
    "tokenizer": "folder with the HF tokenizer files (or a cached hub id) to use instead of the model's (for "
                 "checkpoints saved without one, as AutoGPTQ/AutoAWQ write them, and GGUF files)",
    "revision": "a hub-id model's branch, tag or full commit hash in the cache (default: main; no effect on local "
                "paths)",
    "tokenizer_revision": "the same for a hub-id --tokenizer (default: main)",
    "download_dir": "the HF cache a hub id is read from, as vLLM downloads into it (default: HF_HUB_CACHE, "
                    "HF_HOME/hub or ~/.cache/huggingface/hub)",
    "tokenizer_mode": "auto and hf both load HF's fast tokenizer, the only kind this server runs",
    "dtype": "compute dtype: auto (CPU: bfloat16 where the kernel tier has native bf16, else float32 over a 16-bit "
             "checkpoint's own 16-bit weights; GPU: the checkpoint's), float32, bfloat16, float16",
    "kv_cache_dtype": "KV-cache dtype (auto: the model's)",
    "kv_cache_memory": "KV-cache memory budget, bytes or with a unit (512MiB, 2GiB); also vLLM's spelling "
                       "--kv-cache-memory-bytes (default: --gpu-memory-utilization's share on CUDA when given, else "
                       "1GiB)",
    "gpu_memory_utilization": "CUDA: the share of the device's memory (0-1] this server may hold: weights, one "
                              "full-size step, and a KV cache sized to what they leave of it, as vLLM's (not used "
                              "with --kv-cache-memory; no effect on CPU)",
    "block_size": "tokens per KV block",
    "max_num_seqs": "sequences decoded together in one step",
    "max_num_batched_tokens": "tokens processed per engine step (prefill chunks included)",
    "max_model_len": "context length limit: 4096, 32k, 128Ki; auto or -1: the model's limit, or what the KV cache "
                     "holds when that is less (default: the model's)",
    "long_prefill_token_threshold": "tokens one sequence computes per step at most, so a long prompt's chunks share "
                                    "steps with the prompts queued behind it (vLLM's; 0: only the step budget caps "
                                    "it)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "quantization": "force a quantization method (default: what the checkpoint says)",
    "gguf_weights": "GGUF files: packed keeps the file's quantized blocks and computes from them (CPU), dequantized "
                    "expands them into the compute dtype at load (auto: packed on CPU)",
    "lm_head_quantization": "CPU: q8_0 multiplies an unquantized LM head from int8 blocks made at load, as a GGUF "
                            "file holds it: ~half the head's bytes per token, its weights rounded (a tied model looks tokens up in "
                            "the same blocks); auto (default): "
                            "q8_0 for GPTQ/AWQ checkpoints on CPU, none otherwise; none: the head as stored",
    "attention_backend": "attention implementation (native: CPU only)",
    "layer_ops": "norm/SiLU/RoPE math (auto: native C for 16-bit CPU models; torch with --attention-backend torch)",
    "device": "cpu, cuda or cuda:N",
    "num_threads": "torch intra-op threads (default: torch's choice)",
    "adapt_threads": "CPU: run fewer compute threads while other processes take some of this process's cores, all "
                     "again when they leave (only without --num-threads and with a spinning OpenMP pool)",
    "native_step_max_batch": "CPU: decode-only steps of up to this many sequences run the whole layer stack in one "
                             "native call (Llama-family models, native attention, every linear with a native "
                             "kernel); 0: always the per-op torch path (default: where each weight kernel measured "
                             "it faster: 16 for grouped 4/8-bit rows (GGUF Q4_0/Q4_1/Q8_0, GPTQ/AWQ) with "
                             "int16/VNNI dots, 8 with fp32 ones, 2 otherwise)",
    "native_step_max_rows": "CPU, speculative decoding: a step with drafts runs natively past "
                            "--native-step-max-batch sequences while its rows (1 + drafts each) fit this, drafts "
                            "trimmed to fit; 0: off",
    "max_queued_requests": "admitted requests waiting for a batch slot; beyond it: RESOURCE_EXHAUSTED",
    "chat_template": "jinja chat template file used instead of the model's own (for chat messages)",
    "seed": "seeds the generators requests without their own seed sample from, once at start (the same requests in "
            "the same order sample the same tokens after a restart); default: from the OS",
    "runner": "generate: sample tokens (completions, chat, Generate); pooling: an embedding model (/v1/embeddings, "
              "Embed; no generations); auto: pooling for a sentence-transformers folder (modules.json), else generate",
    "pooler_config": "the pooling runner's rule as JSON, over the model folder's: "
                     "'{\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true | false}' (vLLM's; "
                     "default: sentence-transformers' modules, else LAST and normalized)",
    "scheduling_policy": "fcfs: arrival order; priority: requests' `priority` first (lower earlier), then arrival, and "
                         "under KV-cache pressure the lowest-priority, newest request gives way (as vLLM's)",
    "constraints_in_reasoning": "with --reasoning-parser: a structured output's grammar applies inside the thought too, "
                                "from the first token (vLLM's enable_in_reasoning); default: once the thought closes",
    "reasoning_parser": "the model's thought markers (<think> ... </think>): the OpenAI API answers the thought as "
                        "`reasoning` apart from `content`, and a structured output's grammar applies once the thought "
                        "has closed (as vLLM's)",
    "enforce_eager": "CUDA: run every step eagerly, without the decode steps' CUDA graphs (no effect on CPU)",
    "async_scheduling": "CUDA: launch each decode step before the previous one's tokens are read, so the host's "
                        "work per step overlaps the device's (rows greedy or sampled, penalties and logprobs too, "
                        "without grammar or bad words; other steps wait as usual); not with speculative decoding or "
                        "LoRA; on CPU nothing overlaps and each token arrives one step later",
    "cuda_graph_sizes": "CUDA: the decode batch sizes captured as CUDA graphs (a decode step pads to the next one, "
                        "larger ones run eagerly); one value N: 1 2 4 and the multiples of 8 up to N; several: those "
                        "sizes (default: max-num-seqs rounded up to a multiple of 8, at most 512; no effect on CPU)",
}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def json_flag(text: str, flag_field: str) -> Any:
    """A JSON flag's value (`--structured-outputs-config`, `--compilation-config`); not JSON: refused naming it.
    Its keys are read by engine/json_configs.py, which LLM(...)'s keyword arguments share."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(flag_field, f"is not valid JSON: {exc}") from None


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human_int(text: str) -> int:
    """vLLM's token counts: 4096, 32k / 25.6k (decimal, as k M G T and m g t), 32Ki (binary, Ki Mi Gi Ti; also a
    bare K, vLLM's older spelling)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?\s*", text)
    if not match or (match.group(2) or "").endswith("i") and match.group(2)[0] in "kmgt":
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (examples: 4096, 32k, 128Ki)")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix.endswith("i") or suffix == "K":
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix takes a whole number")
        return int(number) * _BINARY[suffix[0].upper()]
    if "." in number and not suffix:
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(float(number) * _DECIMAL[suffix.lower()]) if suffix else int(number)


def context_length(text: str) -> int:
    """--max-model-len: a token count, or vLLM's -1 / auto (the model's limit, or what the KV cache holds)."""
    return FIT_KV_CACHE if text.strip() in ("-1", "auto") else human_int(text)


_TOKEN_COUNTS = {"max_model_len": context_length, "max_num_batched_tokens": human_int}


def _flag_type(field: dataclasses.Field) -> type | None:
    annotation = str(field.type)
    if field.name.endswith("_memory"):
        return parse_bytes
    if field.name in _TOKEN_COUNTS:
        return _TOKEN_COUNTS[field.name]
    for name, kind in (("bool", None), ("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return kind
    raise TypeError(f"EngineConfig.{field.name}: no CLI mapping for {annotation}")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    choices = {**field_choices(), **backend_choices()}
    for field in dataclasses.fields(EngineConfig):
        if field.name in GROUPED_FIELDS:
            GROUPED_FIELDS[field.name](parser)
            continue
        flag = "--" + field.name.replace("_", "-")
        names = f"; one of {', '.join(choices[field.name])}" if field.name in choices else ""
        help_text = f"{_ENGINE_HELP.get(field.name, field.name)}{names} (default: {field.default})"
        if str(field.type).startswith("tuple[int"):  # vLLM's space-separated lists (--cuda-graph-sizes 1 2 4)
            group.add_argument(flag, type=int, nargs="+", default=None, help=help_text)
            continue
        kind = _flag_type(field)
        if kind is None:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, *_ALIASES.get(field.name, ()), type=kind, default=None, help=help_text)
