"""Round-to-nearest (RTN) 4-bit quantization of one linear's weight into the GPTQ (v1 zeros) and AWQ (GEMM)
checkpoint tensors that the engine's loaders read, packed with pagedserve's own packing code. The tools' tensor
layouts and shapes, NOT their quantizers: the accuracy says nothing about GPTQ's or AWQ's, the speed is theirs.
Plain torch on whatever device `w` is on (tests/gpu/decode_bench.py quantizes on the GPU)."""

from __future__ import annotations

import torch


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """w [out, in] fp32 -> q [in, out], zeros [groups, out], scales fp16 [groups, out] (4-bit)."""
    wt = w.t()  # [in, out]
    one_hot = torch.nn.functional.one_hot(g_idx.long(), groups).bool()  # [in, groups]
    lo = torch.stack([wt[one_hot[:, g]].amin(0) for g in range(groups)])
    hi = torch.stack([wt[one_hot[:, g]].amax(0) for g in range(groups)])
    if sym:
        scales = (torch.maximum(hi.abs(), lo.abs()) / 7.5).clamp_min(1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        scales = ((hi - lo) / 15).clamp_min(1e-8).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15).to(torch.int32)
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = (wt / s).round().add(z).clamp(0, 15).to(torch.int32)
    return q, zeros, scales


def quantized_tensors(name: str, w: torch.Tensor, kind: str, group: int,
                      order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of linear `name` (w [out, in]): kind "gptq" (symmetric, v1 zeros; `order` a
    permutation of the inputs for act-order, channel order[i] in group i // group; None: desc_act false) or "awq"
    (zero points)."""
    from pagedserve.quant.packing import default_g_idx, pack_awq, pack_cols, pack_rows

    in_f = w.shape[1]
    w = w.float()
    if kind == "awq":
        g_idx = default_g_idx(in_f, group, w.device)
        q, zeros, scales = rtn(w, g_idx, int(g_idx.max()) + 1, sym=False)
        return {f"{name}.qweight": pack_awq(q), f"{name}.qzeros": pack_awq(zeros), f"{name}.scales": scales}
    g_idx = default_g_idx(in_f, group, w.device)
    if order is not None:
        g_idx = torch.empty_like(g_idx).index_copy_(0, order.to(w.device), g_idx)
    q, zeros, scales = rtn(w, g_idx, int(g_idx.max()) + 1, sym=True)
    return {f"{name}.qweight": pack_rows(q, 4), f"{name}.qzeros": pack_cols(zeros - 1, 4),  # v1 stores z - 1
            f"{name}.scales": scales, f"{name}.g_idx": g_idx}


def quantization_config(kind: str, group: int, desc_act: bool = False) -> dict:
    """config.json's quantization_config for quantized_tensors' checkpoints."""
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": True,
            "checkpoint_format": "gptq"}
