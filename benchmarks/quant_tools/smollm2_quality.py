"""SmolLM2-135M quantized by the real tools, served by pagedserve: perplexity, weight memory, decode speed.

    python benchmarks/quant_tools/smollm2_quality.py [--recipes NAME ...] [--dtypes bfloat16 ...]
        [--skip-throughput] [--out results.json] [--threads N]

--recipes picks recipes by name ("unquantized" is the base model); rows already in --out for other
recipes are kept. --skip-throughput measures only perplexity and bytes (decode fields left out).

Run by hand (not in CI): quantizing takes minutes per tool on 2 cores. Steps:
1. Text: Python's own reference documentation (pydoc_data.topics, shipped with CPython: real English,
   no download). Topics alternate between calibration and evaluation, so the two never overlap.
2. Quantize the default model with GPTQModel 7.3.6 per RECIPES (GPTQ 4-bit g128/g32, sym/asym, with
   or without act-order; AWQ 4-bit g64: GPTQModel's AWQ, GEMM layout; g128 is refused by the AWQ tools
   for in_features 576) using the tool venvs of make_fixtures.py. A recipe whose folder under work_dir()
   already holds a checkpoint is not quantized again.
3. Load each checkpoint with pagedserve's own loader and compute perplexity over fixed 512-token
   windows, the bytes of the linear weights as stored, and greedy decode throughput via pagedserve.LLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "peers")]
from make_fixtures import ensure_venv  # noqa: E402
from paths import tools_cache  # noqa: E402

EVAL_WINDOW, EVAL_WINDOWS = 512, 16
BASE = "unquantized"
BASE_ROW_NAME = "SmolLM2-135M (unquantized)"


def work_dir() -> Path:
    return tools_cache() / "smollm2"


@dataclass(frozen=True)
class Recipe:
    worker: str
    args: tuple[str, ...]
    samples: int  # calibration windows of `length` tokens, from the even topics
    length: int = 256
    skip: int = 0  # calibration windows skipped first (another sample of the same text)
    untied: bool = False  # quantize from untied_base(): the tool's lm_head=True refuses a tied model


    def calibration(self) -> str:
        where = f", windows {self.skip}+" if self.skip else ""
        return f"{self.samples} x {self.length} tokens (even topics{where})"


# GPTQModel's AWQ scale search is ~6x slower than its GPTQ on 2 cores, so AWQ gets fewer samples (AWQ
# is known to need little data). Both AWQ tools require in_features % group_size == 0 ("Expected
# in_features (576) to be divisible by group_size (128)"): SmolLM2's hidden size 576 = 4.5 x 128, so
# AWQ uses group 64 here. The even topics hold 120 windows of 512 tokens; on one core GPTQModel needs
# ~40 s per layer for 64 x 512 tokens (~20 min for 30 layers), so the new recipes stop at 64 x 512.
# GPTQ args: method bits group desc_act sym format.
RECIPES = {
    "gptq_4bit_g128": Recipe("tool_gptqmodel.py", ("gptq", "4", "128", "1", "1", "gptq"), 32),
    "awq_4bit_g64": Recipe("tool_gptqmodel.py", ("awq", "4", "64", "0"), 8),
    "gptq_4bit_g128_asym_c64x512": Recipe("tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq"), 64, 512),
    # The base was Q4_1 once (GGUF: blocks of 32 input weights, scale + min): without act-order, g32 asym
    # groups are those blocks. Measured: act-order still does better (docs/quantization.md).
    "gptq_4bit_g32_asym_noact": Recipe("tool_gptqmodel.py", ("gptq", "4", "32", "0", "0", "gptq"), 32),
    "gptq_4bit_g32_asym": Recipe("tool_gptqmodel.py", ("gptq", "4", "32", "1", "0", "gptq"), 32),
    # g128 act-order asym with GPTQModel's quality options, all on the same 32 x 256 calibration as the
    # first g128 row (the _c64x512 row differs in data too). `--set=FIELD=VALUE` args go to GPTQConfig.
    # GPTQModel 7.3.6 defaults: damp_percent 0.05 (the GPTQ paper used 0.01), mse 0 (plain min/max
    # range; mse=P searches 80 shrunken ranges per group for the least sum |err|^P), gptaq None.
    "gptq_4bit_g128_asym": Recipe("tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq"), 32),
    "gptq_4bit_g128_asym_gptaq": Recipe(
        "tool_gptqmodel.py",
        ("gptq", "4", "128", "1", "0", "gptq", '--set=gptaq={"alpha": 0.25, "device": "cpu"}'), 32),
    "gptq_4bit_g128_asym_mse": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq", "--set=mse=2.4"), 32),
    "gptq_4bit_g128_asym_damp001": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq", "--set=damp_percent=0.01"), 32),
    # Same recipe as gptq_4bit_g128_asym on the next 32 windows: how much the number moves with the sample.
    "gptq_4bit_g128_asym_calib2": Recipe("tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq"), 32, skip=32),
    # FOEM (alpha 0.25 = with GPTAQ's term, beta 0.2): GPTQModel's documented "default best settings".
    "gptq_4bit_g128_asym_foem": Recipe(
        "tool_gptqmodel.py",
        ("gptq", "4", "128", "1", "0", "gptq", '--set=foem={"alpha": 0.25, "beta": 0.2, "device": "cpu"}'), 32),
    "gptq_4bit_g128_asym_gptaq_calib2": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq", '--set=gptaq={"alpha": 0.25, "device": "cpu"}'),
        32, skip=32),
    # The LM head quantized too (GPTQModel `lm_head=True`). GPTQModel 7.3.6 raises NotImplementedError for a
    # model whose lm_head.weight is tied to the embedding (looper/module_looper.py, _loop_impl), so these start
    # from untied_base(): the same weights, the head a copy of the embedding, tie_word_embeddings false; the
    # export keeps the embedding in fp16 for the lookup. Unless `dynamic` names lm_head, the tool quantizes it
    # 8-bit g32 sym (mse 2.4); the first recipe asks for the layers' own 4-bit g128 act-order sym instead.
    "gptq_4bit_g128_lmhead4": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "1", "gptq", "--set=lm_head=true",
                              '--set=dynamic={"lm_head": {"bits": 4, "group_size": 128, "desc_act": true, '
                              '"sym": true}}'), 32, untied=True),
    "gptq_4bit_g128_lmhead8": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "1", "gptq", "--set=lm_head=true"), 32, untied=True),
    "gptq_4bit_g128_asym_gptaq_damp001": Recipe(
        "tool_gptqmodel.py", ("gptq", "4", "128", "1", "0", "gptq", '--set=gptaq={"alpha": 0.25, "device": "cpu"}',
                              "--set=damp_percent=0.01"), 32),
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


def untied_base(base: Path) -> Path:
    """`base` with its LM head stored as a copy of the embedding and tie_word_embeddings false (made once)."""
    from safetensors.torch import load_file, save_file

    out = work_dir() / "base_untied"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=1))
    tensors = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def quantize(base: Path, calib_text: str, tokenizer, names: list[str]) -> dict[str, Path]:
    """Quantize each named recipe whose checkpoint folder is still empty; {name: checkpoint dir}."""
    py = ensure_venv("gptqm")
    out = {}
    for name in names:
        r, dst = RECIPES[name], work_dir() / name
        if not list(dst.glob("*.safetensors")):
            calib_file = work_dir() / f"calib_{r.samples}x{r.length}_skip{r.skip}.json"
            windows = token_windows(tokenizer, calib_text, r.length, r.skip + r.samples)[r.skip:]
            calib_file.write_text(json.dumps(windows))
            print(f"[{name}] quantizing ...", flush=True)
            t0 = time.time()
            source = untied_base(base) if r.untied else base
            subprocess.run([str(py), str(HERE / r.worker), str(source), str(dst), *r.args, "--calib", str(calib_file),
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


def linear_bytes(model, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes the linear weights occupy as loaded, bytes they would take in fp16). Unquantized layers
    count in_features x out_features in the model dtype (their weight may be repacked for oneDNN). The
    lm_head is left out, as in the first rows (SmolLM2 ties it to the embedding): head_bytes counts it."""
    from pagedserve.quant.linear import QuantLinear

    stored = fp16 = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and not name.endswith("lm_head"):
            fp16 += m.in_features * m.out_features * 2
            if hasattr(m, "qkernel"):
                stored += m.qkernel.weight_nbytes()
            else:
                stored += m.in_features * m.out_features * dtype.itemsize
    return stored, fp16


