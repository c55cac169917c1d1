"""The model's tokenizer files as one zip, for routers that build their tokenizer remotely (GetTokenizer)."""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

# What a HF tokenizer (and its chat template) is built from; weights and model config stay home.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    data: bytes  # zip archive
    sha256: str  # hex digest of `data`

    def chunks(self) -> list[bytes]:
        return [self.data[i:i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)] or [b""]


def bundle(folder: Path) -> TokenizerBundle:
    buffer = io.BytesIO()
    # Fixed timestamps: the same files give the same bytes and fingerprint on every replica.
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = folder / name
            if path.is_file():
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest())
