"""A tiny random Llama served by real server processes, with adapters made by `peft` through tests/lora_fixtures.py
(random non-zero A and B) and transformers + peft's greedy tokens as the reference; and the JSON POST the LoRA tests
send, which returns the status and the reply of a refusal too (the error's field is what they check)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lora_fixtures import AdapterSpec, hf_base, make_adapter as make_peft_adapter, with_adapter

from conftest import hf_greedy, make_tiny_model
from service_fixtures import ServerProcess


@dataclass(frozen=True)
class LoraSet:
    base: Path
    adapters: dict[str, Path]  # name -> PEFT folder
    root: Path  # the allowed folder every adapter lies in


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT adapter folder on every q/k/v/o/gate/up/down projection, with random non-zero A and B."""
    return make_peft_adapter(hf_base(base), AdapterSpec(out.name, rank, seed=seed, std=0.15), out)


def make_lora_set(root: Path, names: tuple[str, ...]) -> LoraSet:
    base = make_tiny_model(root / "base")
    model, folder = hf_base(base), root / "adapters"
    adapters = {name: make_peft_adapter(model, AdapterSpec(name, 8, seed=100 + i, std=0.15), folder / name)
                for i, name in enumerate(names)}
    return LoraSet(base, adapters, folder)


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def peft_greedy(lora: LoraSet, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers (+ peft with the named adapter) greedy tokens, EOS ignored: the reference."""
    model = hf_base(lora.base)
    if adapter is not None:
        model = with_adapter(model, lora.adapters[adapter])
    return hf_greedy(model, prompt_ids, max_new_tokens)


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(server.http_url + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            status, raw, kind = reply.status, reply.read().decode(), reply.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read().decode(), exc.headers.get("content-type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw
