"""lm-evaluation-harness's own OpenAI-completions client (`LocalCompletionsAPI`, what `lm_eval --model
local-completions` runs) scoring continuations against a running pagedserve: the loglikelihoods and greedy flags it
parses from the server's echo-with-logprobs replies, beside the same sums read from the server's `prompt_logprobs`
field for the same token ids. Prints one JSON object; exits 1 if lm-eval's figures and the field's differ. lm_eval
needs its own venv (its pins are not the project's):

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]==0.4.13"
    pagedserve serve --http-port 8000 &
    /tmp/lmeval/bin/python benchmarks/peers/lm_eval_check.py --base-url http://127.0.0.1:8000 \
        --tokenizer "$(python -c 'from pagedserve.engine.loading.model_store import resolve_model as r; print(r(None).tokenizer_dir)')"
"""

from __future__ import annotations

import argparse
import json
import sys

import requests
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

PAIRS = [  # (context, continuation): a few kinds of text, continuations likely and unlikely
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    ("Question: What is the capital of France?\nAnswer:", " Berlin"),
    ("The quick brown fox jumps over the", " lazy dog"),
    ("def add(a, b):\n    return", " a + b"),
    ("1, 2, 3, 4,", " 5, 6"),
    ("Les Misérables est un roman de", " Victor Hugo"),
]


def field_sums(base_url: str, model: str, lm: LocalCompletionsAPI) -> list[tuple[float, bool]]:
    """The same sums from `prompt_logprobs` (its k best give the greedy flag), one request per pair."""
    out = []
    for context, continuation in PAIRS:
        ctx, cont = lm.tok_encode(context), lm.tok_encode(continuation)
        reply = requests.post(f"{base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": ctx + cont, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}).json()
        scores = reply["choices"][0]["prompt_logprobs"][len(ctx):]
        total, greedy = 0.0, True
        for token, entry in zip(cont, scores):
            own = entry[str(token)]
            total += own["logprob"]
            greedy &= own["rank"] == 1
        out.append((total, greedy))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--tokenizer", required=True, help="the served model's tokenizer folder")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=3)
    args = parser.parse_args()
    lm = LocalCompletionsAPI(model=args.model, base_url=f"{args.base_url}/v1/completions", tokenizer=args.tokenizer,
                             tokenizer_backend="huggingface", batch_size=args.batch_size, max_length=2048)
    requests_ = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    harness = [tuple(r) for r in lm.loglikelihood(requests_)]
    field = field_sums(args.base_url, args.model, lm)
    worst = max(abs(a[0] - b[0]) for a, b in zip(harness, field))
    same_flags = all(a[1] == b[1] for a, b in zip(harness, field))
    print(json.dumps({"pairs": PAIRS, "lm_eval": harness, "prompt_logprobs_field": field,
                      "worst_abs_difference": worst, "greedy_flags_equal": same_flags}, indent=1))
    return 0 if worst < 2e-3 and same_flags else 1


if __name__ == "__main__":
    sys.exit(main())
