"""`vllm serve`'s ways of writing a command line, read before argparse parses it:

- option names with underscores: `--max_model_len 512` is `--max-model-len 512` (vLLM's FlexibleArgumentParser);
- a JSON flag's keys one by one: `--compilation-config.cudagraph_mode=NONE`, `-O.cudagraph_capture_sizes [1,2]`,
  `--speculative-config.num_speculative_tokens 3` (a dotted path nests; `key+ a,b` is a list of strings; values are
  JSON where they parse, text otherwise). They gather into one JSON object per flag with that flag's own JSON, a
  later key or object over an earlier one; `-O3` is `-O.mode=3`, vLLM's optimization level;
- `--config FILE`: a YAML mapping of long option names (dashes or underscores) to values, e.g. a Kubernetes
  ConfigMap (a JSON flag's key may be one entry too: `compilation-config.cudagraph_mode: NONE`). Its entries go
  before the command line's own, so the command line wins, as vLLM orders them (command
  line > config file > defaults); a model given on the command line replaces the file's `model`. A flag that takes
  no value is `true` (or `false`: left out, or `--no-...` where the flag has that form); a list is a flag's several
  values; a mapping is its JSON (`speculative-config: {method: ngram, ...}`). A key this server has no flag for,
  or a value of the wrong shape, stops the start naming the key.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import yaml

from pagedserve.engine.errors import ConfigError

CONFIG_FLAG = "--config"
# `--flag.key.sub[+][=value]` or `-O.key...`: the flag, its key path, and the value when joined by `=`
_DOTTED = re.compile(r"(--[A-Za-z][A-Za-z0-9-]*|-O)\.([A-Za-z0-9_.]+?)(\+?)(?:=(.*))?", re.DOTALL)
_OPTIMIZATION_LEVEL = re.compile(r"-O=?([0-3])")
_LEVELS = ("0", "1", "2", "3")


def dashed(token: str) -> str:
    """`--max_model_len=5` -> `--max-model-len=5`; a JSON flag's keys after a dot, values and short options stay."""
    if not token.startswith("--") or len(token) == 2:
        return token
    name, sep, value = token.partition("=")
    flag, dot, keys = name.partition(".")
    return flag.replace("_", "-") + dot + keys + sep + value


