"""The LoRA flags of `pagedserve serve`, with vLLM's names and meanings -> `EngineConfig.lora` (a `LoraConfig`).

`--enable-lora` turns adapters on; without it every other LoRA flag is refused (a flag that would silently do
nothing is a mistake). vLLM turns runtime loading on with an environment variable; here it is a flag, and it needs
the folders adapters may be loaded from.
"""

from __future__ import annotations

import argparse
import json

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.lora.config import LoraConfig, LoraModule

_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    d = LoraConfig()
    g = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters over the base model")
    g.add_argument("--lora-modules", nargs="+", metavar="MODULE",
                   help="adapters loaded at start: name=path, or vLLM's JSON form "
                        '{"name": ..., "path": ..., "base_model_name": ...}; requests pick one by name (OpenAI '
                        "`model`, pagedserve.v1 `adapter`)")
    g.add_argument("--max-loras", type=int, help=f"distinct adapters in one engine step (default {d.max_loras})")
    g.add_argument("--max-lora-rank", type=int, help=f"largest adapter rank accepted (default {d.max_lora_rank})")
    g.add_argument("--max-cpu-loras", type=int,
                   help="adapters kept loaded in memory; others are read again from their folder on use "
                        "(default: --max-loras)")
    g.add_argument("--enable-runtime-lora-updates", action="store_true",
                   help="accept POST /v1/load_lora_adapter, /v1/unload_lora_adapter and the pagedserve.v1 "
                        "AdapterService's LoadAdapter/UnloadAdapter (default: off; needs --allowed-lora-dirs)")
    g.add_argument("--allowed-lora-dirs", nargs="+", metavar="DIR",
                   help="absolute folders runtime loads may read adapters from (symlinks and `..` are resolved "
                        "before the check)")


def lora_config(args: argparse.Namespace, served_names: tuple[str, ...] = ()) -> LoraConfig | None:
    """None unless --enable-lora; `served_names` (--served-model-name's, when given) are what a JSON module's
    base_model_name may be."""
    given = [flag for flag, value in (("--lora-modules", args.lora_modules), ("--max-loras", args.max_loras),
                                      ("--max-lora-rank", args.max_lora_rank), ("--max-cpu-loras", args.max_cpu_loras),
                                      ("--enable-runtime-lora-updates", args.enable_runtime_lora_updates or None),
                                      ("--allowed-lora-dirs", args.allowed_lora_dirs)) if value is not None]
    if not args.enable_lora:
        if given:
            raise ConfigError("enable_lora", f"{', '.join(given)} need --enable-lora")
        return None
    limits = {name: value for name, value in (("max_loras", args.max_loras), ("max_lora_rank", args.max_lora_rank),
                                              ("max_cpu_loras", args.max_cpu_loras)) if value is not None}
    modules = tuple(parse_lora_module(text, served_names) for text in args.lora_modules or ())
    return LoraConfig(modules=modules, runtime_updates=args.enable_runtime_lora_updates,
                      allowed_dirs=tuple(args.allowed_lora_dirs or ()), **limits)


def parse_lora_module(text: str, served_names: tuple[str, ...] = ()) -> LoraModule:
    """`name=path`, or vLLM's JSON object. This server has one base: a JSON `base_model_name` must be one of the
    names it is served under (any of --served-model-name's aliases, as vLLM takes them)."""
    if not text.lstrip().startswith("{"):
        return LoraModule.parse(text)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("lora_modules", f"{text!r}: not valid JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise ConfigError("lora_modules", f"{text!r}: expected a JSON object")
    unknown = sorted(set(spec) - _MODULE_KEYS)
    if unknown:
        raise ConfigError("lora_modules", f"unknown keys {unknown}; expected {sorted(_MODULE_KEYS)}")
    if "name" not in spec or "path" not in spec:
        raise ConfigError("lora_modules", f"{text!r}: needs both \"name\" and \"path\"")
    base = spec.get("base_model_name")
    if base is not None and served_names and base not in served_names:
        raise ConfigError("lora_modules.base_model_name", f"{base!r}: this server's only base model is served as "
                          f"{', '.join(map(repr, served_names))}")
    return LoraModule(spec["name"], spec["path"])
