"""8-bit KV-cache accuracy (FP8, int8) on the default model (SmolLM2-135M-Instruct), text by text, with the worst text reported.

Each text of benchmarks/fp8_texts.json (prose, code, structured data, a chat transcript, a non-English text) runs
as ONE sequence through the paged cache in --chunk-token prefill chunks, so every position's logits read all
earlier K/V back from the cache, as decode does. Per text, compute dtype (fp32, bf16), FP8 dtype, scale scheme and
calibration case: perplexity change vs the same run with a 16-bit KV cache (fp16 KV for fp32 compute, bf16 KV for
bf16 compute) and teacher-forced top-1 agreement (the share of positions whose argmax equals the 16-bit run's).
Calibration cases (the engine calibrates on the first batch it serves, whatever that is): the text's own first
chunk; a 44-token chat prompt; 16 and 512 tokens of another text of the set. The worst case over them is what a
user can get. 16-bit results are cached on disk per text and dtype (--cache-dir), so they are computed once.

    python benchmarks/fp8_kv_accuracy.py --role evaluation --json fp8.json         # the held-out texts
    python benchmarks/fp8_kv_accuracy.py --role selection --kv fp8_e4m3 --compute float32 \
        --schemes default old-headroom8 per-tensor --json select.json             # compare schemes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fp8_texts beside this script, even under python -P
import fp8_texts  # noqa: E402
from contention import cpu_model  # noqa: E402
from pagedserve.engine.host.cpu_features import cpu_flags  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.models.layers import ForwardContext
import pagedserve.kernels as kernels_package  # noqa: E402
from pagedserve.kernels import kv_scales
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.cache_dir import cache_root
from pagedserve.kernels.kv_scales import CalibratingAttention, ScaleRule

# name -> (rule, rotate K): the engine's default first, then the alternatives measured against it.
SCHEMES = {
    "default": (kv_scales.DEFAULT_RULE, True),
    "margin-1": (ScaleRule(), True),
    "old-headroom8": (ScaleRule(margin=8.0, power_of_two=True), True),
    "amax-pow2": (ScaleRule(margin=1.0, power_of_two=True), True),
    "margin-1.25": (ScaleRule(margin=1.25), True),
    "margin-2": (ScaleRule(margin=2.0), True),
    "margin-4": (ScaleRule(margin=4.0), True),
    "per-tensor": (ScaleRule(per_tensor=True), True),
    "no-rotation": (kv_scales.DEFAULT_RULE, False),
    "center-k": (ScaleRule(center_k=True), True),
    "center-k-margin-1.5": (ScaleRule(margin=1.5, center_k=True), True),
    "center-k-margin-4": (ScaleRule(margin=4.0, center_k=True), True),
    "center-k-no-rotation": (ScaleRule(center_k=True), False),
}
CALIBRATIONS = ("own first chunk", "chat prompt", "other text 16", "other text 512")
CHAT = "Hi! Can you help me write a short note to my neighbour?"
REFERENCE_KV = {"float32": "fp16", "bfloat16": "bf16"}
TARGETS = {"fp8_e4m3": 0.5, "fp8_e5m2": 1.5}  # max perplexity change, percent
TOP1_TARGET = 97.0
# int8 (per-token scales): its own, tighter bounds per compute dtype (ppl change %, lowest top-1 % or None)
INT8_TARGETS = {"float32": (0.3, 98.5), "bfloat16": (0.6, None)}
TOP_K = 32  # reference log-probabilities kept per position for the KL divergence


def make_engine(compute: str, kv: str, kv_cache_memory: int = 64 << 20, backend: str = "torch") -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=kv_cache_memory, attention_backend=backend,
                                  dtype=compute))


def run_chunk(engine: LLMEngine, ids: list[int], start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of one sequence whose earlier tokens are already in blocks 0.. -> logits [end-start, V]."""
    runner = engine.runner
    blocks = torch.arange(-(-end // runner.kv_spec.block_size), dtype=torch.int32).view(1, -1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=blocks, slot_mapping=torch.arange(start, end), max_query_len=end - start, max_seq_len=end,
        query_lens_host=(end - start,), seq_lens_host=(end,),
    )
    ctx = ForwardContext(meta, runner.kv_cache, runner.attn_impl)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), ctx)
        return runner.model.compute_logits(hidden).float()


