"""SmolLM2-135M quantized by the real tools, served by pagedserve: perplexity, weight memory, decode speed.

    python benchmarks/quant_tools/smollm2_quality.py [--skip-quantize] [--out results.json]

Run by hand (not in CI): quantizing takes minutes per tool on 2 cores. Steps:
1. Text: Python's own reference documentation (pydoc_data.topics, shipped with CPython: real English,
   no download). Topics alternate between calibration and evaluation, so the two never overlap.
2. Quantize the default model with GPTQModel 7.3.6 (GPTQ 4-bit g128, act-order) and AWQ 4-bit g64
   (GPTQModel's AWQ, GEMM layout; g128 is refused by the AWQ tools for in_features 576) using the
   tool venvs of make_fixtures.py.
3. Load each checkpoint with pagedserve's own loader and compute perplexity over fixed 512-token
   windows, the bytes of the linear weights as stored, and greedy decode throughput via pagedserve.LLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_fixtures import ensure_venv  # noqa: E402

WORK = Path("/root/.cache/pagedserve-tools/smollm2")
CALIB_SAMPLES, CALIB_LEN = 32, 256
EVAL_WINDOW, EVAL_WINDOWS = 512, 16
# name -> (worker, args, calibration samples of CALIB_LEN tokens). GPTQModel's AWQ scale search is
# ~6x slower than its GPTQ on 2 cores, so AWQ gets fewer samples (AWQ is known to need little data).
RECIPES = {
    "gptq_4bit_g128": ("tool_gptqmodel.py", ("gptq", "4", "128", "1", "1", "gptq"), 32),
    # Both AWQ tools require in_features % group_size == 0 ("Expected in_features (576) to be divisible
    # by group_size (128)"): SmolLM2's hidden size 576 = 4.5 x 128, so AWQ uses group 64 here.
    "awq_4bit_g64": ("tool_gptqmodel.py", ("awq", "4", "64", "0"), 8),
}


def texts() -> tuple[str, str]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return "\n\n".join(topics[k] for k in keys[0::2]), "\n\n".join(topics[k] for k in keys[1::2])


def token_windows(tokenizer, text: str, length: int, count: int) -> list[list[int]]:
    ids = tokenizer.encode(text)
    windows = [ids[i:i + length] for i in range(0, len(ids) - length, length)]
    if len(windows) < count:
        raise SystemExit(f"only {len(windows)} windows of {length} tokens in the text")
    return windows[:count]


def quantize(base: Path, calib: list[list[int]]) -> dict[str, Path]:
    py = ensure_venv("gptqm")
    out = {}
    for name, (worker, args, samples) in RECIPES.items():
        dst = WORK / name
        calib_file = WORK / f"calib_{samples}.json"
        calib_file.write_text(json.dumps(calib[:samples]))
        if not list(dst.glob("*.safetensors")):
            print(f"[{name}] quantizing ...", flush=True)
            t0 = time.time()
            subprocess.run([str(py), str(HERE / worker), str(base), str(dst), *args, "--calib", str(calib_file),
                            "--no-record"], check=True)
            print(f"[{name}] done in {time.time() - t0:.0f}s", flush=True)
        out[name] = dst
    return out


@torch.inference_mode()
def perplexity(loaded, windows: list[list[int]]) -> float:
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from quant_fixtures import full_logits

    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w])
        logits = full_logits(loaded, ids)[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += len(w) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def linear_bytes(model) -> tuple[int, int]:
    """(bytes the linear weights occupy as loaded, bytes they would take in fp16)."""
    from pagedserve.quant.linear import QuantLinear

    stored = fp16 = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            fp16 += m.in_features * m.out_features * 2
            if hasattr(m, "qkernel"):
                stored += m.qkernel.weight_nbytes()
            else:
                stored += m.weight.numel() * m.weight.element_size()
    return stored, fp16


def decode_tokens_per_s(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> float:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def evaluate(name: str, model_dir: Path, dtype: str, windows, prompts) -> dict:
    from pagedserve.engine.config import parse_dtype
    from pagedserve.engine.model_loader import load_model

    loaded = load_model(model_dir, parse_dtype(dtype), None, torch.device("cpu"))
    stored, fp16 = linear_bytes(loaded.model)
    row = {"model": name, "dtype": dtype, "quant": loaded.quant.describe(), "ppl": perplexity(loaded, windows),
           "linear_MiB": stored / 2**20, "linear_vs_fp16": stored / fp16}
    del loaded
    row["decode_tok_s_bs1"] = decode_tokens_per_s(model_dir, dtype, prompts[:1], 32)
    row["decode_tok_s_bs8"] = decode_tokens_per_s(model_dir, dtype, prompts[:8], 16)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "smollm2_results.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from pagedserve.engine.model_store import ensure_default_model

    base = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(base))
    calib_text, eval_text = texts()
    WORK.mkdir(parents=True, exist_ok=True)
    calib = token_windows(tok, calib_text, CALIB_LEN, CALIB_SAMPLES)
    windows = token_windows(tok, eval_text, EVAL_WINDOW, EVAL_WINDOWS)
    prompts = [w[:32] for w in windows]
    checkpoints = quantize(base, calib)
    # bfloat16: 4-bit layers run torch's int4 CPU kernel; float32: the exact dequantize-per-call kernel.
    rows = []
    for dtype in ("bfloat16", "float32"):
        rows.append(evaluate("SmolLM2-135M (unquantized)", base, dtype, windows, prompts))
        for name, d in checkpoints.items():
            rows.append(evaluate(name, d, dtype, windows, prompts))
    args.out.write_text(json.dumps({"eval": f"{EVAL_WINDOWS} x {EVAL_WINDOW} tokens of pydoc_data.topics (odd topics)",
                                    "calibration": {n: f"{r[2]} x {CALIB_LEN} tokens (even topics)" for n, r in RECIPES.items()},
                                    "threads": args.threads, "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
