"""One-stream decode of SmolLM2-135M as GPTQ and AWQ against its Q4_1 GGUF: JSON lines (never in CI).

    python benchmarks/group_quant_decode.py                       # makes the checkpoints once, then measures
    python benchmarks/group_quant_decode.py --gptq DIR --awq DIR  # real tool checkpoints instead
    python benchmarks/group_quant_decode.py --tool-checkpoints     # the SmolLM2 tool checkpoints, 3 systems
    python benchmarks/group_quant_decode.py --tool-checkpoints --head-q8-0   # + GPTQ/AWQ with a Q8_0 head made at load

The plain GPTQ/AWQ rows keep their 16-bit head (`--lm-head-quantization none`); the `_head_q8_0` rows are what the
default (`auto`) serves on CPU.

--tool-checkpoints takes GPTQModel 7.3.6's SmolLM2-135M checkpoints from the tools cache (made by
`python benchmarks/quant_tools/smollm2_quality.py --recipes gptq_4bit_g128 awq_4bit_g64 gptq_4bit_g128_lmhead4
--skip-throughput`, minutes each; never in git): GPTQ 4-bit g128 act-order sym, AWQ 4-bit g64, and GPTQ 4-bit
g128 with the LM head quantized too (`lm_head=True`, the head 4-bit g128 act-order sym; the embedding stays fp16
for the lookup only). `--gptq-lm-head DIR` names that third checkpoint by hand. Each row's `checkpoint` says where
the checkpoint came from (the quantizer the checkpoint's config names, or RTN made here).

Without --gptq / --awq the two checkpoints are SmolLM2-135M-shaped and made here (once, under --work) by rounding
the default GGUF's own weights to the nearest level (RTN) and packing them with pagedserve's packing code into the
tools' layouts: GPTQ 4-bit group 128, act-order (a seeded random channel order per layer input: q/k/v share
one, gate/up one, as the tool's Hessian order does), symmetric, v1 zeros; AWQ GEMM
4-bit group 64 with zero points. They are NOT made by the quantization tools (their accuracy says nothing about
GPTQ's or AWQ's); they have the tools' tensor layouts and shapes, which is what decode speed depends on. Each row
says which kind it measured.

Per model (`kernel` rows): the linear layers' packed bytes, for GPTQ/AWQ the share of linears served with rows
interleaved (`rows_grouped`, kernels/cpu/group_grouped.c) and, for decode, `LLM.generate` of one request of
--tokens tokens (EOS ignored) with the engine's defaults (the native decode step up to 2 rows), interleaved over
--repeats rounds, best tokens/s. The Q4_1 GGUF is the default model served packed (`--gguf-weights packed`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "quant_tools")]
from contention import cpu_model  # noqa: E402
from rtn import quantization_config, quantized_tensors  # noqa: E402
from smollm2_quality import head_bytes  # noqa: E402

from pagedserve.kernels.cpu import isa  # noqa: E402

GROUP_GPTQ, GROUP_AWQ = 128, 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized(name: str, w: torch.Tensor, kind: str, perm_seed: int) -> dict[str, torch.Tensor]:
    if kind == "awq":
        return quantized_tensors(name, w, kind, GROUP_AWQ)
    order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(perm_seed))
    return quantized_tensors(name, w, kind, GROUP_GPTQ, order)


def _perm_seed(base: str) -> int:
    """One act-order permutation per layer input: GPTQ orders channels by its Hessian of the layer's inputs, so
    q/k/v (and gate/up), which read the same input, get the same order in the tool's checkpoints too, and the
    engine merges them only then."""
    layer, proj = base.rsplit(".", 1)
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
    return zlib.crc32(f"{layer}.{shared}".encode())


def make_checkpoint(kind: str, out: Path) -> Path:
    """The default model as an RTN-packed `kind` ("gptq" or "awq") HF folder (see the module docstring)."""
    from safetensors.torch import save_file

    from pagedserve.engine.loading.gguf_checkpoint import GgufCheckpoint, tokenizer_dir
    from pagedserve.engine.loading.model_store import resolve_model

    if (out / "model.safetensors").exists():
        return out
    gguf = resolve_model(None).weights
    ckpt = GgufCheckpoint(gguf)
    tensors: dict[str, torch.Tensor] = {}
    for name, values in ckpt.tensors(torch.float32):
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.rsplit(".", 1)[-1] in LINEARS:
            tensors.update(_quantized(base, values, kind, _perm_seed(base)))
        else:
            tensors[name] = values.to(torch.bfloat16).contiguous()
    config = dict(ckpt.hf_config, torch_dtype="bfloat16")
    config["quantization_config"] = (quantization_config(kind, GROUP_GPTQ, desc_act=True) if kind == "gptq" else
                                     quantization_config(kind, GROUP_AWQ))
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir(gguf).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def linear_bytes(llm) -> int:
    from pagedserve.quant.linear import QuantLinear

    total = 0  # the layers' linears; the LM head (a tied embedding here) is left out
    for name, module in llm.engine.runner.model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(module, QuantLinear) and hasattr(module, "qkernel"):
            total += module.qkernel.weight_nbytes()
        elif isinstance(module, QuantLinear) and getattr(module, "packed", None) is not None:
            total += module.packed.blocks.numel()
    return total


def provenance(path: Path) -> str:
    """Who made a checkpoint: the quantizer its config names (GPTQModel writes meta.quantizer), else 'unknown'."""
    config = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    quantizer = (config.get("meta") or {}).get("quantizer") or config.get("quantizer")
    if quantizer:
        return "made by " + ", ".join(quantizer if isinstance(quantizer, list) else [str(quantizer)])
    return "given checkpoint (its config names no quantizer)"


def tool_checkpoint(name: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from paths import tools_cache

    path = tools_cache() / "smollm2" / name
    if not list(path.glob("*.safetensors")):
        raise SystemExit(f"{path}: missing; make it with `python benchmarks/quant_tools/smollm2_quality.py "
                         f"--recipes {name} --skip-throughput` (GPTQModel's venv, minutes on 2 cores)")
    return path


TOOL_RECIPES = {"gptq": "gptq_4bit_g128", "awq": "awq_4bit_g64", "gptq_lm_head": "gptq_4bit_g128_lmhead4"}


def grouped_share(llm) -> float | None:
    """The share of the GPTQ/AWQ linears whose rows the loader interleaved (kernels/cpu/group_grouped.c); None: no such."""
    matrices = [m.qkernel.matrix for m in llm.engine.runner.model.modules()
                if hasattr(getattr(m, "qkernel", None), "matrix")]
    return round(sum(m.row_group > 0 for m in matrices) / len(matrices), 3) if matrices else None


def _engine_options(name: str, path: str | None) -> dict:
    if path is None:
        return {"gguf_weights": "packed"}
    # the plain GPTQ/AWQ rows keep the head as stored (the default, auto, would make it Q8_0 on CPU)
    return {"lm_head_quantization": "q8_0" if name.endswith("_head_q8_0") else "none"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gptq", type=Path, help="a GPTQ checkpoint folder (default: made here, RTN)")
    parser.add_argument("--awq", type=Path, help="an AWQ GEMM checkpoint folder (default: made here, RTN)")
    parser.add_argument("--gptq-lm-head", type=Path, help="a GPTQ checkpoint with a quantized LM head (lm_head=True)")
    parser.add_argument("--tool-checkpoints", action="store_true",
                        help="the GPTQModel SmolLM2 checkpoints of the tools cache for all three (see above)")
    parser.add_argument("--head-q8-0", action="store_true",
                        help="also GPTQ and AWQ with their 16-bit LM head quantized to Q8_0 at load "
                             "(--lm-head-quantization q8_0)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-group-quant-bench"))
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                        help="auto: what the host (or a forced PAGEDSERVE_CPU_ISA tier) gets by default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.llm import LLM

    if args.tool_checkpoints:
        for kind, recipe in TOOL_RECIPES.items():
            setattr(args, kind, getattr(args, kind) or tool_checkpoint(recipe))
    models = {"gguf_q4_1": (None, "the default Q4_1 GGUF, packed")}
    for kind in ("gptq", "awq"):
        given = getattr(args, kind)
        models[kind] = (str(given or make_checkpoint(kind, args.work / f"smollm2-{kind}-rtn-v2")),
                        provenance(given) if given else "RTN-packed by pagedserve, not by the tools")
    if args.gptq_lm_head:
        models["gptq_lm_head"] = (str(args.gptq_lm_head), provenance(args.gptq_lm_head))
    if args.head_q8_0:
        for kind in ("gptq", "awq"):
            path, made = models[kind]
            models[f"{kind}_head_q8_0"] = (path, f"{made}; LM head Q8_0 at load")
    engines = {name: LLM(path, dtype=args.dtype, **_engine_options(name, path)) for name, (path, _) in models.items()}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    best = {name: 0.0 for name in engines}
    for rep in range(args.repeats):
        for name, llm in (engines.items() if rep % 2 == 0 else reversed(engines.items())):
            start = time.perf_counter()
            out = llm.generate(["The history of the printing press"], params)
            best[name] = max(best[name], len(out[0].outputs[0].token_ids) / (time.perf_counter() - start))
    for name, llm in engines.items():
        print(json.dumps({"kind": "decode_1_stream", "model": name, "checkpoint": models[name][1],
                          "native_step": llm.engine.runner.native_step is not None,
                          "path": models[name][0], "linear_bytes": linear_bytes(llm), "head_bytes": head_bytes(llm.engine.runner.model, llm.engine.loaded.dtype),
                          "rows_grouped": grouped_share(llm),
                          "tok_s": round(best[name], 2),
                          "vs_gguf": round(best[name] / best["gguf_q4_1"], 3), "tokens": args.tokens,
                          "repeats": args.repeats, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "cpu": cpu_model(), "host_tier": isa.host_tier(),
                          "forced_tier": isa.requested_tier().name if isa.requested_tier() else None}), flush=True)


if __name__ == "__main__":
    main()
