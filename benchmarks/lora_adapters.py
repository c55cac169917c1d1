"""PEFT LoRA adapters for the benchmarks, made by `peft` itself over an HF folder and cached beside it: rank r on
q/k/v/o/gate/up/down, A and B drawn at random (peft's default B = 0 would make every adapter the base) at a scale
that changes the output without wrecking the text. Never in CI (the tests make their own, smaller ones)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VERSION = "1"


def benchmark_adapters(model_dir: Path, count: int = 4, rank: int = 16, cache: Path | None = None) -> list[Path]:
    """`count` adapter folders (seeds 1..count) for the model in `model_dir`, made once."""
    cache = cache or model_dir.parent / f"{model_dir.name}-lora-r{rank}-v{_VERSION}"
    folders = [cache / f"adapter{i}" for i in range(1, count + 1)]
    missing = [f for f in folders if not (f / "adapter_model.safetensors").is_file()]
    if missing:
        _make(model_dir, missing, rank)
    return folders


def _make(model_dir: Path, folders: list[Path], rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for folder in folders:
        seed = int(folder.name.removeprefix("adapter"))
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), lora_dropout=0.0,
                            init_lora_weights=False)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.normal_(0.0, param.shape[1] ** -0.5)
                elif "lora_B" in name:
                    param.normal_(0.0, 0.02)
        tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=folder.parent if folder.parent.exists() else None))
        model.save_pretrained(tmp, safe_serialization=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.exists():
            shutil.rmtree(folder)
        shutil.move(str(tmp), folder)
        (folder / "made_by.json").write_text(json.dumps({"seed": seed, "rank": rank, "base": str(model_dir)}))
