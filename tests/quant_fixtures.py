"""Helpers for the GPTQ/AWQ tests: the committed tool fixtures and a full-sequence forward of our model.

The fixtures (tests/fixtures/quant/*, see its README) were made by the real tools; each holds the
checkpoint, the tool's logits on fixed ids (tool_outputs.tensors) and the sha256 of every
dequantized linear as the tool computed it (tool_record.json).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loading.model_loader import LoadedModel, load_model
from pagedserve.engine.runner.model_runner import ModelRunner
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.models.layers import ForwardContext
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.layer_ops import TorchLayerOps
from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.packing import default_g_idx, pack_cols, pack_rows
from pagedserve.quant.registry import quant_config_for

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "tool_record.json").exists())


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def tool_record(name: str) -> dict:
    return json.loads((FIXTURES / name / "tool_record.json").read_text())


def tool_quantized_head(name: str) -> bool:
    """Whether the recipe asked the tool to quantize the LM head too (GPTQModel's lm_head=True)."""
    return bool(tool_record(name)["recipe"].get("config", {}).get("lm_head", False))


def tool_outputs(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "tool_outputs.tensors"))


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(_read_checkpoint(str(model_dir), tuple(f.stat().st_mtime_ns for f in model_dir.glob("*.safetensors"))))


@functools.lru_cache(maxsize=2)
def _read_checkpoint(model_dir: str, _mtimes: tuple) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def fp16_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to(torch.float16).contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def build_linear(model_dir: Path, prefix: str, kernel: str = "auto", dtype: torch.dtype = torch.float32,
                 process: bool = True) -> QuantLinear:
    """One QuantLinear loaded the way the model loader does it (create, load each tensor, check, process)."""
    cfg = quant_config_for(hf_config(model_dir), None, model_dir, kernel=kernel)
    tensors = {k[len(prefix) + 1:]: v for k, v in checkpoint_tensors(model_dir).items() if k.startswith(prefix + ".")}
    out_f = tensors["scales"].shape[1]
    rows = tensors["qweight"].shape[0]  # GPTQ packs along the input dim, AWQ along the output dim
    in_f = rows * (32 // cfg.spec_for(prefix).bits) if cfg.name == "gptq" else rows
    layer = QuantLinear(in_f, out_f, False, cfg.linear_method(prefix), dtype)
    for name, t in tensors.items():
        layer.method.load_tensor(layer, name, t, prefix)
    missing = layer.method.required_tensors(layer) - layer.loaded_tensors
    assert not missing, missing
    if process:
        layer.method.process_weights_after_loading(layer)
    return layer


def reference_weight(model_dir: Path, prefix: str) -> GroupQuantWeight:
    """The checkpoint's layer in the canonical layout, before any kernel repacks it."""
    layer = build_linear(model_dir, prefix, process=False)
    return layer.method.to_group_quant(layer)


def copy_fixture(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst)
    return dst


def rewrite_checkpoint(model_dir: Path, edit) -> None:
    """edit(dict of tensors) mutates the checkpoint in place (for corruption tests)."""
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        edit(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})


def rewrite_config(model_dir: Path, edit) -> None:
    cfg = hf_config(model_dir)
    edit(cfg)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def load(model_dir: Path, dtype: torch.dtype = torch.float32, quantization: str | None = None) -> LoadedModel:
    return load_model(model_dir, dtype, quantization, torch.device("cpu"))


@torch.inference_mode()
def full_logits(
    loaded: LoadedModel, ids: torch.Tensor, kv_cache_dtype: str = "auto", layer_ops: TorchLayerOps | None = None
) -> torch.Tensor:
    """Logits at every position of each row of ids [B, T] (one prefill step through the paged cache), with the
    runner's own layer ops unless others are given."""
    block = 16
    b, t = ids.shape
    blocks_per_seq = -(-t // block)
    args = loaded.model.args
    token_bytes = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4  # K and V, at most fp32
    config = EngineConfig(model=str(loaded.path), kv_cache_dtype=kv_cache_dtype, block_size=block,
                          kv_cache_memory=(b * blocks_per_seq + 1) * block * token_bytes)
    runner = ModelRunner(loaded, config, torch.device("cpu"), Sampler(frozenset()))  # its KV cache and ops only
    assert runner.num_blocks >= b * blocks_per_seq
    tables = torch.arange(b * blocks_per_seq, dtype=torch.int32).view(b, blocks_per_seq)
    slots = torch.cat([tables[i].repeat_interleave(block)[:t].long() * block + torch.arange(t) % block
                       for i in range(b)])
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, (b + 1) * t, t, dtype=torch.int32),
        seq_lens=torch.full((b,), t, dtype=torch.int32), block_tables=tables, slot_mapping=slots,
        max_query_len=t, max_seq_len=t, query_lens_host=(t,) * b, seq_lens_host=(t,) * b)
    ctx = ForwardContext(meta, runner.kv_cache, runner.attn_impl, layer_ops or runner.layer_ops)
    hidden = loaded.model(ids.reshape(-1), torch.arange(t).repeat(b), ctx)
    return loaded.model.compute_logits(hidden).view(b, t, -1)


def quant_linears(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and hasattr(m, "qkernel")}


def random_weight(k: int, n: int, bits: int, group: int, act_order: bool, seed: int = 0) -> GroupQuantWeight:
    g = torch.Generator().manual_seed(seed)
    g_idx = default_g_idx(k, group)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    groups = int(g_idx.max()) + 1
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    z = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32)
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    return GroupQuantWeight(pack_rows(q, bits), pack_cols(z, bits), s, g_idx, bits, k, n)


def dequantized_reference(name: str) -> torch.nn.Module:
    """transformers' Llama built from the checkpoint's config without its quantization, holding every quantized
    linear as the tools dequantize it (test_quant_fixtures checks these weights against the tools' own hashes)
    and every other tensor as stored, in float32."""
    import transformers

    model_dir = fixture_dir(name)
    cfg = {k: v for k, v in hf_config(model_dir).items() if k != "quantization_config"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.float32).eval()
    state = {k: v.float() for k, v in checkpoint_tensors(model_dir).items() if k.endswith(".weight")}
    for prefix in tool_record(name)["dequant_fp16_sha256"]:
        state[f"{prefix}.weight"] = reference_weight(model_dir, prefix).dequantize(torch.float32)
    model.load_state_dict(state, strict=True)
    return model


def grouped_logits_atol() -> float:
    """How far an engine's float32 logits on these tool fixtures may sit from transformers' on the dequantized
    weights. fp32 kernels: summation order only (1e-4). The int16 builds (every tier with AVX2: INT16_GROUPED_ISAS)
    round each decode row's activations to int16 per 32 inputs before the grouped linears (kernels/cpu/act_q16.h):
    relative ~1.5e-5 of the block's largest value per input, which these random 2-layer fixtures amplify to at most
    1.2e-3 on logits up to ~3.4 (measured, the same bits on every int16 tier); 5e-3 bounds it, and the tests'
    greedy checks still hold the tokens to transformers'."""
    return 5e-3 if cpu_packed.group_grouped_isa(cpu_packed.build()) in cpu_packed.INT16_GROUPED_ISAS else 1e-4
