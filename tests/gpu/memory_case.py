"""The e2e check's `memory_utilization` case: --gpu-memory-utilization sizes the KV cache from a profiled full-size
step (engine/runner/kv_budget.py), as vLLM does (tests/gpu/e2e_check.py registers it).

On CUDA: a share of the device ~1 GiB above what this process holds already; the engine's cache must be what the
share leaves (far more than the other cases' 64 MiB), torch's allocations afterwards must stay inside the share (the
CUDA graphs' pool aside, which vLLM leaves outside it too), and greedy tokens equal transformers'. A dry run (CPU,
where the share has no effect) runs the profiled step through the interpreted Triton attention instead: its
log-probabilities equal transformers' on the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import tiny_models

_HEADROOM = 1 << 30  # what the share allows above this process's allocations before the engine starts


def _profiled_step_matches(llm, reference) -> dict:
    from pagedserve.engine.runner.profile_step import ProfileShape, ProfileTarget, run_profile_step, scratch_cache

    runner = llm.engine.runner
    shape = ProfileShape(prompt_lens=(9, 4), logits_rows=3)  # both prompts' last tokens, then the first's first
    target = ProfileTarget(runner.model, runner.attn_impl, runner.layer_ops, runner.windows)
    probs = run_profile_step(target, scratch_cache(runner.kv_spec, shape, runner.device), shape, runner.vocab_size)
    ids = (torch.arange(13) % runner.vocab_size).tolist()
    first, second = tiny_models.hf_logits(reference, ids[:9]), tiny_models.hf_logits(reference, ids[9:])
    expected = torch.log_softmax(torch.stack([first[-1], second[-1], first[0]]), dim=-1)
    error = (probs.log().cpu() - expected).abs().max().item()
    return {"status": "passed" if error < 1e-3 else "failed", "max_log_prob_error": error}


def memory_case(model: Callable, engine: Callable, prompts: Callable) -> Callable:
    def run(scale, tmp: Path) -> dict:
        path = model(scale, tmp)
        device = torch.device(scale.device)
        from pagedserve.engine import SamplingParams

        reference = tiny_models.load_hf(path, torch.float32, device)
        if device.type != "cuda":
            return _profiled_step_matches(engine(path, scale), reference)
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info(device)[1]
        share = (torch.cuda.memory_allocated(device) + _HEADROOM) / total
        llm = engine(path, scale, kv_cache_memory=None, gpu_memory_utilization=share)
        runner = llm.engine.runner
        kv_bytes = runner.num_blocks * runner.kv_spec.bytes_per_block
        graphs = runner.cuda_graphs
        graph_bytes = graphs.stats.memory_bytes if graphs is not None and graphs.stats is not None else 0
        allocated = torch.cuda.memory_allocated(device)
        params = SamplingParams(temperature=0.0, max_tokens=scale.max_tokens, ignore_eos=True)
        batch = prompts(scale)
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
        theirs = [tiny_models.hf_greedy(reference, p, scale.max_tokens) for p in batch]
        inside = allocated <= share * total + graph_bytes
        ok = ours == theirs and kv_bytes > _HEADROOM // 2 and inside
        return {"status": "passed" if ok else "failed", "share": round(share, 4), "total_gib": total / 2**30,
                "kv_cache_gib": kv_bytes / 2**30, "allocated_gib": allocated / 2**30, "graphs_gib": graph_bytes / 2**30,
                "inside_share": inside, "tokens_equal": ours == theirs}
    return run
