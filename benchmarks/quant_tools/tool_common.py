"""Shared by the per-tool workers (each runs inside its own tool venv, never imports pagedserve).

A worker quantizes the base model, saves the checkpoint, reloads it with the tool's own CPU loader and
records what the tool computes: logits on fixed input ids and every quantized linear's dequantized
weight, taken as `layer(I)` (the tool's own arithmetic applied to the identity matrix: each output is
one product, so this is exact and needs no knowledge of the layout).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Full tensors kept for diagnosis; the rest are compared through their sha256.
KEEP_FULL = ("model.layers.1.self_attn.k_proj",)


def fixed_input_ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(4, vocab, (2, 24), generator=g)
    ids[:, 0] = 1
    return ids


def calibration_ids(n: int = 32, seqlen: int = 64, vocab: int = 128, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, vocab, (seqlen - 1,), generator=g).tolist() for _ in range(n)]


def calibration_from_argv(argv: list[str]) -> list[list[int]]:
    """`--calib FILE.json` (a list of token-id lists, e.g. real text) or the random default."""
    if "--calib" in argv:
        return json.loads(Path(argv[argv.index("--calib") + 1]).read_text())
    return calibration_ids()


def positional(argv: list[str]) -> list[str]:
    """argv without --flags and the value of --calib."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--calib":
            skip = True
        elif not a.startswith("--"):
            out.append(a)
    return out


def fp16_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to(torch.float16).contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


@torch.no_grad()
def identity_dequant(layer: torch.nn.Module, in_features: int) -> torch.Tensor:
    """W [out, in] as the tool computes it (bias removed)."""
    eye = torch.eye(in_features, dtype=torch.float16).unsqueeze(0)
    y = layer(eye).reshape(in_features, -1).to(torch.float32)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        y = y - bias.to(torch.float32)
    return y.t().contiguous()


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    out = {}
    for name, mod in model.named_modules():
        if name.endswith(LINEAR_SUFFIXES) and hasattr(mod, "qweight"):
            out[name[name.index("model.layers"):]] = mod
        elif name.endswith("lm_head") and hasattr(mod, "qweight"):  # lm_head=True recipes
            out["lm_head"] = mod
    return out


def in_features_of(mod: torch.nn.Module) -> int:
    for attr in ("in_features", "infeatures"):
        if hasattr(mod, attr):
            return int(getattr(mod, attr))
    raise AttributeError(f"cannot find in_features on {type(mod).__name__}")


@torch.no_grad()
def record(out_dir: Path, model: torch.nn.Module, recipe: dict, extra_oracles: dict | None = None) -> None:
    """Write tool_record.json + tool_outputs.tensors next to the checkpoint in out_dir."""
    from safetensors.torch import save_file

    model.eval()
    ids = fixed_input_ids(int(model.config.vocab_size))
    logits = model(input_ids=ids).logits.to(torch.float32)
    tensors = {"input_ids": ids, "logits": logits.contiguous()}
    hashes, layer_kinds = {}, {}
    for name, mod in sorted(quantized_linears(model).items()):
        w = identity_dequant(mod, in_features_of(mod))
        hashes[name] = fp16_sha256(w)
        layer_kinds[name] = type(mod).__name__
        if name in KEEP_FULL:
            tensors[f"dequant.{name}"] = w.to(torch.float16).contiguous()
    if not hashes:
        raise RuntimeError("no quantized linear layers found in the reloaded model")
    meta = {"recipe": recipe, "dequant_fp16_sha256": hashes, "tool_layer_classes": layer_kinds,
            "python": sys.version.split()[0], "torch": torch.__version__,
            "oracle_checks": extra_oracles or {}}
    save_file(tensors, str(out_dir / "tool_outputs.tensors"))
    (out_dir / "tool_record.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def copy_tokenizer(base: Path, out_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists() and not (out_dir / name).exists():
            shutil.copy(base / name, out_dir / name)
