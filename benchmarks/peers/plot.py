"""Bar chart of compare.py's medians: output tok/s and TTFT p50 per system and dtype.
Runs under the tools venv (matplotlib is not a project dependency):

    ~/.cache/pagedserve-tools/tools-venv/bin/python benchmarks/peers/plot.py IN.json OUT.png   (see paths.py)
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(json_path: str, png_path: str) -> None:
    data = json.loads(open(json_path).read())["results"]
    dtypes = list(data)
    systems = sorted({s for d in data.values() for s in d["median"]},
                     key=lambda s: -max(d["median"].get(s, {}).get("output_tok_s", 0) for d in data.values()))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(dtypes), 1)
    for metric, ax, title in (("output_tok_s", axes[0], "output tokens/s (higher is better)"),
                              ("ttft_p50_s", axes[1], "TTFT p50, s (lower is better)")):
        for i, dtype in enumerate(dtypes):
            vals = [data[dtype]["median"].get(s, {}).get(metric, 0) for s in systems]
            xs = [x + i * width for x in range(len(systems))]
            bars = ax.bar(xs, vals, width, label=dtype)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([x + width * (len(dtypes) - 1) / 2 for x in range(len(systems))])
        ax.set_xticklabels(systems, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