def vllm_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with dashed option names, dotted JSON keys gathered into their flags' JSON and, for `serve --config
    FILE`, the file's flags in front of its own."""
    argv = [dashed(token) for token in argv]
    if not argv or argv[0] != "serve":
        return argv
    serve = _subparser(parser, "serve")
    canonical = _canonical(serve)
    path = _config_path(argv)
    if path is None:
        return gather_dotted(argv, canonical)
    # the command line alone first: its own mistakes are reported as without a file
    given = parser.parse_args(gather_dotted(argv, canonical))
    model_given = given.model_tag is not None or given.model is not None
    file_tokens = config_tokens(serve, _load(path), skip_model=model_given, source=path)
    return gather_dotted(["serve", *file_tokens, *argv[1:]], canonical)  # the file's dotted keys, then the line's


def gather_dotted(argv: list[str], canonical: Callable[[str], str] = str) -> list[str]:
    """Each `--flag.key value` / `--flag.key=value` folded into one `--flag JSON` where the flag is first named,
    with the flag's own JSON objects, in order: a later key or object goes over an earlier one (so a command line's
    over its --config file's). `canonical` names a flag's aliases alike (`-O` is `--compilation-config`)."""
    items: list[str | tuple[str, list[str], object, str]] = []  # tokens, and (flag, key path, value, token)
    i = 0
    while i < len(argv):
        token, i = argv[i], i + 1
        if token == "-O" and i < len(argv) and argv[i] in _LEVELS:  # vLLM's `-O 3`
            token, i = f"-O.mode={argv[i]}", i + 1
        level = _OPTIMIZATION_LEVEL.fullmatch(token)
        match = _DOTTED.fullmatch(f"-O.mode={level.group(1)}" if level else token)
        if match is None:
            items.append(token)
            continue
        flag, path, append, text = match.groups()
        if text is None:
            if i == len(argv):
                raise ConfigError("argv", f"{token}: expects a value")
            text, i = argv[i], i + 1
        items.append((canonical(flag), path.split("."), text.split(",") if append else _json_or_text(text), token))
    dotted = {item[0] for item in items if isinstance(item, tuple)}
    return _fold(items, dotted, canonical) if dotted else argv


def _fold(items: list, dotted: set[str], canonical: Callable[[str], str]) -> list[str]:
    out: list[str] = []
    objects: dict[str, dict] = {}
    slots: dict[str, int] = {}  # where each flag's JSON goes in `out`
    items_left = iter(items)
    for item in items_left:
        flag = item[0] if isinstance(item, tuple) else canonical(item.partition("=")[0])
        if flag not in dotted:
            out.append(item)
            continue
        merged = objects.setdefault(flag, {})
        if isinstance(item, tuple):
            _set_path(merged, item[1], item[2], item[3])
        else:  # the flag's own JSON: `--flag JSON` or `--flag=JSON`
            text = item.partition("=")[2] if "=" in item else next(items_left, None)
            objects[flag] = _merged(merged, _json_object(flag, text))
        if flag not in slots:
            slots[flag] = len(out) + 1
            out += [flag, ""]
    for flag, slot in slots.items():
        out[slot] = json.dumps(objects[flag])
    return out


def _json_object(flag: str, text: object) -> dict:
    value = _json_or_text(text) if isinstance(text, str) else text
    if not isinstance(value, dict):
        raise ConfigError("argv", f"{flag}: its JSON must be an object to take dotted keys too, got {text!r}")
    return value


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_path(target: dict, keys: list[str], value: object, token: str) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError("argv", f"{token}: {key} already holds a value, not keys")
    target[keys[-1]] = value


def _merged(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        both_dicts = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both_dicts else value
    return merged


def _config_path(argv: list[str]) -> Path | None:
    for i, token in enumerate(argv):
        if token == CONFIG_FLAG and i + 1 < len(argv):
            return Path(argv[i + 1])
        if token.startswith(CONFIG_FLAG + "="):
            return Path(token.partition("=")[2])
    return None


def _canonical(parser: argparse.ArgumentParser) -> Callable[[str], str]:
    """An option's first name for each of its names (`-O` -> `--compilation-config`); unknown names as they are."""
    names = {name: action.option_strings[0] for action in parser._actions  # noqa: SLF001
             for name in action.option_strings}
    return lambda option: names.get(option, option)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[name]


def _load(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config", f"{path}: cannot read it as YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path}: must be a mapping of flag names to values, got {type(data).__name__}")
    return data


def config_tokens(serve: argparse.ArgumentParser, entries: dict, skip_model: bool, source: Path) -> list[str]:
    """The file's entries as command-line tokens for the `serve` parser."""
    options = {option: action for action in serve._actions for option in action.option_strings}  # noqa: SLF001
    tokens: list[str] = []
    for key, value in entries.items():
        flag = dashed(f"--{key}") if isinstance(key, str) else None
        base, dot, path = flag.partition(".") if flag else (None, "", "")
        action = options.get(base) if base not in (CONFIG_FLAG, "--help") else None
        if action is None or dot and not path:
            raise ConfigError("config", f"{source}: {key!r} is not a flag of `pagedserve serve`")
        if flag == "--model" and skip_model:
            continue
        tokens += [flag, _text(value)] if dot else _flag_tokens(flag, action, value, source)  # a JSON flag's key
    return tokens


def _flag_tokens(flag: str, action: argparse.Action, value: object, source: Path) -> list[str]:
    def wrong(shape: str) -> ConfigError:
        return ConfigError("config", f"{source}: {flag[2:]}: expects {shape}, got {value!r}")

    if action.nargs == 0:  # a switch: true or false
        if not isinstance(value, bool):
            raise wrong("true or false")
        negative = "--no-" + flag[2:]
        return [flag] if value else ([negative] if negative in action.option_strings else [])
    if isinstance(value, list):
        if action.nargs not in ("+", "*") or not value:
            raise wrong("one value" if action.nargs not in ("+", "*") else "a non-empty list")
        return [flag, *(_text(v) for v in value)]
    if value is None:
        raise wrong("a value")
    return [flag, json.dumps(value) if isinstance(value, dict) else _text(value)]


def _text(value: object) -> str:
    return json.dumps(value) if isinstance(value, (bool, dict, list)) else str(value)
