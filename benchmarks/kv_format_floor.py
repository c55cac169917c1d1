"""Which 8-bit KV format can meet the accuracy targets: 8-bit formats simulated through a 16-bit cache.

FP8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits at every magnitude, so no choice of scale changes its relative
rounding error; this measures how far that floor is from the targets and what would get below it. Each format is
simulated exactly: every K/V row written is quantized and dequantized in fp32 (K rotated by the Hadamard matrix and
centred first, as the engine's calibration does), then stored in a cache of the compute dtype (fp32 for fp32
compute, bf16 for bf16), so attention reads what a kernel dequantizing that format would compute with.
`e4m3/head` is the engine's own FP8 path (tests/test_kv_format_floor.py checks the two agree), so the other rows
differ from it only in the format. Scales: `head`, one per KV head fixed by the first batch (margin x amax), as the
engine's FP8 cache; `token`, one per token and KV head (that row's amax), stored beside the row.

    python benchmarks/kv_format_floor.py --json floor.json                   # evaluation texts, both compute dtypes
    python benchmarks/kv_format_floor.py --role selection --compute float32 --formats e4m3/head e4m3/head,K-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
import fp8_kv_accuracy as acc  # noqa: E402
from pagedserve.kernels.attention import AttentionImpl, WriteObservingAttention  # noqa: E402
from pagedserve.kernels.kv_cache import LayerKVCache  # noqa: E402
from pagedserve.kernels.kv_scales import hadamard  # noqa: E402

ELEMENTS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0), "int8": (None, 127.0)}
SIM_KV = {"float32": "fp32", "bfloat16": "bf16"}  # the cache the simulated values are stored in
TARGETS = {"e4m3": 0.5, "int8": 0.5, "e5m2": 1.5}  # max perplexity change, percent (int8: e4m3's bound)
SCALE_BYTES = 2  # a per-token scale stored as fp16 beside its row


@dataclass(frozen=True, slots=True)
class SimFormat:
    element: str  # "e4m3" | "e5m2" | "int8"
    scales: str  # "head" | "token"
    margin: float = 4.0  # head scales only: scale = margin x first-batch amax / element max
    quantize_k: bool = True
    quantize_v: bool = True
    rotate_k: bool = True  # Hadamard-rotate K before quantizing (data-independent)
    centre_k: bool = True  # subtract the first batch's per-channel K mean (needs a calibration batch)

    def __post_init__(self) -> None:
        if self.element not in ELEMENTS:
            raise ValueError(f"element: {self.element!r}; expected one of {sorted(ELEMENTS)}")
        if self.scales not in ("head", "token"):
            raise ValueError(f"scales: {self.scales!r}; expected 'head' or 'token'")
        if not self.margin > 0:
            raise ValueError(f"margin must be > 0, got {self.margin}")

    def blocks_ratio(self, head_dim: int) -> float:
        """Blocks per byte relative to a 16-bit cache."""
        if not (self.quantize_k or self.quantize_v):
            return 1.0
        extra = SCALE_BYTES if self.scales == "token" else 0
        return 2.0 * head_dim / (head_dim + extra)


FORMATS = {
    "e4m3/head": SimFormat("e4m3", "head"),
    "e4m3/head,K-only": SimFormat("e4m3", "head", quantize_v=False),
    "e4m3/head,V-only": SimFormat("e4m3", "head", quantize_k=False),
    "e4m3/token": SimFormat("e4m3", "token"),
    "e5m2/head": SimFormat("e5m2", "head"),
    "int8/head": SimFormat("int8", "head", margin=1.0),
    "int8/token": SimFormat("int8", "token"),
    # what the engine's int8 cache stores: no calibration batch, so no centring; with and without the rotation
    "int8/token,no-centre": SimFormat("int8", "token", centre_k=False),
    "int8/token,plain": SimFormat("int8", "token", rotate_k=False, centre_k=False),
    # nothing quantized: K only goes through the rotation and centring and back in fp32 (a change of ~1e-7 of the
    # row's size) and is stored in the compute dtype: how much the compute dtype itself amplifies the smallest change
    "round-trip-only": SimFormat("int8", "head", quantize_k=False, quantize_v=False),
}


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, element: str) -> torch.Tensor:
    """x fp32, scale broadcastable to it -> the values a cache of `element` would give back, fp32."""
    dtype, limit = ELEMENTS[element]
    scaled = (x / scale).clamp(-limit, limit)
    stored = scaled.round() if dtype is None else scaled.to(dtype).float()
    return stored * scale


def row_scales(x: torch.Tensor, element: str) -> torch.Tensor:
    """x [T, Hkv, D] -> one scale per token and KV head [T, Hkv, 1]: that row's amax maps to the element's max."""
    return (x.abs().amax(dim=-1, keepdim=True) / ELEMENTS[element][1]).clamp_min(1e-12)


class SimulatedKV(WriteObservingAttention):
    """Writes what `fmt` would store and give back; the first write into each layer fixes its K offset and (head)
    scales, like the engine's FP8 calibration."""

    def __init__(self, inner: AttentionImpl, layers: list[LayerKVCache], fmt: SimFormat):
        super().__init__(inner)
        self.fmt = fmt
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._rotation = hadamard(layers[0].k.shape[-1])
        self._fixed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _scale(self, x: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        return fixed if self.fmt.scales == "head" else row_scales(x, self.fmt.element)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        layer = self._index[id(cache)]
        rotation = self._rotation if self.fmt.rotate_k else None
        k = key.float() if rotation is None else key.float() @ rotation
        v = value.float()
        if layer not in self._fixed:
            offset = k.mean(dim=0) if self.fmt.centre_k else torch.zeros_like(k[0])
            factor = self.fmt.margin / ELEMENTS[self.fmt.element][1]  # kv_scales.ScaleRule's arithmetic
            head = lambda x: (x.abs().amax(dim=(0, 2)).clamp_min(1e-6) * factor).view(1, -1, 1)  # noqa: E731
            self._fixed[layer] = (offset, head(k - offset), head(v))
        offset, k_scale, v_scale = self._fixed[layer]
        if self.fmt.quantize_k:
            centred = k - offset
            k = fake_quantize(centred, self._scale(centred, k_scale), self.fmt.element) + offset
        if self.fmt.quantize_v:
            v = fake_quantize(v, self._scale(v, v_scale), self.fmt.element)
        if rotation is not None:
            k = k @ rotation.T
        self.inner.write_kv(k.to(key.dtype), v.to(value.dtype), cache, slot_mapping)


def measure(args, texts, all_ids: dict[str, list[int]], chat: list[int]) -> list[dict]:
    rows, names = [], [t.name for t in texts]
    for compute in args.compute:
        ref_engine = acc.make_engine(compute, acc.REFERENCE_KV[compute])
        refs = {t.name: acc.reference(ref_engine, all_ids[t.name], args.chunk,
                                      f"{compute}/{acc.REFERENCE_KV[compute]}/{t.name}", Path(args.cache_dir))
                for t in texts}
        del ref_engine
        engine = acc.make_engine(compute, SIM_KV[compute], kv_cache_memory=256 << 20)  # fp32 K/V of 2,048 tokens
        runner, inner = engine.runner, engine.runner.attn_impl
        for name in args.formats:
            fmt = FORMATS[name]
            for i, text in enumerate(texts):
                for case in args.calibrations:
                    t0 = time.perf_counter()
                    runner.attn_impl = SimulatedKV(inner, runner.kv_cache.layers, fmt)
                    batch = acc.calibration_batch(case, all_ids[names[(i + 1) % len(names)]], chat)
                    if batch is not None:
                        acc.run_chunk(engine, batch, 0, len(batch))
                    ref = refs[text.name]
                    run = acc.score(engine, all_ids[text.name], args.chunk, ref["top_ids"])
                    delta = 100.0 * (torch.exp(run["nll"].mean() - ref["nll"].mean()).item() - 1.0)
                    row = {"text": text.name, "kind": text.kind, "role": text.role, "compute": compute,
                           "format": name, "calibration": case, "tokens": len(all_ids[text.name]),
                           "ppl_delta_pct": delta, "kl": acc.kl_divergence(ref["top_logp"], run["top_logp"]),
                           "top1_pct": 100.0 * (run["argmax"] == ref["argmax"]).float().mean().item(),
                           "seconds": time.perf_counter() - t0}
                    rows.append(row)
                    print(f"{compute:8} {name:18} {text.name:22} {case:15} {delta:+.3f}% KL {row['kl']:.5f} "
                          f"top1 {row['top1_pct']:.2f}%", flush=True)
    return rows


def summary(rows: list[dict], head_dim: int) -> list[dict]:
    """Per compute dtype and format: the worst text and calibration case, and whether the targets hold."""
    out = []
    for compute, name in dict.fromkeys((r["compute"], r["format"]) for r in rows):
        group = [r for r in rows if (r["compute"], r["format"]) == (compute, name)]
        bad, low = max(group, key=lambda r: r["ppl_delta_pct"]), min(group, key=lambda r: r["top1_pct"])
        fmt = FORMATS[name]
        out.append({"compute": compute, "format": name, "blocks_ratio_vs_16bit": round(fmt.blocks_ratio(head_dim), 4),
                    "worst_ppl_delta_pct": bad["ppl_delta_pct"], "worst_ppl_text": bad["text"],
                    "worst_ppl_calibration": bad["calibration"], "worst_top1_pct": low["top1_pct"],
                    "worst_top1_text": low["text"], "mean_kl": sum(r["kl"] for r in group) / len(group),
                    "worst_kl": max(r["kl"] for r in group),
                    "meets_targets": bad["ppl_delta_pct"] <= TARGETS[fmt.element]
                    and low["top1_pct"] >= acc.TOP1_TARGET})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["selection", "evaluation", "all"], default="evaluation")
    parser.add_argument("--compute", nargs="+", default=list(SIM_KV), choices=list(SIM_KV))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--calibrations", nargs="+", default=["own first chunk", "chat prompt"],
                        choices=acc.CALIBRATIONS)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="cut every text shorter than the manifest's cap")
    parser.add_argument("--cache-dir", default=str(acc.cache_root() / "fp8_kv_reference"))
    parser.add_argument("--json")
    args = parser.parse_args()
    texts, missing, all_ids, chat, tok_engine = acc.load_texts(args.role, None, args.max_tokens)
    rows = measure(args, texts, all_ids, chat)
    head_dim = tok_engine.runner.kv_spec.head_dim
    result = {**acc.host_info(), "missing_texts": missing, "chunk": args.chunk,
              "texts": [{"name": t.name, "kind": t.kind, "role": t.role, "tokens": len(all_ids[t.name])}
                        for t in texts],
              "runs": rows, "summary": summary(rows, head_dim)}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
