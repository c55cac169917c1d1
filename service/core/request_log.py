"""Structured logs an operator reads beside the metrics: one JSON line per request when it is admitted and when
it finishes (`--enable-log-requests`), and a periodic stats line (`--stats-interval`, vLLM's 10 s by default).

Lines go to stderr, each one JSON object (no level or time prefix: a log shipper parses it as is; `ts` is Unix
seconds): request lines straight to the stream (one write each, two per request on the event loop, without the
logging module's per-record work), stats lines through this module's STATS_LOGGER. A request's prompt is never
logged unless the server was started with `--log-prompts`, nor its output without `--enable-log-outputs`, and then
at most `--max-log-len` tokens (and characters of text) of each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from pagedserve.engine.outputs import CompletionOutput, EngineStats

STATS_LOGGER = f"{__name__}.stats"
_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_logger(name: str) -> logging.Logger:
    """A logger that writes bare JSON lines to stderr, apart from the server's human-readable log."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_pagedserve_json", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._pagedserve_json = True  # noqa: SLF001 - marks ours, so a second server in-process adds none
        logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


@dataclass(frozen=True, slots=True)
class RequestLogConfig:
    log_prompts: bool = False  # off: a prompt's text and token ids never reach the log
    max_log_len: int | None = None  # prompt / output tokens (and characters of text) logged at most; None: all
    log_outputs: bool = False  # off: generated text and token ids never reach the log


class RequestLog:
    """stream: where the lines go (default: sys.stderr as it is when the server starts)."""

    def __init__(self, config: RequestLogConfig, decode: Callable[[list[int]], str] | None = None,
                 stream: TextIO | None = None):
        self.config, self.decode = config, decode
        self.stream = stream or sys.stderr

    def write(self, record: dict[str, Any]) -> None:
        self.stream.write(_DUMPS({"ts": round(time.time(), 6), **record}) + "\n")  # stderr is line-buffered: the line leaves at once

    def prompt_fields(self, prompt_token_ids: tuple[int, ...]) -> dict[str, Any]:
        if not self.config.log_prompts:
            return {}
        limit = self.config.max_log_len
        ids = list(prompt_token_ids if limit is None else prompt_token_ids[:limit])
        fields: dict[str, Any] = {"prompt_token_ids": ids}
        if self.decode is not None:
            text = self.decode(ids)
            fields["prompt"] = text if limit is None else text[:limit]
        return fields


    def output_fields(self, completions: Sequence[CompletionOutput]) -> dict[str, Any]:
        """Each sample's text and token ids as the client got them (vLLM's --enable-log-outputs), in index order."""
        if not self.config.log_outputs:
            return {}
        limit = self.config.max_log_len
        return {"outputs": [{"index": c.index, "text": c.text if limit is None else c.text[:limit],
                             "token_ids": list(c.token_ids if limit is None else c.token_ids[:limit])}
                            for c in sorted(completions, key=lambda c: c.index)]}


class StatsLog:
    """vLLM's periodic engine line: prompt and generation throughput since the previous line, running and waiting
    requests, KV-cache usage and prefix-cache hit rate. Like vLLM it logs at DEBUG while the server stays idle."""

    def __init__(self, interval_s: float, stats: Callable[[], EngineStats | None], tokens: Callable[[], tuple[int, int]]):
        self.interval_s, self.stats, self.tokens = interval_s, stats, tokens
        self.logger = json_logger(STATS_LOGGER)
        self._task: asyncio.Task | None = None
        self._last = (time.monotonic(), *tokens())
        self._was_busy = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            record = self.line()
            if record is not None:
                busy = record["prompt_throughput"] or record["generation_throughput"] or record["running"]
                level = logging.INFO if busy or self._was_busy else logging.DEBUG
                self._was_busy = bool(busy)
                self.logger.log(level, _DUMPS(record))

    def line(self) -> dict[str, Any] | None:
        """The next stats record (None while the model loads); advances the throughput window."""
        s = self.stats()
        if s is None:
            return None
        now, (prompt, generated) = time.monotonic(), self.tokens()
        then, prompt_then, generated_then = self._last
        self._last = (now, prompt, generated)
        elapsed = max(now - then, 1e-9)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return {"ts": round(time.time(), 6), "event": "stats", "interval_s": round(elapsed, 3),
                "prompt_throughput": round((prompt - prompt_then) / elapsed, 2),
                "generation_throughput": round((generated - generated_then) / elapsed, 2),
                "running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage": round(s.kv_cache_usage, 4),
                "prefix_cache_hit_rate": round(hit_rate, 4), "preemptions": s.num_preemptions}
