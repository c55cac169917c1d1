"""The models the benchmarks compare as HF safetensors folders, for the peers that read only those (transformers
baselines, vLLM, llama.cpp's converter, the GPTQ/AWQ tools). pagedserve itself serves the embedded GGUF as it is;
this folder holds transformers' own dequantization of the same file, so both sides compute on the same weights
(tests/test_gguf_models.py checks that pagedserve's GGUF loader gives those very values).

    python benchmarks/hf_folder.py [MODEL]              # the fp32 folder's path (made once)
    python benchmarks/hf_folder.py [MODEL] --bfloat16   # the same weights rounded to bf16, a folder beside it"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the conversion changes, so stale cached folders are rebuilt rather than trusted.
_CONVERSION_VERSION = "2"


def hf_folder(model: str | None = None) -> Path:
    """`model` as an HF folder: a folder is returned as it is; None, an embedded name or a .gguf file is converted
    once into a cached folder."""
    from pagedserve.engine.loading.model_store import resolve_model

    source = resolve_model(model)
    if source.weights.is_dir():
        return source.weights
    return _converted(source.weights, source.tokenizer_dir, source.name)


def _converted(gguf_path: Path, tokenizer_dir: Path, name: str) -> Path:
    from pagedserve.kernels.cache_dir import cache_root

    target = cache_root() / "models" / f"{name}-v{_CONVERSION_VERSION}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    logger.warning("converting %s into an HF safetensors folder at %s (once)", gguf_path, target)
    return _written(target, lambda tmp: _convert(gguf_path, tokenizer_dir, tmp))


def _written(target: Path, write) -> Path:
    """`target` made by `write(folder)` in a temporary folder beside it, renamed into place once complete (a run
    that dies half-way leaves no folder that looks finished)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path: Path, tokenizer_dir: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # fp32: the dequantized values (d*q+m) are exact in fp32 but not in bf16/fp16.
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config
    config.architectures = [type(model).__name__]  # GGUF-derived configs lack it; loaders pick the class by it
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    for item in tokenizer_dir.iterdir():  # the same tokenizer files pagedserve reads for this GGUF
        if item.is_file():
            shutil.copy2(item, out_dir / item.name)


def bf16_folder(model: str | None = None) -> Path:
    """`hf_folder(model)` with its weights rounded to bf16, cached beside it: a checkpoint as the model hubs ship
    one (SmolLM2's is bf16), which `--dtype auto` computes in fp32 over the bf16 weights on a host without bf16
    arithmetic, where the fp32 folder takes the fp32-weight path."""
    import torch
    from safetensors.torch import load_file, save_file

    source = hf_folder(model)
    target = source.with_name(source.name + "-bf16")
    if (target / "model.safetensors").is_file():
        return target

    def write(tmp: Path) -> None:
        for item in source.iterdir():
            if item.is_file() and item.name != "model.safetensors":
                shutil.copy2(item, tmp / item.name)
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(source / "model.safetensors")).items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = (tmp / "config.json").read_text()
        (tmp / "config.json").write_text(config.replace('"float32"', '"bfloat16"'))
    return _written(target, write)


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if a != "--bfloat16"]
    print((bf16_folder if "--bfloat16" in sys.argv else hf_folder)(args[0] if args else None))
