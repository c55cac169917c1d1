"""PEFT's LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) -> `LoraWeights` for one base model.

Only what pagedserve computes exactly is accepted: plain LoRA on the attention and MLP linears, scale alpha/r (or
alpha/sqrt(r) with rsLoRA), per-module ranks and alphas (`rank_pattern`, `alpha_pattern`). Anything else (DoRA, LoRA
biases, `modules_to_save`, embedding or LM-head targets, pickled weights, ranks above `max_lora_rank`, shapes that do
not fit the base) is refused with `AdapterLoadError` naming the option, the file or the tensor; nothing is
pickle-loaded, ever.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedserve.engine.errors import AdapterLoadError
from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.engine.lora.weights import SUPPORTED_TARGETS, LoraLayout, LoraWeights

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PICKLED = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight")
_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<owner>self_attn|mlp)\.(?P<part>\w+)")
# Options that change the math pagedserve does: refused when set to anything but their no-op value.
_REFUSED = {"use_dora": "DoRA is not supported", "lora_bias": "LoRA bias is not supported",
            "modules_to_save": "fully trained extra modules are not supported (only LoRA deltas are applied)",
            "layer_replication": "layer replication is not supported", "fan_in_fan_out": "only nn.Linear layouts",
            "target_parameters": "parameter targets are not supported", "trainable_token_indices": "not supported"}


@dataclass(frozen=True, slots=True)
class PeftConfig:
    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...]

    def scale(self, module: str, rank: int) -> float:
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_of(self, module: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.rank)


def _pattern_key(patterns: dict[str, Any], module: str) -> str:
    """PEFT's rule: the first pattern key matching the end of the module name (after a dot) wins."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), module)


def read_config(folder: Path, max_rank: int) -> PeftConfig:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterLoadError(CONFIG_FILE, f"{path} does not exist; a PEFT LoRA folder has {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(CONFIG_FILE, f"{path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterLoadError(CONFIG_FILE, f"{path} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError("peft_type", f"{raw.get('peft_type')!r}: only LORA adapters are supported")
    for option, why in _REFUSED.items():
        if raw.get(option):
            raise AdapterLoadError(option, f"{raw[option]!r}: {why}")
    if raw.get("bias", "none") != "none":
        raise AdapterLoadError("bias", f"{raw['bias']!r}: LoRA bias is not supported (only 'none')")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterLoadError("r", f"must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterLoadError("lora_alpha", f"must be a finite number, got {alpha!r}")
    rank_pattern, alpha_pattern = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    for field, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in pattern.values()):
            raise AdapterLoadError(field, f"must map module patterns to positive numbers, got {pattern!r}")
    for field, value in (("r", rank), *((f"rank_pattern.{k}", v) for k, v in rank_pattern.items())):
        if value > max_rank:
            raise AdapterLoadError(field, f"rank {value} is above max_lora_rank ({max_rank})")
    return PeftConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), rank_pattern, alpha_pattern,
                      _targets(raw.get("target_modules")))


def _targets(value: Any) -> tuple[str, ...]:
    """A list must name supported modules only; a regex string (or 'all-linear') is checked against the tensors."""
    if isinstance(value, str):
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise AdapterLoadError("target_modules", f"must be a non-empty list of module names, got {value!r}")
    unsupported = sorted(set(value) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise AdapterLoadError("target_modules", f"{', '.join(unsupported)} cannot be adapted; supported: "
                               f"{', '.join(SUPPORTED_TARGETS)}")
    return tuple(value)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = [name for name in _PICKLED if (folder / name).is_file()]
        if pickled:
            raise AdapterLoadError(WEIGHTS_FILE, f"{folder / pickled[0]} is a pickle, which pagedserve never loads; "
                                   f"save the adapter with safe_serialization=True ({WEIGHTS_FILE})")
        raise AdapterLoadError(WEIGHTS_FILE, f"{path} does not exist")
    try:
        return load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise AdapterLoadError(WEIGHTS_FILE, f"{path} is not a readable safetensors file: {exc}") from None


def read_peft_adapter(info: AdapterInfo, layout: LoraLayout, max_rank: int, dtype: torch.dtype,
                      device: torch.device = torch.device("cpu")) -> LoraWeights:
    """Reads and validates `info.path` for this base (matrices in `dtype` on `device`); `info`'s rank and targets
    are filled from the files."""
    folder = Path(info.path)
    if not folder.is_dir():
        raise AdapterLoadError("lora_path", f"{info.path} is not a folder (a PEFT LoRA folder is expected)")
    config = read_config(folder, max_rank)
    modules = _pair_tensors(read_tensors(folder))
    parts: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in modules.items():
        slot, offset, a, b = _place(module, a, b, config, layout)
        parts.setdefault(slot, []).append((offset, b.shape[0], a, b))
    slots = tuple(_slot_pair(layout.slots[i].in_features, layout.slots[i].out_features, parts[i], dtype, device)
                  if i in parts else None for i in range(len(layout.slots)))
    targets = tuple(sorted({_MODULE.fullmatch(m)["part"] for m in modules}))
    rank = max((a.shape[0] for a, _ in modules.values()), default=config.rank)
    return LoraWeights(AdapterInfo(info.name, info.adapter_id, info.path, rank, targets), slots)


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A, B)}; any other tensor (DoRA magnitudes, embeddings, biases) is refused by name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterLoadError(key, "not a LoRA A/B matrix of a supported linear (pagedserve applies only "
                                   f"lora_A/lora_B of {', '.join(SUPPORTED_TARGETS)})")
        module = match["module"]
        if _MODULE.fullmatch(module) is None or _MODULE.fullmatch(module)["part"] not in SUPPORTED_TARGETS:
            raise AdapterLoadError("target_modules", f"{key}: {module} cannot be adapted; supported: "
                                   f"{', '.join(SUPPORTED_TARGETS)}")
        found.setdefault(module, {})[match["which"]] = tensor
    for module, pair in found.items():
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise AdapterLoadError(f"base_model.model.{module}.{missing}.weight", "missing: A and B come in pairs")
    if not found:
        raise AdapterLoadError(WEIGHTS_FILE, "holds no LoRA matrices")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in found.items()}


