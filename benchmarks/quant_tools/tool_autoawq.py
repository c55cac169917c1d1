"""Worker for AutoAWQ 0.2.9 (run with the awq venv's python): quantize, reload on CPU, record.

usage: python tool_autoawq.py BASE_DIR OUT_DIR GROUP_SIZE [--zero-point-false] [--reuse] [--calib F] [--no-record]
(--reuse: keep an existing checkpoint in OUT_DIR, only redo the CPU reload and the records)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tool_common import calibration_from_argv, copy_tokenizer, positional, quantized_linears, record  # noqa: E402


def quantize(base: Path, out: Path, group_size: int, zero_point: bool) -> dict:
    from awq import AutoAWQForCausalLM

    quant_config = {"zero_point": zero_point, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}
    model = AutoAWQForCausalLM.from_pretrained(str(base), torch_dtype=torch.float16, device_map="cpu")
    calib = calibration_from_argv(sys.argv)
    # AutoAWQ silently drops samples longer than max_calib_seq_len.
    model.quantize(None, quant_config=quant_config, calib_data=calib, max_calib_samples=len(calib),
                   max_calib_seq_len=max(len(c) for c in calib), n_parallel_calib_samples=8)
    model.save_quantized(str(out))
    return quant_config


def load_on_cpu(out: Path):
    """AutoAWQ insists on IPEX on a CPU device; its plain torch path (dequantize_gemm + matmul) is what
    we want, so hide the device probe and its Triton kernels (which need a GPU)."""
    import awq.models.base as awq_base
    import awq.modules.linear.gemm as awq_gemm
    from awq import AutoAWQForCausalLM

    awq_gemm.TRITON_AVAILABLE = False
    awq_base.get_best_device = lambda: "cpu-no-ipex"
    return AutoAWQForCausalLM.from_quantized(str(out), torch_dtype=torch.float16, device_map={"": "cpu"},
                                             fuse_layers=False, use_ipex=False)


def oracle_agreement(model) -> dict:
    """AutoAWQ's named oracle (dequantize_gemm) must agree with the identity-matrix dequantization."""
    from awq.utils.packing_utils import dequantize_gemm

    from tool_common import identity_dequant, in_features_of

    worst = 0.0
    for mod in quantized_linears(model).values():
        ref = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, mod.w_bit, mod.group_size).t().float()
        worst = max(worst, (ref - identity_dequant(mod, in_features_of(mod))).abs().max().item())
    return {"autoawq.dequantize_gemm_vs_identity_max_abs": worst}


def main() -> None:
    pos = positional(sys.argv[1:])
    base, out, group_size = Path(pos[0]), Path(pos[1]), int(pos[2])
    zero_point = "--zero-point-false" not in sys.argv
    torch.manual_seed(0)
    qc = {"zero_point": zero_point, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}
    if "--reuse" not in sys.argv or not (out / "model.safetensors").exists():
        qc = quantize(base, out, group_size, zero_point)
    copy_tokenizer(base, out)
    model = load_on_cpu(out)
    import awq

    recipe = {"tool": "autoawq", "version": awq.__version__, "quant_config": qc,
              "calibration": "--calib file" if "--calib" in sys.argv else "32 x 64 random token ids"}
    if "--no-record" not in sys.argv:
        record(out, model.model, recipe, oracle_agreement(model.model))
    print(json.dumps(recipe))


if __name__ == "__main__":
    main()
