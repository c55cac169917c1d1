"""The e2e check's `sampling` case: every sampling option with the logits on the device (the rest of the e2e
cases are greedy). Seeded temperature, top-k/top-p/min-p, penalties, bias, min_tokens, allowed tokens, bad words,
logprobs and n = 2 in one batch, and seeded rejection sampling of n-gram drafts: no request fails, every option
holds in the output, and the same seeds give the same tokens on a second run (each stream draws from a generator of
the device, seeded from the request's seed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import tiny_models

ALLOWED = (3, 5, 8, 13, 21, 34)
BAD = 7


def _params(max_tokens: int) -> list:
    from pagedserve.engine import SamplingParams

    n = max(4, max_tokens)
    return [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                       seed=5, max_tokens=n, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, logit_bias={BAD + 1: 4.0}, min_tokens=n, seed=7, max_tokens=n),
        SamplingParams(temperature=0.9, allowed_token_ids=list(ALLOWED), seed=9, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.9, bad_words_ids=[[BAD]], n=2, seed=13, max_tokens=n, ignore_eos=True),
    ]


def _held(outs, params) -> dict[str, bool]:
    """Whether each option's promise holds in the outputs."""
    first = [o.outputs[0] for o in outs]
    return {
        "no_errors": all(o.error is None for o in outs),
        "logprobs": first[1].logprobs is not None and all(len(lp.top) == 2 for lp in first[1].logprobs),
        "min_tokens": len(first[2].token_ids) == params[2].max_tokens,
        "allowed_token_ids": set(first[3].token_ids) <= set(ALLOWED),
        "bad_words": all(BAD not in c.token_ids for c in outs[4].outputs) and len(outs[4].outputs) == 2,
    }


def sampling_case(llama: Callable, engine: Callable, prompts: Callable) -> Callable:
    def run(scale, tmp: Path) -> dict:
        from pagedserve.engine.spec_decode.config import SpeculativeConfig

        model = llama(scale, tmp)
        batch = (prompts(scale) * 5)[:5]
        params = _params(scale.max_tokens)
        llm = engine(model, scale)
        runs = [llm.generate(batch, params) for _ in range(2)]
        tokens = [[tuple(c.token_ids) for o in outs for c in o.outputs] for outs in runs]
        held = _held(runs[0], params)
        del llm
        # Every id in the prompt: each sampled token has a 1-gram match, so every decode step carries drafts.
        spec = engine(model, scale, speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                                                 adaptive_drafts=False, disable_by_batch_size=4))
        echo = [list(range(3, tiny_models.VOCAB))] * 2
        spec_params = [params[0], params[2]]
        spec_runs = [[tuple(o.outputs[0].token_ids) for o in spec.generate(echo, spec_params)] for _ in range(2)]
        drafted = spec.engine.runner.verifier.counters.num_draft_tokens
        ok = all(held.values()) and tokens[0] == tokens[1] and spec_runs[0] == spec_runs[1] and drafted > 0
        return {"status": "passed" if ok else "failed", "held": held, "seeded_runs_equal": tokens[0] == tokens[1],
                "speculative_runs_equal": spec_runs[0] == spec_runs[1], "draft_tokens": drafted,
                "tokens": tokens[0] if not ok else None}
    return run