def _place(module: str, a: torch.Tensor, b: torch.Tensor, config: PeftConfig, layout: LoraLayout):
    """Checks one module's A [r, in] and B [out, r] against the base; -> (slot, output offset, A, scaled B)."""
    match = _MODULE.fullmatch(module)
    layer, owner, part = int(match["layer"]), match["owner"], match["part"]
    key = f"base_model.model.{module}"
    if config.target_modules and part not in config.target_modules:
        raise AdapterLoadError("target_modules", f"{key} has weights but {part} is not in target_modules")
    where = layout.find(layer, owner, part) if layer < layout.num_layers else None
    if where is None:
        raise AdapterLoadError(f"{key}.lora_A.weight", f"the base model has no {module} "
                               f"({layout.num_layers} layers): the adapter was made for another model")
    slot, offset, width = where
    rank, in_features = config.rank_of(module), layout.slots[slot].in_features
    if a.dim() != 2 or tuple(a.shape) != (rank, in_features):
        raise AdapterLoadError(f"{key}.lora_A.weight", f"shape {tuple(a.shape)} does not fit the base: expected "
                               f"({rank}, {in_features}) (r, in_features)")
    if b.dim() != 2 or tuple(b.shape) != (width, rank):
        raise AdapterLoadError(f"{key}.lora_B.weight", f"shape {tuple(b.shape)} does not fit the base: expected "
                               f"({width}, {rank}) (out_features, r)")
    for name, t in (("lora_A", a), ("lora_B", b)):
        if not t.dtype.is_floating_point or not torch.isfinite(t).all():
            raise AdapterLoadError(f"{key}.{name}.weight", "must hold finite floating-point values")
    return slot, offset, a.float(), b.float() * config.scale(module, rank)


def _slot_pair(in_features: int, out_features: int, parts: list, dtype: torch.dtype, device: torch.device):
    """Stacks the A's of one slot's modules and places their B's block-diagonally -> (A [R, in], B^T [R, out],
    the blocks as (first rank row, end, first column, end))."""
    parts = sorted(parts, key=lambda p: p[0])
    a = torch.cat([part[2] for part in parts])
    b_t = torch.zeros(a.shape[0], out_features)
    blocks, row = [], 0
    for offset, width, part_a, part_b in parts:
        r = part_a.shape[0]
        b_t[row:row + r, offset:offset + width] = part_b.T
        blocks.append((row, row + r, offset, offset + width))
        row += r
    assert a.shape[1] == in_features
    return a.to(device, dtype).contiguous(), b_t.to(device, dtype).contiguous(), tuple(blocks)