def score(engine: LLMEngine, ids: list[int], chunk: int, ref_top: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The whole sequence in chunks -> per position: nll of the next token, argmax, and the top-K log-probabilities
    (of this run's top K, or of `ref_top`'s token ids when given, for the KL divergence from that run)."""
    out: dict[str, list[torch.Tensor]] = {"nll": [], "argmax": [], "top_ids": [], "top_logp": []}
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        logp = torch.log_softmax(run_chunk(engine, ids, start, end)[: len(ids) - 1 - start], dim=-1)
        targets = torch.tensor(ids[start + 1 : start + 1 + logp.shape[0]])
        out["nll"].append(-logp.gather(1, targets[:, None])[:, 0])
        out["argmax"].append(logp.argmax(-1))
        top_ids = logp.topk(TOP_K, dim=-1).indices if ref_top is None else ref_top[start : start + logp.shape[0]]
        out["top_ids"].append(top_ids)
        out["top_logp"].append(logp.gather(1, top_ids))
    return {name: torch.cat(parts) for name, parts in out.items()}


def kl_divergence(ref_logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Mean KL(reference || this run) over positions, from the reference's top-K tokens plus one bucket for the
    rest of the vocabulary (a lower bound of the full KL; the top 32 hold nearly all the mass)."""
    p, q = ref_logp.exp(), logq.exp()
    rest_p, rest_q = (1 - p.sum(-1)).clamp_min(1e-12), (1 - q.sum(-1)).clamp_min(1e-12)
    kl = (p * (ref_logp - logq)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
    return kl.mean().item()


def numerics_fingerprint() -> str:
    """torch's version and the source of everything that computes logits (kernels, quant, models, loading): a cached
    reference from other code would silently skew every comparison."""
    root = Path(kernels_package.__file__).resolve().parent.parent
    digest = hashlib.sha256(torch.__version__.encode())
    for folder in ("kernels", "quant", "engine/models", "engine/loading"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".h"):
                digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


def reference(engine: LLMEngine, ids: list[int], chunk: int, tag: str, cache_dir: Path) -> dict[str, torch.Tensor]:
    """The 16-bit run's per-token results, from disk when this exact run, by this code, was scored before."""
    key = hashlib.sha256(json.dumps([tag, chunk, TOP_K, ids, numerics_fingerprint()]).encode()).hexdigest()[:24]
    path = cache_dir / f"{key}.pt"
    if path.is_file():
        return torch.load(path)
    result = score(engine, ids, chunk)
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, path)
    return result


def calibrate(engine: LLMEngine, inner, scheme: str, batch: list[int] | None) -> None:
    """Fresh calibration under `scheme`; `batch` (if any) is the first prefill it sees, else the text itself is."""
    rule, rotate = SCHEMES[scheme]
    runner = engine.runner
    runner.attn_impl = kv_scales.setup_kv_scales(runner.kv_cache, {}, inner, rule=rule, rotate_k=rotate)
    if batch is not None:
        run_chunk(engine, batch, 0, len(batch))  # the sequence scored next overwrites these slots first


def calibration_batch(case: str, ids_other: list[int], chat: list[int]) -> list[int] | None:
    return {"own first chunk": None, "chat prompt": chat, "other text 16": ids_other[:16],
            "other text 512": ids_other[:512]}[case]


def measure(args, texts, all_ids: dict[str, list[int]], chat: list[int]) -> list[dict]:
    rows = []
    cache_dir = Path(args.cache_dir)
    names = [t.name for t in texts]
    for compute in args.compute:
        backend = args.attention_backend
        ref_engine = make_engine(compute, REFERENCE_KV[compute], backend=backend)
        path = "" if backend == "torch" else f"/{backend}"
        refs = {t.name: reference(ref_engine, all_ids[t.name], args.chunk,
                                  f"{compute}/{REFERENCE_KV[compute]}/{t.name}{path}", cache_dir) for t in texts}
        del ref_engine
        for kv in args.kv:
            engine = make_engine(compute, kv, backend=backend)
            inner = engine.runner.attn_impl
            inner = inner.inner if isinstance(inner, CalibratingAttention) else inner
            fp8 = kv.startswith("fp8")
            # int8 rows scale themselves and 16-bit caches have no scales: no scheme, no calibration case
            schemes = args.schemes if fp8 else ["per-token" if kv == "int8" else "none"]
            for scheme in schemes:
                for i, text in enumerate(texts):
                    other = all_ids[names[(i + 1) % len(names)]]
                    for case in args.calibrations if fp8 else ["none"]:
                        t0 = time.perf_counter()
                        if fp8:
                            calibrate(engine, inner, scheme, calibration_batch(case, other, chat))
                        ref = refs[text.name]
                        run = score(engine, all_ids[text.name], args.chunk, ref["top_ids"])
                        nll, ref_nll = run["nll"], ref["nll"]
                        delta = 100.0 * (torch.exp(nll.mean() - ref_nll.mean()).item() - 1.0)
                        row = {"text": text.name, "kind": text.kind, "role": text.role, "compute": compute,
                               "attention_backend": backend, "chunk": args.chunk,
                               "kv_cache_dtype": kv, "reference_kv": REFERENCE_KV[compute], "scheme": scheme,
                               "calibration": case, "tokens": len(all_ids[text.name]),
                               "ppl": torch.exp(nll.mean()).item(), "ref_ppl": torch.exp(ref_nll.mean()).item(),
                               "ppl_delta_pct": delta, "kl": kl_divergence(ref["top_logp"], run["top_logp"]),
                               "top1_pct": 100.0 * (run["argmax"] == ref["argmax"]).float().mean().item(),
                               "seconds": time.perf_counter() - t0}
                        rows.append(row)
                        print(f"{compute:8} {kv:8} {scheme:13} {text.name:22} {case:15} ppl {row['ppl']:8.4f} "
                              f"{delta:+.3f}% KL {row['kl']:.5f} top1 {row['top1_pct']:.2f}%", flush=True)
    return rows


def worst(rows: list[dict]) -> list[dict]:
    """Per compute dtype, FP8 dtype and scheme: the worst text (largest perplexity change, lowest agreement)."""
    out = []
    groups = sorted({(r["compute"], r["kv_cache_dtype"], r["scheme"]) for r in rows})
    for compute, kv, scheme in groups:
        group = [r for r in rows if (r["compute"], r["kv_cache_dtype"], r["scheme"]) == (compute, kv, scheme)]
        bad_ppl = max(group, key=lambda r: r["ppl_delta_pct"])
        bad_top = min(group, key=lambda r: r["top1_pct"])
        means = [sum(r["ppl_delta_pct"] for r in group if r["text"] == t) / sum(r["text"] == t for r in group)
                 for t in dict.fromkeys(r["text"] for r in group)]
        out.append({"compute": compute, "kv_cache_dtype": kv, "scheme": scheme,
                    "worst_ppl_delta_pct": bad_ppl["ppl_delta_pct"], "worst_ppl_text": bad_ppl["text"],
                    "worst_ppl_calibration": bad_ppl["calibration"], "mean_ppl_delta_pct": sum(means) / len(means),
                    "mean_kl": sum(r["kl"] for r in group) / len(group), "worst_kl": max(r["kl"] for r in group),
                    "worst_top1_pct": bad_top["top1_pct"], "worst_top1_text": bad_top["text"],
                    "meets_targets": meets_targets(compute, kv, bad_ppl["ppl_delta_pct"], bad_top["top1_pct"])})
    return out


def meets_targets(compute: str, kv: str, ppl_delta_pct: float, top1_pct: float) -> bool | None:
    if kv == "int8":
        ppl_bound, top1_bound = INT8_TARGETS[compute]
        return ppl_delta_pct <= ppl_bound and (top1_bound is None or top1_pct >= top1_bound)
    if kv in TARGETS:
        return ppl_delta_pct <= TARGETS[kv] and top1_pct >= TOP1_TARGET
    return None


def host_info() -> dict:
    """The host a figure was taken on: CPU model, its ISA tier (the vector extensions the kernels can use) and threads."""
    flags = cpu_flags(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").is_file() else frozenset()
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu_model(), "isa": sorted(flags & _ISA_FLAGS)}


_ISA_FLAGS = frozenset({"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16"})


def load_texts(role: str, names: list[str] | None, max_tokens: int | None):
    """The manifest's texts of `role` whose files are present as pinned (the others reported) -> (texts, problems,
    token ids per text, the chat calibration prompt's ids, the fp32 engine whose tokenizer rendered them)."""
    text_set = fp8_texts.load_manifest()
    texts = [t for t in text_set.texts if role in ("all", t.role) and (names is None or t.name in names)]
    missing = [p for p in (t.problem() for t in texts) if p is not None]
    for problem in missing:
        print(f"MISSING TEXT (not measured): {problem}", flush=True)
    texts = [t for t in texts if t.problem() is None]
    engine = make_engine("float32", "fp32")
    tok = engine.tokenizer
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    all_ids = {t.name: fp8_texts.token_ids(t, encode, tok.apply_chat_template, max_tokens or text_set.max_tokens)
               for t in texts}
    return texts, missing, all_ids, tok.apply_chat_template([{"role": "user", "content": CHAT}]), engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["selection", "evaluation", "all"], default="evaluation")
    parser.add_argument("--compute", nargs="+", default=["float32", "bfloat16"], choices=list(REFERENCE_KV))
    parser.add_argument("--kv", nargs="+", default=[*TARGETS, "int8"], choices=[*TARGETS, "int8", "bf16", "fp16"],
                        help="bf16/fp16: a 16-bit cache of the other kind, for scale (no targets)")
    parser.add_argument("--schemes", nargs="+", default=["default"], choices=list(SCHEMES))
    parser.add_argument("--calibrations", nargs="+", default=list(CALIBRATIONS), choices=CALIBRATIONS)
    parser.add_argument("--texts", nargs="*", default=None, help="only these text names")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward; 1: every token a decode row")
    parser.add_argument("--attention-backend", default="torch",
                        help="both sides; native with --chunk 1 scores through the C decode attention")
    parser.add_argument("--max-tokens", type=int, default=None, help="cut every text shorter than the manifest's cap")
    parser.add_argument("--cache-dir", default=str(cache_root() / "fp8_kv_reference"))
    parser.add_argument("--json")
    args = parser.parse_args()
    texts, missing, all_ids, chat, _ = load_texts(args.role, args.texts, args.max_tokens)
    rows = measure(args, texts, all_ids, chat)
    result = {**host_info(), "missing_texts": missing,
              "texts": [{"name": t.name, "kind": t.kind, "role": t.role, "path": str(t.file), "tokens": len(all_ids[t.name])}
                        for t in texts], "runs": rows, "worst": worst(rows)}
    print(json.dumps(result["worst"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
