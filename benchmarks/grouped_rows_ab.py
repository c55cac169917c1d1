"""Decode step time of a bf16 checkpoint under `--dtype auto` on a host without bf16 arithmetic, with the fp32 GEMM
over grouped bf16 weights (kernels/cpu/dense_rows.c, what `apply` gives calls of 13-512 rows once `free_row_bits`)
on and off (off: the routing before it, the GEMV through 32 rows and the grouped GEMM past them), toggled per
round in one engine, so both sides share the process, the weights and the minute (never in CI).

    python benchmarks/grouped_rows_ab.py --batches 32 64 --rounds 6    # the default model's bf16 folder

Each batch of 64-token prompts decodes `--tokens` greedy tokens per round, the two settings interleaved (the order
flipped each round); an entry is a round's median decode step (ms, native_step_crossover.step_ms), `off_over_on`
the ratio of the best rounds.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402
from hf_folder import bf16_folder  # noqa: E402
from native_step_crossover import step_ms  # noqa: E402
from pagedserve_runner import make_engine  # noqa: E402


def _toggle(engine):
    """A function setting the routing on or off in every layer that has it (none: the host takes another path)."""
    from pagedserve.quant.linear import QuantLinear
    from pagedserve.quant.unquantized import _GEMV_ROWS  # the GEMV's rows with the GEMV's bits kept

    layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)
              and getattr(m, "rows_gemm", None) is not None and getattr(m, "small_batch_gemv", None) is not None]
    saved = [(m.rows_gemm, m.gemv_rows) for m in layers]

    def set_on(on: bool) -> None:
        for layer, (gemm, gemv_rows) in zip(layers, saved, strict=True):
            layer.rows_gemm, layer.gemv_rows = (gemm, gemv_rows) if on else (None, _GEMV_ROWS)
    return layers, set_on


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a bf16 HF folder (default: the default model's, made once)")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    model = args.model or str(bf16_folder())
    engine = make_engine(model, "auto", args.threads, enable_prefix_caching=False)
    layers, set_on = _toggle(engine)
    if not layers:
        sys.exit("no layer takes the grouped rows GEMM here (bf16 arithmetic, an AVX-512 build, or fp32 weights)")
    results = {}
    for batch in args.batches:
        runs = {"on": [], "off": []}
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                set_on(on)
                runs["on" if on else "off"].append(round(step_ms(engine, batch, args.tokens, f"{batch}-{r}-{on}"), 1))
        results[batch] = {**runs, "off_over_on": round(min(runs["off"]) / min(runs["on"]), 3)}
        print(batch, results[batch], file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "grouped_rows_ab", "cpu": cpu_model(), "model": model, "layers": len(layers),
                      "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
