"""What `--lm-head-quantization q8_0` costs in fidelity (never in CI): teacher-forced over held-out text, the same
checkpoint with its 16-bit LM head and with the head in Q8_0 blocks made at load.

    python benchmarks/head_quant_fidelity.py                        # the AWQ tool checkpoint of the tools cache
    python benchmarks/head_quant_fidelity.py --model DIR --windows 16

Text: Python's own reference documentation (pydoc_data.topics, odd topics, as benchmarks/quant_tools/smollm2_quality.py
evaluates), windows of 512 tokens. Prints one JSON object: top-1 agreement (the share of positions whose argmax is the
same with both heads), perplexity with each and its relative change, the largest logit difference, the CPU model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "quant_tools"), str(HERE / "peers"), str(HERE.parent / "tests")]


def main() -> None:
    from pagedserve.engine.loading.model_loader import load_model
    from paths import tools_cache
    from quant_fixtures import full_logits
    from smollm2_quality import texts, token_windows
    from step_cost import cpu_model
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=tools_cache() / "smollm2" / "awq_4bit_g64")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    windows = token_windows(AutoTokenizer.from_pretrained(str(args.model)), texts()[1], 512, args.windows)
    ids = torch.tensor(windows)
    logits = {}
    for head in ("none", "q8_0"):
        loaded = load_model(args.model, dtype, None, cpu, lm_head_quantization=head)
        with torch.inference_mode():
            logits[head] = torch.cat([full_logits(loaded, ids[i:i + 1]).float() for i in range(len(ids))])
    targets = ids[:, 1:].reshape(-1)

    def perplexity(values: torch.Tensor) -> float:
        flat = values[:, :-1].reshape(-1, values.shape[-1])
        return float(torch.exp(torch.nn.functional.cross_entropy(flat, targets)))

    plain, quantized = perplexity(logits["none"]), perplexity(logits["q8_0"])
    agree = (logits["none"].argmax(-1) == logits["q8_0"].argmax(-1)).float().mean().item()
    print(json.dumps({"model": str(args.model), "dtype": args.dtype, "positions": int(ids.numel()),
                      "top1_agreement": round(agree, 5), "ppl_16bit_head": round(plain, 4),
                      "ppl_q8_0_head": round(quantized, 4), "ppl_change": round(quantized / plain - 1, 5),
                      "max_abs_logit_diff": round((logits["none"] - logits["q8_0"]).abs().max().item(), 4),
                      "cpu": cpu_model()}))


if __name__ == "__main__":
    main()
