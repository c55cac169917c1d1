"""The harness's external workload file (benchmarks/workload_file.py): round trip and field-named errors."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from bench_paths import PEERS

from workload import QUICK, WorkloadConfig, build_workload, with_poisson_arrivals  # noqa: E402
from workload_file import WorkloadFileError, dump_workload, load_workload  # noqa: E402
from worker_protocol import _decode, _encode  # noqa: E402


def _same_requests(a, b) -> bool:
    return [(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_s) for r in a.requests] == \
           [(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_s) for r in b.requests]


def test_dump_then_load_is_the_builtin_workload(tmp_path):
    seeded = build_workload(replace(QUICK, arrival="poisson", rate=3.0))
    path = tmp_path / "w.jsonl"
    dump_workload(seeded, path)
    loaded = load_workload(path)
    assert _same_requests(seeded, loaded)
    assert loaded.num_prompt_tokens == seeded.num_prompt_tokens
    assert loaded.num_output_tokens == seeded.num_output_tokens
    summary = loaded.summary()
    assert summary["source"] == str(path) and summary["arrival"] == "file"
    assert (summary["prompt_len_min"], summary["prompt_len_max"]) == (
        min(len(r.prompt_token_ids) for r in seeded.requests), max(len(r.prompt_token_ids) for r in seeded.requests))


def test_compare_cli_dump_workload_round_trips(tmp_path):
    path = tmp_path / "cli.jsonl"
    cmd = [sys.executable, str(PEERS / "compare.py"), "--dump-workload", str(path), "--num-requests", "5",
           "--prompt-len", "4", "9", "--output-len", "2", "3", "--seed", "7"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    expected = build_workload(WorkloadConfig(num_requests=5, prompt_len_min=4, prompt_len_max=9,
                                             output_len_min=2, output_len_max=3, seed=7))
    assert _same_requests(expected, load_workload(path))
    assert len(path.read_text().splitlines()) == 5


GOOD = {"prompt_token_ids": [1, 2, 3], "max_tokens": 4, "arrival_s": 0.5}


@pytest.mark.parametrize("line, field", [
    ({"max_tokens": 4, "arrival_s": 0}, "prompt_token_ids"),
    ({**GOOD, "prompt_token_ids": []}, "prompt_token_ids"),
    ({**GOOD, "prompt_token_ids": [1, -2]}, "prompt_token_ids"),
    ({**GOOD, "prompt_token_ids": "1 2 3"}, "prompt_token_ids"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "max_tokens"),
    ({**GOOD, "arrival_s": -1}, "arrival_s"),
    ({**GOOD, "arrival_s": True}, "arrival_s"),
    ({**GOOD, "arrival_s": "soon"}, "arrival_s"),
    ({**GOOD, "temperature": 0.7}, "temperature"),
    ({**GOOD, "request_id": 3}, "request_id"),
])
def test_bad_line_names_the_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(WorkloadFileError) as info:
        load_workload(path)
    assert info.value.field == field and info.value.line == 2
    assert f"{path}:2: field {field!r}" in str(info.value)


@pytest.mark.parametrize("text, field, message", [
    (json.dumps({**GOOD, "arrival_s": 2}) + "\n" + json.dumps(GOOD), "arrival_s", "arrival order"),
    (json.dumps({**GOOD, "request_id": "a"}) + "\n" + json.dumps({**GOOD, "request_id": "a"}), "request_id",
     "duplicate"),
    ("{not json", None, "not JSON"),
    ("[1, 2]", None, "JSON object"),
    ("\n\n", None, "no requests"),
])
def test_file_level_errors(tmp_path, text, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadFileError, match=message) as info:
        load_workload(path)
    assert info.value.field == field


def test_blank_lines_skipped_and_default_ids(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "arrival_s": 1.0}) + "\n")
    w = load_workload(path)
    assert [r.request_id for r in w.requests] == ["req-0", "req-1"]
    assert [r.arrival_s for r in w.requests] == [0.5, 1.0]


def test_poisson_arrivals_keep_requests_and_match_seeded_build():
    seeded = build_workload(QUICK)
    redrawn = with_poisson_arrivals(seeded, 2.0)
    assert _same_requests(redrawn, build_workload(replace(QUICK, arrival="poisson", rate=2.0)))
    assert [r.prompt_token_ids for r in redrawn.requests] == [r.prompt_token_ids for r in seeded.requests]


def test_file_workload_travels_through_the_worker_protocol(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({**GOOD, "request_id": "x"}) + "\n" + json.dumps({**GOOD, "arrival_s": 3}) + "\n")
    w = load_workload(path)
    back = _decode(json.loads(_encode(w)))
    assert _same_requests(w, back) and back.source == str(path) and back.config == w.config
