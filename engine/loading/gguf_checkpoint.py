"""A GGUF file as a checkpoint: its HF config, its tensors under HF names in the model dtype, its tokenizer folder."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_archs import gguf_arch, hf_config, hf_tensor, hf_tensor_name
from pagedserve.engine.loading.gguf_file import GgufFile
from pagedserve.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

# Bump when the exported folder's contents change, so stale exports are rebuilt rather than trusted.
_TOKENIZER_EXPORT_VERSION = "1"


# HF names of the matrices a packed-weight method can serve: linear layers and the token embedding.
_PACKABLE_SUFFIXES = ("_proj.weight", "lm_head.weight", "model.embed_tokens.weight")
# The checkpoint dtype of a file whose matrices are all of one 16-bit type; any other file's is float32.
_MATRIX_DTYPES = {frozenset({"BF16"}): "bfloat16", frozenset({"F16"}): "float16"}


class GgufCheckpoint:
    def __init__(self, path: Path):
        self.path = path
        self.file = GgufFile(path)
        self.arch = gguf_arch(self.file.architecture)
        self.file.check_types()
        self.hf_config: dict[str, Any] = hf_config(self.file.architecture, self.file.metadata, self.file.tensor_names,
                                                   self.file.tensor)
        self.packed: dict[str, str] = {}  # GGUF name -> HF name of the matrices handed over as blocks
        # A file whose matrices are all bf16 (or all fp16) is a 16-bit checkpoint (engine/loading/dtype_plan.py)
        self.hf_config["dtype"] = _MATRIX_DTYPES.get(frozenset(self.file.tensor_types().values()), "float32")

    def keep_packed(self, packed_types: frozenset[str], dense_batches: bool = False) -> None:
        """Matrices of `packed_types` stay in their blocks: the config then names the `gguf` method and lists them
        in `quantization_config.tensor_types`; every other tensor is still dequantized once at load. dense_batches:
        the method also keeps each matrix expanded for many-row calls (quant/gguf.py)."""
        types = {}
        for name, qtype in self.file.tensor_types().items():
            hf_name = hf_tensor_name(self.arch, name)
            if qtype in packed_types and hf_name.endswith(_PACKABLE_SUFFIXES):
                self.packed[name] = hf_name
                for part in self.arch.fused_parts(hf_name) or self._experts(hf_name) or (hf_name,):  # its linears
                    types[part] = qtype
        if types:
            self.hf_config["quantization_config"] = {"quant_method": "gguf", "tensor_types": types,
                                                     "dense_batches": dense_batches}

    def tensors(self, dtype: torch.dtype, matrix_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor under its HF name: packed matrices as their blocks, the rest dequantized once (fp32, where
        the layout fixes happen), then cast to `dtype`, matrices to `matrix_dtype` (default `dtype`: 16-bit matrices
        of an fp32-compute model stay 16-bit, while the fp32 norms stay fp32)."""
        matrix_dtype = matrix_dtype or dtype
        types = ", ".join(f"{name} x{count}" for name, count in self.file.type_counts().most_common())
        kept = f"{len(self.packed)} matrices kept in their blocks, the rest" if self.packed else "all"
        logger.info("%s: GGUF %s with tensor types %s; %s dequantized once into %s",
                    self.path.name, self.file.architecture, types, kept, dtype)
        for name, values in self.file.tensors(frozenset(self.packed)):
            if name in self.arch.config_tensors:
                continue
            hf_name, values = hf_tensor(self.arch, name, values, self.hf_config)
            packed = name in self.packed
            parts = self._experts(hf_name)
            if parts:  # a stacked expert tensor: one matrix (or block rows) per expert
                for part, rows in zip(parts, values, strict=True):
                    yield part, rows if packed else rows.to(matrix_dtype)
                continue
            yield hf_name, values if packed else values.to(matrix_dtype if values.dim() == 2 else dtype)

    def _experts(self, hf_name: str) -> tuple[str, ...]:
        config = self.hf_config  # transformers 5's config calls it num_local_experts
        return self.arch.expert_parts(hf_name, int(config.get("num_experts") or config.get("num_local_experts") or 0))


def tokenizer_dir(gguf_path: Path) -> Path:
    """A folder with the file's tokenizer as transformers builds it from the GGUF vocabulary (tokenizer.json,
    tokenizer_config.json, chat_template.jinja when the file has tokenizer.chat_template) plus a
    generation_config.json with its token ids: made once per file and transformers version, in the cache. The
    engine's tokenizer and GetTokenizer's bundle read it like any HF folder."""
    import transformers

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{_TOKENIZER_EXPORT_VERSION}"
    target = cache_root() / "tokenizers" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written into a temporary sibling and renamed, so a crash never leaves a half-written folder behind.
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        _export_tokenizer(gguf_path, tmp)
        if target.exists():  # a folder without tokenizer.json is not ours to trust
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process exported the same file first
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tokenizer of %s exported to %s", gguf_path, target)
    return target


def _export_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many types for a vocabulary it cannot convert
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from its vocabulary ({exc})") from None
    tokenizer.save_pretrained(str(out_dir))
    metadata = GgufFile(gguf_path).metadata
    ids = {hf: metadata.get(f"tokenizer.ggml.{key}")
           for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("padding_token_id", "pad_token_id"))}
    GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(str(out_dir))
