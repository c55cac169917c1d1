"""`pagedserve calibrate-kv`: measure K/V ranges over calibration texts and write FP8 KV scales into a checkpoint.

The scales are written the way vLLM reads them from llm-compressor checkpoints: one tensor per layer named
`model.layers.N.self_attn.k_scale` / `.v_scale` (dequantization factors, stored = real / scale), and config.json's
`quantization_config` = compressed-tensors with a `kv_cache_scheme` (float, 8 bits, symmetric, static; strategy
`tensor` for one scale per layer, `attn_head` for one per KV head). pagedserve's loader reads the same names back
(kernels/kv_scales.py). Unlike first-prefill calibration, the range is the running maximum over every token of every
text given, so one short first prompt cannot decide it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.kernels.attention import AttentionImpl, WriteObservingAttention
from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache
from pagedserve.kernels.kv_scales import ScaleRule

logger = logging.getLogger(__name__)

SCALES_FILE = "kv_scales.safetensors"
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class KVCalibrationConfig:
    model: Path  # an HF folder (config.json + *.safetensors)
    output: Path  # a new folder: the model's files plus the scales
    texts: tuple[Path, ...]  # UTF-8 text files; each is one prefill of up to max_tokens tokens
    kv_cache_dtype: str = "fp8_e4m3"
    margin: float = 4.0  # as first-prefill calibration: texts never cover all traffic, and FP8 range is cheap
    per_tensor: bool = False
    max_tokens: int = 2048
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not (self.model / "config.json").is_file() or not any(self.model.glob("*.safetensors")):
            raise ConfigError("model", f"{self.model} is not an HF folder with config.json and *.safetensors "
                              "(calibrate-kv writes scales into safetensors checkpoints, not GGUF files)")
        if self.output.resolve() == self.model.resolve() or (self.output.exists() and any(self.output.iterdir())):
            raise ConfigError("output", f"{self.output} must be a new or empty folder, not the model's own")
        if not self.texts:
            raise ConfigError("texts", "at least one calibration text file is needed")
        for path in self.texts:
            if not path.is_file():
                raise ConfigError("texts", f"{path} is not a file")
        kv = KVDtype.parse(self.kv_cache_dtype, torch.float32)
        if kv.has_row_scales:
            raise ConfigError("kv_cache_dtype", f"{self.kv_cache_dtype} rows carry their own scales: nothing to calibrate")
        if not kv.is_fp8:
            raise ConfigError("kv_cache_dtype", f"{self.kv_cache_dtype} is not an fp8 dtype")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        ScaleRule(margin=self.margin)  # validates the margin


class AmaxObserver(WriteObservingAttention):
    """Passes everything to `inner`; remembers, per layer, the largest |K| and |V| written for each KV head."""

    def __init__(self, inner: AttentionImpl, layers: list[LayerKVCache]):
        super().__init__(inner)
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        heads = layers[0].k_scale.numel()
        self.k_amax = torch.zeros(len(layers), heads)
        self.v_amax = torch.zeros(len(layers), heads)
        self.tokens = 0

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        i = self._index[id(cache)]
        self.k_amax[i] = torch.maximum(self.k_amax[i], key.detach().float().abs().amax(dim=(0, 2)).cpu())
        self.v_amax[i] = torch.maximum(self.v_amax[i], value.detach().float().abs().amax(dim=(0, 2)).cpu())
        if i == 0:
            self.tokens += key.shape[0]
        self.inner.write_kv(key, value, cache, slot_mapping)


def observe(config: KVCalibrationConfig) -> AmaxObserver:
    """Prefill every text through the engine with a 16-bit KV cache (K unrotated, as checkpoint scales expect)."""
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(config.model), dtype=config.dtype, attention_backend="torch"))
    runner = engine.runner
    observer = AmaxObserver(runner.attn_impl, runner.kv_cache.layers)
    runner.attn_impl = observer
    limit = min(config.max_tokens, runner.max_model_len - 1)
    for n, path in enumerate(config.texts):
        ids = engine.tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:limit]
        if not ids:
            raise ConfigError("texts", f"{path} has no tokens")
        engine.add_request(f"calibrate-{n}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    return observer


def scale_tensors(observer: AmaxObserver, config: KVCalibrationConfig) -> dict[str, torch.Tensor]:
    dtype = KVDtype.parse(config.kv_cache_dtype, torch.float32)
    rule = ScaleRule(margin=config.margin, per_tensor=config.per_tensor)
    out = {}
    for layer in range(observer.k_amax.shape[0]):
        for kind, amax in (("k", observer.k_amax[layer]), ("v", observer.v_amax[layer])):
            scale = rule.scales(amax, dtype)
            out[f"model.layers.{layer}.self_attn.{kind}_scale"] = (scale[:1] if config.per_tensor else scale).contiguous()
    return out


def kv_cache_scheme(per_tensor: bool) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "strategy": "tensor" if per_tensor else "attn_head",
            "dynamic": False, "symmetric": True}


def write_checkpoint(config: KVCalibrationConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The model's files copied to `output`, the scales in their own safetensors file, config.json saying so."""
    hf_config = json.loads((config.model / "config.json").read_text())
    qcfg = hf_config.get("quantization_config") or {"quant_method": "compressed-tensors", "config_groups": {}}
    if qcfg.get("quant_method") != "compressed-tensors":
        raise ConfigError("model", f"{config.model} is quantized with {qcfg.get('quant_method')!r}; vLLM reads KV "
                          "scales only beside compressed-tensors configs")
    shutil.copytree(config.model, config.output, dirs_exist_ok=True)
    save_file(tensors, str(config.output / SCALES_FILE), metadata={"format": "pt"})
    hf_config["quantization_config"] = {**qcfg, "kv_cache_scheme": kv_cache_scheme(config.per_tensor)}
    (config.output / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    index = config.output / _INDEX
    if index.is_file():  # sharded checkpoints list every tensor's file; loaders read only the listed ones
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({name: SCALES_FILE for name in tensors})
        index.write_text(json.dumps(data, indent=2) + "\n")


def calibrate_checkpoint(config: KVCalibrationConfig) -> dict[str, torch.Tensor]:
    observer = observe(config)
    tensors = scale_tensors(observer, config)
    write_checkpoint(config, tensors)
    logger.warning("calibrate-kv: %d tokens from %d texts; %s scales (%s) written to %s",
                   observer.tokens, len(config.texts), "per-tensor" if config.per_tensor else "per-KV-head",
                   ScaleRule(margin=config.margin).describe(KVDtype.parse(config.kv_cache_dtype, torch.float32)),
                   config.output / SCALES_FILE)
    return tensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `calibrate-kv` subcommand's flags (registered by service/cli.py)."""
    parser.add_argument("--model", type=Path, required=True, help="HF folder (config.json + *.safetensors)")
    parser.add_argument("--output", type=Path, required=True, help="new folder: the model plus k/v scales")
    parser.add_argument("--text", type=Path, action="append", required=True, dest="texts",
                        help="calibration text file (UTF-8), one prefill each; repeat for more")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--margin", type=float, default=4.0, help="scale = margin x amax / fp8 max")
    parser.add_argument("--per-tensor", action="store_true", help="one scale per layer instead of per KV head")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens read from each text")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    config = KVCalibrationConfig(model=args.model, output=args.output, texts=tuple(args.texts),
                                 kv_cache_dtype=args.kv_cache_dtype, margin=args.margin, per_tensor=args.per_tensor,
                                 max_tokens=args.max_tokens, dtype=args.dtype)
    calibrate_checkpoint(config)
    return 0
