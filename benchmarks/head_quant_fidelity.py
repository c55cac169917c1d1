"""What `--lm-head-quantization q8_0` costs in fidelity (never in CI): teacher-forced over held-out text, the same
checkpoint with its 16-bit LM head, with the head alone multiplied from Q8_0 blocks made at load (`head`), and, for
a tied model, as the loader now serves it: the head and the token lookups both from those blocks (`q8_0`).

    python benchmarks/head_quant_fidelity.py --model DIR [--texts pydoc|fp8-eval] [--dtype float32]
    python benchmarks/head_quant_fidelity.py --dithered-embedding   # SmolLM2 with a not-yet-rounded embedding

Texts: `pydoc` (Python's reference documentation, odd topics, as benchmarks/quant_tools/smollm2_quality.py evaluates;
windows of 512 tokens) or `fp8-eval` (benchmarks/fp8_texts.json's evaluation texts, their first 512 tokens each).
`--dithered-embedding`: every available real checkpoint's embedding already sits on a Q8_0 grid (the GGUF files
hold `token_embd` in Q8_0), so rounding it again changes nothing; this option writes (once, under the tools cache)
the default model's fp32 checkpoint with each embedding value moved by a seeded uniform offset within half its
block's Q8_0 step: a table whose Q8_0 rounding error is what an HF checkpoint's would be. Prints one JSON line per
variant: top-1 agreement with the 16-bit head, perplexity and its relative change, the mean KL divergence from the
16-bit head's distribution, the largest logit difference, the CPU model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "quant_tools"), str(HERE / "peers"), str(HERE.parent / "tests")]


def dithered_checkpoint(out: Path) -> Path:
    """The default model's fp32 HF checkpoint with its embedding moved off the Q8_0 grid (see the docstring)."""
    from hf_folder import hf_folder
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").exists():
        return out
    source = hf_folder()  # the default GGUF as an fp32 HF folder (converted once)
    out.mkdir(parents=True, exist_ok=True)
    for name in source.iterdir():
        if name.name != "model.safetensors":
            shutil.copy(name, out / name.name)
    tensors = load_file(str(source / "model.safetensors"))
    table = tensors["model.embed_tokens.weight"].float()
    blocks = table.view(table.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127  # each 32-value block's Q8_0 step
    noise = torch.rand(blocks.shape, generator=torch.Generator().manual_seed(0)) - 0.5
    tensors["model.embed_tokens.weight"] = (blocks + noise * step).view_as(table).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def windows_of(texts_name: str, tokenizer, count: int) -> torch.Tensor:
    if texts_name == "pydoc":
        from smollm2_quality import texts, token_windows
        return torch.tensor(token_windows(tokenizer, texts()[1], 512, count))
    import fp8_texts
    entries = fp8_texts.load_manifest().role("evaluation")
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    rows = [fp8_texts.token_ids(t, encode, tokenizer.apply_chat_template, 512) for t in entries if t.problem() is None]
    return torch.tensor([r for r in rows if len(r) == 512])


def head_only(loaded) -> None:
    """The head multiplied from Q8_0 blocks, lookups from the table as stored (the loader's earlier behaviour)."""
    from pagedserve.quant.head_quant import quantized_head
    head = quantized_head(loaded.model.lm_head)
    head.method.process_weights_after_loading(head)
    loaded.model.lm_head = head


def main() -> None:
    from pagedserve.engine.loading.model_loader import load_model
    from paths import tools_cache
    from quant_fixtures import full_logits
    from step_cost import cpu_model
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=tools_cache() / "smollm2" / "awq_4bit_g64")
    parser.add_argument("--dithered-embedding", action="store_true")
    parser.add_argument("--texts", choices=["pydoc", "fp8-eval"], default="pydoc")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    model = dithered_checkpoint(tools_cache() / "smollm2" / "dithered_embedding") if args.dithered_embedding \
        else args.model
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    ids = windows_of(args.texts, AutoTokenizer.from_pretrained(str(model)), args.windows)
    logits = {}
    for variant in ("none", "head", "q8_0"):
        loaded = load_model(model, dtype, None, cpu, lm_head_quantization="none" if variant == "head" else variant)
        if variant == "head":
            head_only(loaded)
        with torch.inference_mode():
            logits[variant] = torch.cat([full_logits(loaded, ids[i:i + 1]).float() for i in range(len(ids))])
        del loaded
    targets = ids[:, 1:].reshape(-1)

    def perplexity(values: torch.Tensor) -> float:
        flat = values[:, :-1].reshape(-1, values.shape[-1])
        return float(torch.exp(torch.nn.functional.cross_entropy(flat, targets)))

    plain = perplexity(logits["none"])
    for variant in ("head", "q8_0"):
        rounded = perplexity(logits[variant])
        agree = (logits["none"].argmax(-1) == logits[variant].argmax(-1)).float().mean().item()
        reference = torch.log_softmax(logits["none"], -1)
        kl = torch.sum(reference.exp() * (reference - torch.log_softmax(logits[variant], -1)), -1).mean().item()
        print(json.dumps({"model": str(model), "variant": variant, "texts": args.texts, "dtype": args.dtype,
                          "positions": int(ids.numel()), "top1_agreement": round(agree, 5),
                          "ppl_16bit_head": round(plain, 4), "ppl_variant": round(rounded, 4),
                          "ppl_change": round(rounded / plain - 1, 5), "mean_kl": round(kl, 6),
                          "max_abs_logit_diff": round((logits["none"] - logits[variant]).abs().max().item(), 4),
                          "cpu": cpu_model()}), flush=True)


if __name__ == "__main__":
    main()
