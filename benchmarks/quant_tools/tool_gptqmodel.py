"""Worker for GPTQModel 7.3.6 (run with the gptqm venv's python): quantize, reload on CPU, record.

usage: python tool_gptqmodel.py BASE_DIR OUT_DIR gptq BITS GROUP_SIZE DESC_ACT(0|1) SYM(0|1) FORMAT(gptq|gptq_v2) [opts]
       python tool_gptqmodel.py BASE_DIR OUT_DIR awq BITS GROUP_SIZE SYM(0|1) [opts]
opts: --reuse (keep an existing checkpoint, redo only the CPU reload and records), --calib FILE.json,
      --no-record (skip the per-layer identity dequantization, for big models),
      --set=FIELD=VALUE (any other QuantizeConfig field, e.g. --set=damp_percent=0.01; value parsed as JSON)
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tool_common import calibration_from_argv, copy_tokenizer, positional, record  # noqa: E402


def stub_torchvision() -> None:
    """GPTQModel imports torchvision unconditionally (for a vision model definition), and PyPI's
    torchvision does not load against the CPU torch build ('operator torchvision::nms does not exist').
    Nothing used here needs it: ask transformers first (it caches 'not available'), then register a
    stand-in with the two names that import needs."""
    import enum
    import importlib.machinery

    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()
    if "torchvision" in sys.modules:
        return
    mods = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        sys.modules[name] = mods[name] = mod
    mods["torchvision"].__version__ = "0.0.0"
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    mods["torchvision.transforms.functional"].InterpolationMode = enum.Enum("InterpolationMode", "BICUBIC")


def extra_fields(argv: list[str]) -> dict:
    """`--set=FIELD=VALUE` options: VALUE as JSON when it parses (numbers, true/false), else a string."""
    out = {}
    for a in argv:
        if a.startswith("--set="):
            key, _, value = a[len("--set="):].partition("=")
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
    return out


def build_config(argv: list[str]):
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig  # noqa: F401

    method = argv[0]
    if method == "gptq":
        bits, group_size, desc_act, sym = (int(a) for a in argv[1:5])
        fields = {"bits": bits, "group_size": group_size, "desc_act": bool(desc_act), "sym": bool(sym),
                  "format": argv[5], **extra_fields(sys.argv)}
        return GPTQConfig(**fields), fields
    if method == "awq":
        bits, group_size, sym = (int(a) for a in argv[1:4])
        fields = {"bits": bits, "group_size": group_size, "sym": bool(sym), "format": "gemm", **extra_fields(sys.argv)}
        return AWQConfig(**fields), fields
    raise SystemExit(f"unknown method {method!r}")


def quantize(base: Path, out: Path, qcfg, method: str) -> None:
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(str(base), qcfg, device="cpu", dtype=torch.float16)
    calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration_from_argv(sys.argv)]
    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO
    model.quantize(calib, batch_size=4, backend=backend)
    model.save(str(out))


def load_on_cpu(out: Path, method: str):
    from gptqmodel import BACKEND, GPTQModel

    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.GPTQ_TORCH
    return GPTQModel.load(str(out), device="cpu", backend=backend, dtype=torch.float16)


def main() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    stub_torchvision()
    pos = positional(sys.argv[1:])
    base, out, args = Path(pos[0]), Path(pos[1]), pos[2:]
    qcfg, fields = build_config(args)
    torch.manual_seed(0)
    if "--reuse" not in sys.argv or not list(out.glob("*.safetensors")):
        quantize(base, out, qcfg, args[0])
    copy_tokenizer(base, out)
    model = load_on_cpu(out, args[0])
    import gptqmodel

    recipe = {"tool": "gptqmodel", "version": gptqmodel.__version__, "method": args[0], "config": fields,
              "calibration": "--calib file" if "--calib" in sys.argv else "32 x 64 random token ids"}
    if "--no-record" not in sys.argv:
        record(out, model.model, recipe)
    print(json.dumps(recipe))


if __name__ == "__main__":
    main()