def head_bytes(model, dtype: torch.dtype) -> int:
    """Bytes the LM head reads per token: its packed tensors where the tool quantized it (lm_head=True), its GGUF
    blocks (a GGUF file's head, or `--lm-head-quantization q8_0`), else the dense [vocab, hidden] table in the
    model dtype (the tied embedding)."""
    head = model.lm_head
    if hasattr(head, "qkernel"):
        return head.qkernel.weight_nbytes()
    if getattr(head, "packed", None) is not None:
        return head.packed.blocks.numel()
    weight = getattr(head, "weight", None)  # 16-bit weights under fp32 compute are held (and read) 16-bit
    itemsize = weight.element_size() if weight is not None else dtype.itemsize
    return head.in_features * head.out_features * itemsize


def decode_tokens_per_s(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> float:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def evaluate(name: str, model_dir: Path, dtype: str, windows, throughput: bool) -> dict:
    from pagedserve.engine.config import parse_dtype
    from pagedserve.engine.loading.model_loader import load_model

    loaded = load_model(model_dir, parse_dtype(dtype), None, torch.device("cpu"))
    stored, fp16 = linear_bytes(loaded.model, parse_dtype(dtype))
    row = {"model": name, "dtype": dtype, "quant": loaded.quant.describe(), "ppl": perplexity(loaded, windows),
           "linear_MiB": stored / 2**20, "linear_vs_fp16": stored / fp16,
           "head_MiB": head_bytes(loaded.model, parse_dtype(dtype)) / 2**20}
    del loaded
    if throughput:
        prompts = [w[:32] for w in windows]
        row["decode_tok_s_bs1"] = decode_tokens_per_s(model_dir, dtype, prompts[:1], 32)
        row["decode_tok_s_bs8"] = decode_tokens_per_s(model_dir, dtype, prompts[:8], 16)
    print(json.dumps(row), flush=True)
    return row


def add_deltas(rows: list[dict]) -> None:
    """ppl_delta: relative to the unquantized row of the same dtype."""
    base = {r["dtype"]: r["ppl"] for r in rows if r["model"] == BASE_ROW_NAME}
    for r in rows:
        if r["dtype"] in base:
            r["ppl_delta"] = r["ppl"] / base[r["dtype"]] - 1


def merge(path: Path, rows: list[dict], names: list[str], threads: int) -> dict:
    """Replace the rows of the recipes just measured, keep the others."""
    old = json.loads(path.read_text()) if path.exists() else {}
    fresh = {(r["model"], r["dtype"]) for r in rows}
    kept = [r for r in old.get("rows", []) if (r["model"], r["dtype"]) not in fresh]
    calibration = old.get("calibration", {})
    calibration.update({n: RECIPES[n].calibration() for n in names if n in RECIPES})
    out = {**old, "eval": f"{EVAL_WINDOWS} x {EVAL_WINDOW} tokens of pydoc_data.topics (odd topics)",
           "calibration": calibration, "torch": torch.__version__, "rows": kept + rows}
    out.setdefault("threads", threads)
    add_deltas(out["rows"])
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "smollm2_results.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", choices=[BASE, *RECIPES], default=[BASE, *RECIPES])
    # bfloat16: 4-bit layers run torch's int4 CPU kernel; float32: the exact dequantize-per-call kernel.
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"])
    ap.add_argument("--skip-throughput", action="store_true", help="perplexity and bytes only")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from hf_folder import hf_folder

    base = hf_folder()  # the GPTQ/AWQ tools quantize an HF folder
    tok = AutoTokenizer.from_pretrained(str(base))
    calib_text, eval_text = texts()
    work_dir().mkdir(parents=True, exist_ok=True)
    windows = token_windows(tok, eval_text, EVAL_WINDOW, EVAL_WINDOWS)
    checkpoints = quantize(base, calib_text, tok, [n for n in args.recipes if n != BASE])
    if BASE in args.recipes:
        checkpoints = {BASE_ROW_NAME: base, **checkpoints}
    rows = [evaluate(name, d, dtype, windows, not args.skip_throughput)
            for dtype in args.dtypes for name, d in checkpoints.items()]
    result = merge(args.out, rows, args.recipes, args.threads)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
