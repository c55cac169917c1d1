"""External workloads as JSONL: one request per line, so any trace can be replayed through every system.

Each line is an object with exactly these fields:
    prompt_token_ids  list of ints >= 0 (non-empty)
    max_tokens        int >= 1: the output length (EOS is ignored, so every system generates exactly this)
    arrival_s         number >= 0: seconds after the run starts; non-decreasing from line to line
    request_id        optional string, unique (default: req-<line index>)
Blank lines are skipped. dump_workload writes the built-in seeded workload in this format, so
`compare.py --dump-workload F` then `--workload-file F` replays exactly the built-in workload.
"""

from __future__ import annotations

import json
from pathlib import Path

from workload import BenchRequest, Workload, WorkloadConfig, WorkloadError

REQUIRED = ("prompt_token_ids", "max_tokens", "arrival_s")
OPTIONAL = ("request_id",)


class WorkloadFileError(WorkloadError):
    """A workload file line that cannot be a request; names the file, line and field."""

    def __init__(self, path: str, line: int, field: str | None, message: str) -> None:
        where = f"{path}:{line}" + (f": field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.field = path, line, field


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_line(path: str, lineno: int, text: str, index: int) -> BenchRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadFileError(path, lineno, None, f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise WorkloadFileError(path, lineno, None, "each line must be a JSON object")
    for name in REQUIRED:
        if name not in obj:
            raise WorkloadFileError(path, lineno, name, "missing")
    for name in obj:
        if name not in REQUIRED + OPTIONAL:
            raise WorkloadFileError(path, lineno, name, f"unknown field; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    ids = obj["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise WorkloadFileError(path, lineno, "prompt_token_ids", "must be a non-empty list of ints >= 0")
    if not _is_int(obj["max_tokens"]) or obj["max_tokens"] < 1:
        raise WorkloadFileError(path, lineno, "max_tokens", f"must be an int >= 1, got {obj['max_tokens']!r}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not arrival >= 0:
        raise WorkloadFileError(path, lineno, "arrival_s", f"must be a number >= 0, got {arrival!r}")
    rid = obj.get("request_id", f"req-{index}")
    if not isinstance(rid, str) or not rid:
        raise WorkloadFileError(path, lineno, "request_id", "must be a non-empty string")
    return BenchRequest(rid, tuple(ids), obj["max_tokens"], float(arrival))


def load_workload(path: str | Path) -> Workload:
    name = str(path)
    requests: list[BenchRequest] = []
    seen: set[str] = set()
    for lineno, text in enumerate(Path(path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        req = _parse_line(name, lineno, text, len(requests))
        if req.request_id in seen:
            raise WorkloadFileError(name, lineno, "request_id", f"duplicate {req.request_id!r}")
        if requests and req.arrival_s < requests[-1].arrival_s:
            raise WorkloadFileError(name, lineno, "arrival_s", f"{req.arrival_s} is before the previous line's "
                                    f"{requests[-1].arrival_s}; lines must be in arrival order")
        seen.add(req.request_id)
        requests.append(req)
    if not requests:
        raise WorkloadFileError(name, 0, None, "no requests")
    return Workload(describe(requests), tuple(requests), name)


def describe(requests: list[BenchRequest]) -> WorkloadConfig:
    """A config that summarises file requests (lengths, id range); seed 0, arrival 'file'."""
    plens = [len(r.prompt_token_ids) for r in requests]
    olens = [r.max_tokens for r in requests]
    ids = [t for r in requests for t in r.prompt_token_ids]
    return WorkloadConfig(num_requests=len(requests), prompt_len_min=min(plens), prompt_len_max=max(plens),
                          output_len_min=min(olens), output_len_max=max(olens), seed=0,
                          token_id_low=min(ids), token_id_high=max(ids) + 1, arrival="file")


def request_to_dict(r: BenchRequest) -> dict:
    return {"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
            "max_tokens": r.max_tokens, "arrival_s": r.arrival_s}


def dump_workload(workload: Workload, path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(request_to_dict(r)) + "\n" for r in workload.requests))
