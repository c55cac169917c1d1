"""Runs the real engine (scheduler, block manager, paged runner) and records the logits of every position it
computes, for comparison with transformers' full forward over the same tokens.

The runner computes logits only for the rows that sample; the probe applies the model's own LM head to every row
of the very hidden states that step produced, so prefill chunks, recomputation after preemption and tokens after a
prefix-cache hit are all checked, not only the sampled positions. A step the native decode step ran
(engine/runner/native_step.py) never calls the model: every row of it samples, so its own logits are recorded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.llm_engine import LLMEngine


class _HiddenRecorder:
    """Stands in front of the model object the runner calls and keeps each step's final hidden states."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.hidden: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        self.hidden = self.model(input_ids, positions, ctx)
        return self.hidden

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@dataclass
class ProbeRun:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> prompt + generated tokens
    cached: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens found in the prefix cache
    logits: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    held_blocks: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # after each decode step
    native_steps: int = 0  # steps the native decode step ran


def attach(engine: LLMEngine, run: ProbeRun, monkeypatch) -> None:
    runner = engine.runner
    recorder = _HiddenRecorder(runner.model)
    monkeypatch.setattr(runner, "model", recorder)
    forward = runner.forward

    def recording_forward(batch):
        layout = [(item.seq.request_id, item.seq.num_computed_tokens, item.num_new_tokens) for item in batch.scheduled]
        native = runner.native_step is not None and runner.native_step.accepts(batch)
        run.native_steps += native
        result = forward(batch)
        with torch.inference_mode():
            logits = result[0] if native else recorder.model.compute_logits(recorder.hidden)
        row = 0
        for request_id, start, count in layout:
            run.logits[request_id] += [(start + j, logits[row + j]) for j in range(count)]
            row += count
        return result

    monkeypatch.setattr(runner, "forward", recording_forward)


def generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int, run: ProbeRun) -> None:
    """Greedy generation of every prompt at once, to completion; records tokens and live blocks per sequence."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            run.tokens[out.request_id] = list(prompts[out.request_id]) + list(out.outputs[0].token_ids)
            run.cached[out.request_id] = out.metrics.num_cached_tokens
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens > seq.num_prompt_tokens:
                run.held_blocks[seq.request_id].append(sum(1 for b in seq.block_table if b >= 0))


def assert_matches(run: ProbeRun, hf_model, atol: float = 1e-4) -> None:
    """Every recorded position's logits equal transformers' (full forward, no cache) within `atol`."""
    for request_id, tokens in run.tokens.items():
        with torch.inference_mode():
            reference = hf_model(torch.tensor([tokens])).logits[0].float()
        recorded = run.logits[request_id]
        positions = {p for p, _ in recorded}
        # Every position after the prefix-cache hit is computed (some twice, when preemption made them recompute).
        assert set(range(run.cached[request_id], len(tokens) - 1)) <= positions <= set(range(len(tokens) - 1))
        worst = max((logits - reference[p]).abs().max().item() for p, logits in recorded)
        assert worst <= atol, f"{request_id}: logits differ from transformers' by {worst}"


def hf_greedy_tokens(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        # eos_token_id=[]: no end token at all (None would fall back to the model config's EOS and stop there).
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()
