"""Each logits row's maximum and the first index holding it: the sampler's greedy picks and its finiteness check
(a row whose maximum is not finite fails its request), in one C pass per row where the native library builds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels.cpu.layer_ops import row_max_argmax


_ARGMAX_CHUNK = 512


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the first index of the row's maximum: the same ids as logits.argmax(dim=-1), several times faster
    on CPU (torch's argmax over a [32, 49152] row block measured 5-6 ms, a scalar loop; this ~1 ms): the maximum of
    each 512-wide chunk comes from the vectorised amax, then argmax runs only over the first chunk holding it."""
    rows, vocab = logits.shape
    chunks = vocab // _ARGMAX_CHUNK
    if chunks < 2:
        return logits.argmax(dim=-1)
    chunk_max = logits[:, :chunks * _ARGMAX_CHUNK].reshape(rows, chunks, _ARGMAX_CHUNK).amax(dim=-1)
    if chunks * _ARGMAX_CHUNK < vocab:
        chunk_max = torch.cat([chunk_max, logits[:, chunks * _ARGMAX_CHUNK:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * _ARGMAX_CHUNK
    # The tail chunk is narrower: its index runs past the row and is clamped to the last id, which repeats only
    # after that id's own position, so the first maximum is unchanged.
    cols = (start.unsqueeze(1) + torch.arange(_ARGMAX_CHUNK, device=logits.device)).clamp_(max=vocab - 1)
    return logits.gather(1, cols).argmax(dim=-1) + start


def torch_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum (NaN when the row holds a NaN) and the first index holding it. first_argmax is a CPU
    remedy (~12 small ops); on a GPU, where each op is a kernel launch, argmax is one and picks the same index."""
    if logits.device.type != "cpu":
        return logits.amax(dim=-1), logits.argmax(dim=-1)
    return logits.amax(dim=-1), first_argmax(logits)


def native_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_max_argmax in one C pass per row (kernels/cpu/layer_ops.c) for dense fp32 CPU rows, the usual case."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[-1]:
        return row_max_argmax(logits)
    return torch_max_argmax(logits)


def picks_and_finite(row_max: torch.Tensor, argmax: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's argmax and whether its maximum is finite, as host lists: two plain reads (a nonzero of the
    non-finite rows read the device twice more on a GPU, each read a wait; on CPU this is also 2x cheaper)."""
    return argmax.tolist(), torch.isfinite(row_max).tolist()


MaxArgmax = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
