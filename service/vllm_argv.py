"""`vllm serve`'s ways of writing a command line, read before argparse parses it:

- option names with underscores: `--max_model_len 512` is `--max-model-len 512` (vLLM's FlexibleArgumentParser);
- `--config FILE`: a YAML mapping of long option names (dashes or underscores) to values, e.g. a Kubernetes
  ConfigMap. Its entries go before the command line's own, so the command line wins, as vLLM orders them (command
  line > config file > defaults); a model given on the command line replaces the file's `model`. A flag that takes
  no value is `true` (or `false`: left out, or `--no-...` where the flag has that form); a list is a flag's several
  values; a mapping is its JSON (`speculative-config: {method: ngram, ...}`). A key this server has no flag for,
  or a value of the wrong shape, stops the start naming the key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from pagedserve.engine.errors import ConfigError

CONFIG_FLAG = "--config"


def dashed(token: str) -> str:
    """`--max_model_len=5` -> `--max-model-len=5`; values and short options as they are."""
    if not token.startswith("--") or len(token) == 2:
        return token
    name, sep, value = token.partition("=")
    return name.replace("_", "-") + sep + value


def vllm_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with dashed option names and, for `serve --config FILE`, the file's flags in front of its own."""
    argv = [dashed(token) for token in argv]
    if not argv or argv[0] != "serve":
        return argv
    path = _config_path(argv)
    if path is None:
        return argv
    given = parser.parse_args(argv)  # the command line alone: its own mistakes are reported as without a file
    model_given = given.model_tag is not None or given.model is not None
    serve = _subparser(parser, "serve")
    return ["serve", *config_tokens(serve, _load(path), skip_model=model_given, source=path), *argv[1:]]


def _config_path(argv: list[str]) -> Path | None:
    for i, token in enumerate(argv):
        if token == CONFIG_FLAG and i + 1 < len(argv):
            return Path(argv[i + 1])
        if token.startswith(CONFIG_FLAG + "="):
            return Path(token.partition("=")[2])
    return None


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
        action = options.get(flag) if flag not in (CONFIG_FLAG, "--help") else None
        if action is None:
            raise ConfigError("config", f"{source}: {key!r} is not a flag of `pagedserve serve`")
        if flag == "--model" and skip_model:
            continue
        tokens += _flag_tokens(flag, action, value, source)
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
