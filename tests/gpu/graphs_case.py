"""The e2e check's `cuda_graphs_*` cases: the decode step's CUDA graphs, and async scheduling over them, against
enforce_eager on staggered requests (tests/gpu/e2e_check.py registers them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import tiny_models

GRAPH_SIZES = (1, 2, 4, 8, 16)  # vLLM's rule for max_num_seqs 16


def staggered(llm, batch: list[list[int]], max_tokens: list[int], arrivals: list[int]) -> list[list[int]]:
    """Greedy tokens of each prompt, prompt i submitted at step arrivals[i] with its own max_tokens, so requests
    join and finish at different steps and the decode batch takes many sizes."""
    from pagedserve.engine import SamplingParams

    engine, out, step = llm.engine, {}, 0
    while (step <= max(arrivals) or engine.has_unfinished_requests()) and step < 10_000:
        for i in (i for i, at in enumerate(arrivals) if at == step):
            engine.add_request(str(i), batch[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                                ignore_eos=True))
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        step += 1
    return [out.get(str(i), []) for i in range(len(batch))]


def graphs_case(model: Callable, dtype: str, engine: Callable) -> Callable:
    """CUDA graphs on (sizes 1-16), and with async scheduling, vs enforce_eager: 3 requests, then 10 more (2 in a
    dry run) two steps later, each with its own length, so decode batches of 13 down to 1 replay graphs of 16, 8, 4,
    2 and 1 with padded rows: greedy tokens identical, every KV block free afterwards, (on CUDA) graphs of several
    sizes replayed with padding, and steps launched ahead."""
    def run(scale, tmp: Path) -> dict:
        path = model(scale, tmp)
        gen = torch.Generator().manual_seed(11)
        count = scale.graph_prompts
        batch = [torch.randint(3, tiny_models.VOCAB, (int(n),), generator=gen).tolist()
                 for n in torch.randint(2, scale.graph_prompt_len, (count,), generator=gen)]
        max_tokens = [max(1, scale.max_tokens - (5 * i) % scale.max_tokens) for i in range(count)]
        arrivals = [0] * 3 + [2] * (count - 3)
        tokens, record = {}, {"dtype": dtype, "prompts": len(batch), "max_tokens": max_tokens}
        for mode, fields in (("eager", {"enforce_eager": True}), ("graphs", {}), ("async", {"async_scheduling": True})):
            llm = engine(path, scale, dtype=dtype, max_num_seqs=GRAPH_SIZES[-1], **fields)
            tokens[mode] = staggered(llm, batch, max_tokens, arrivals)
            blocks = llm.engine.block_manager
            record["blocks_free_after" + ("" if mode == "graphs" else f"_{mode}")] = \
                blocks.num_free_blocks == blocks.num_blocks
            graphs = llm.engine.runner.cuda_graphs
            if mode == "graphs":
                record["graph_sizes"] = None if graphs is None else list(graphs.sizes)
                record["replays"] = {} if graphs is None else {f"{rows}->{size}": n for (rows, size), n in
                                                               sorted(graphs.replays.items())}
                record["capture_s"] = None if graphs is None or graphs.stats is None else round(graphs.stats.seconds, 2)
                record["capture_error"] = None if graphs is None else graphs.error
            if mode == "async":  # launched ahead of the step before: the device filled their inputs
                record["lookahead_steps"] = llm.engine.num_lookahead_steps
            del llm
        mismatched = [i for i, (a, b) in enumerate(zip(tokens["eager"], tokens["graphs"])) if a != b]
        mismatched_async = [i for i, (a, b) in enumerate(zip(tokens["eager"], tokens["async"])) if a != b]
        padded_sizes = {key.split("->")[1] for key in record["replays"] if key.split("->")[0] != key.split("->")[1]}
        # A dry run's few tokens leave no steady decode to look ahead in (tests/test_async_scheduling.py covers it).
        graphs_ok = scale.device != "cuda" or (len(padded_sizes) >= 2 and record["lookahead_steps"] > 0)
        complete = [len(t) for t in tokens["graphs"]] == max_tokens
        blocks_back = all(record[k] for k in ("blocks_free_after", "blocks_free_after_eager", "blocks_free_after_async"))
        ok = not mismatched and not mismatched_async and graphs_ok and complete and blocks_back
        return {"status": "passed" if ok else "failed", **record, "mismatched_prompts": mismatched,
                "mismatched_prompts_async": mismatched_async, "padded_sizes_replayed": sorted(padded_sizes, key=int),
                **(tokens if mismatched or mismatched_async else {})}
    return run
