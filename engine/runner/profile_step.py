"""One full-size step run at start on dummy prompts, before the KV cache exists, so the memory a real step takes
beside the weights can be measured (`engine/runner/kv_budget.py` sizes the cache from it, as vLLM's profile run
does for --gpu-memory-utilization).

The step is the largest one the scheduler can form: max_num_batched_tokens prompt tokens (at most max_num_seqs
prompts of at most max_model_len each), every layer's attention over them through the engine's own attention
implementation, then the LM head and a softmax over max_num_seqs rows, as sampling takes them. Its K/V go to a
scratch cache holding exactly those prompts, freed afterwards: the real cache's blocks are never touched, and the
attention reads the same keys a real prefill would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.models.layers import ForwardContext
from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec
from pagedserve.kernels.layer_ops import LayerOps


@dataclass(frozen=True, slots=True)
class ProfileShape:
    """The dummy step: each prompt's length, and how many rows get logits."""

    prompt_lens: tuple[int, ...]
    logits_rows: int

    def __post_init__(self) -> None:
        if not self.prompt_lens or min(self.prompt_lens) < 1 or not 1 <= self.logits_rows:
            raise ConfigError("profile_shape", f"needs prompts of >= 1 token and >= 1 logits row, got {self}")

    @classmethod
    def largest(cls, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> ProfileShape:
        """The biggest step the scheduler can schedule under these limits: full-length prompts, then the rest."""
        tokens = min(max_num_batched_tokens, max_model_len * max_num_seqs)
        full, rest = divmod(tokens, max_model_len)
        return cls((max_model_len,) * full + ((rest,) if rest else ()), min(max_num_seqs, tokens))

    @property
    def num_tokens(self) -> int:
        return sum(self.prompt_lens)

    def blocks(self, block_size: int) -> list[int]:
        return [-(-n // block_size) for n in self.prompt_lens]


@dataclass(frozen=True, slots=True)
class ProfileTarget:
    """What the step runs through: the model and the attention and layer ops the engine serves with."""

    model: nn.Module
    attn_impl: AttentionImpl
    layer_ops: LayerOps
    windows: tuple[int | None, ...]  # one plan per distinct sliding window


def scratch_cache(spec: KVCacheSpec, shape: ProfileShape, device: torch.device) -> KVCache:
    """A cache with exactly the blocks the dummy prompts fill."""
    return KVCache(spec, sum(shape.blocks(spec.block_size)), device)


def _metadata(shape: ProfileShape, block_size: int, device: torch.device) -> AttentionMetadata:
    """Prompt i in blocks [first_i, first_i + blocks_i) of the scratch cache, its tokens in order."""
    blocks = shape.blocks(block_size)
    width = max(blocks)
    tables, slots, starts, first = [], [], [0], 0
    for n, count in zip(shape.prompt_lens, blocks):
        ids = list(range(first, first + count))
        tables.append(ids + [0] * (width - count))
        slots.extend(ids[p // block_size] * block_size + p % block_size for p in range(n))
        starts.append(starts[-1] + n)
        first += count
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, **i32), seq_lens=torch.tensor(shape.prompt_lens, **i32),
        block_tables=torch.tensor(tables, **i32), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(shape.prompt_lens), max_seq_len=max(shape.prompt_lens),
        query_lens_host=shape.prompt_lens, seq_lens_host=shape.prompt_lens,
    )


@torch.inference_mode()
def run_profile_step(target: ProfileTarget, cache: KVCache, shape: ProfileShape, vocab_size: int) -> torch.Tensor:
    """The dummy step's sampling probabilities [logits_rows, vocab] (fp32); K/V land in `cache` only."""
    device = cache.layers[0].k.device
    meta = _metadata(shape, cache.spec.block_size, device)
    plans = {window: target.attn_impl.plan(meta, cache.layers[0], window) for window in target.windows}
    ctx = ForwardContext(meta, cache, target.attn_impl, target.layer_ops, plans)
    # Distinct ids, so a mixture of experts routes them apart as real text would, not all to one expert.
    ids = torch.arange(shape.num_tokens, device=device) % vocab_size
    positions = torch.cat([torch.arange(n, device=device) for n in shape.prompt_lens])
    hidden = target.model(ids, positions, ctx)
    rows = _logits_rows(shape, device)
    return torch.softmax(target.model.compute_logits(hidden[rows]), dim=-1)


def _logits_rows(shape: ProfileShape, device: torch.device) -> torch.Tensor:
    """logits_rows hidden rows: each prompt's last token, then earlier tokens (a decode step's rows are many)."""
    ends = torch.tensor(shape.prompt_lens, device=device).cumsum(0) - 1
    others = torch.ones(shape.num_tokens, dtype=torch.bool, device=device)
    others[ends] = False
    return torch.cat([ends, others.nonzero().flatten()])[: shape.logits_rows]
