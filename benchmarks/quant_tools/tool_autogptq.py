"""Worker for AutoGPTQ 0.7.1 (run with the agptq venv's python): quantize, reload on CPU, record.

usage: python tool_autogptq.py BASE_DIR OUT_DIR BITS GROUP_SIZE DESC_ACT(0|1) SYM(0|1) [--reuse]
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tool_common import calibration_ids, copy_tokenizer, record  # noqa: E402


@contextlib.contextmanager
def pretend_cuda():
    """AutoGPTQ refuses to quantize without CUDA although its GPTQ math is device-agnostic: point its
    'CUDA_0' at the CPU and make the few CUDA calls no-ops, only while quantizing."""
    import auto_gptq.modeling._base as base
    import auto_gptq.quantization.gptq as gptq

    saved = (torch.cuda.is_available, torch.cuda.synchronize, torch.cuda.empty_cache, base.CUDA_0)
    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    base.CUDA_0 = torch.device("cpu")
    gptq.torch.cuda.synchronize = torch.cuda.synchronize
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.synchronize, torch.cuda.empty_cache, base.CUDA_0 = saved


def quantize(base: Path, out: Path, qcfg: dict) -> None:
    from auto_gptq import AutoGPTQForCausalLM, BaseQuantizeConfig

    examples = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration_ids()]
    with pretend_cuda():
        model = AutoGPTQForCausalLM.from_pretrained(str(base), BaseQuantizeConfig(**qcfg),
                                                    torch_dtype=torch.float16)
        torch.cuda.is_available = lambda: False  # only from_pretrained needed the lie
        model.quantize(examples, use_triton=False, cache_examples_on_gpu=False)
    model.save_quantized(str(out), use_safetensors=True)


def load_on_cpu(out: Path):
    from auto_gptq import AutoGPTQForCausalLM

    return AutoGPTQForCausalLM.from_quantized(str(out), device="cpu", use_triton=False, use_safetensors=True,
                                              disable_exllama=True, disable_exllamav2=True)


def main() -> None:
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    bits, group_size, desc_act, sym = (int(a) for a in sys.argv[3:7])
    qcfg = {"bits": bits, "group_size": group_size, "desc_act": bool(desc_act), "sym": bool(sym),
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    torch.manual_seed(0)
    if "--reuse" not in sys.argv or not list(out.glob("*.safetensors")):
        quantize(base, out, qcfg)
    copy_tokenizer(base, out)
    model = load_on_cpu(out)
    import auto_gptq

    recipe = {"tool": "auto-gptq", "version": auto_gptq.__version__, "quantize_config": qcfg,
              "calibration": "32 x 64 random token ids (tool_common.calibration_ids)"}
    record(out, model.model, recipe)
    print(json.dumps(recipe))


if __name__ == "__main__":
    main()
