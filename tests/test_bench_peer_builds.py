"""The peers harness's llama.cpp builds per tier, pagedserve's tier environment, the 1B-shaped model's layout and
the low-concurrency section's prefill and bandwidth rows (no peer is started here: benchmarks/peers/ runs them)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from bench_paths import PEERS

import host_record  # noqa: E402
import low_concurrency  # noqa: E402
import model_1b  # noqa: E402
import paths  # noqa: E402
import servers  # noqa: E402
from metrics import RequestTiming, summarize  # noqa: E402

def test_no_repack_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="repacked kernels"):
        servers.start_llama_server("", "bfloat16", tmp_path, gguf=tmp_path / "absent.gguf",
                                   extra_args=("--no-repack",))
    assert not list(tmp_path.iterdir())  # no log: nothing was spawned


def test_no_harness_file_passes_no_repack():
    for path in PEERS.iterdir():
        if path.suffix in (".py", ".sh"):
            text = path.read_text()
            assert '"--no-repack"' not in text.replace('NO_REPACK = "--no-repack"', ""), path


def test_builds_per_tier_live_side_by_side(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_PEERS_CACHE", str(tmp_path))
    assert paths.llama_server("native") == tmp_path / "llama-build-native" / "bin" / "llama-server"
    assert paths.llama_quantize("avx2") == tmp_path / "llama-build-avx2" / "bin" / "llama-quantize"
    assert paths.llama_build_info("avx2") == {"missing": str(tmp_path / "llama-build-avx2" / "pagedserve-build.json")}
    with pytest.raises(ValueError, match="native, avx2"):
        paths.llama_server("avx512")
    assert "llama-build-avx2" in low_concurrency.missing_peer("llama-server", "avx2")


def test_pagedserve_tier_environment(monkeypatch):
    monkeypatch.setenv(servers.ISA_ENV, "portable")
    assert servers.ISA_ENV not in servers.pagedserve_env("native")  # native: the host's best, whatever the shell
    assert servers.pagedserve_env("avx2")[servers.ISA_ENV] == "avx2"
    assert servers.pagedserve_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"  # torch's GEMMs capped too
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA" not in servers.pagedserve_env("native")
    with pytest.raises(ValueError, match="native, avx2"):
        servers.pagedserve_env("sse2")


def test_vllm_avx2_tier_environment_hides_avx512_from_torch():
    """The forced tier reaches every Python process of vLLM's environment: a child that imports torch sees no AVX-512,
    no AVX512-BF16 and no AMX, and torch's own kernels run at AVX2 (a real interpreter and torch, on any x86 host)."""
    import sys

    env = servers.vllm_env(1, "0", tier="avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    probe = ("import torch; c = torch.cpu; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
             "c._is_amx_tile_supported(), torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "AVX2"]
    assert "vllm_avx2" not in servers.vllm_env(1, "0").get("PYTHONPATH", "")
    with pytest.raises(ValueError, match="native, avx2"):
        servers.vllm_env(1, "0", tier="sse2")


@pytest.mark.skipif(shutil.which("cc") is None or not Path("/proc/cpuinfo").exists(), reason="needs cc and Linux")
def test_no_amx_flags_leave_no_amx_code_in_a_native_build():
    """What build_llama_server.sh native adds where the VM refuses AMX: gcc then defines no __AMX_*__ macro, so
    ggml compiles none of its AMX kernels, while -march=native keeps every other extension."""
    flags = subprocess.run([str(PEERS / "build_llama_server.sh"), "--no-amx-flags"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert all(f.startswith("-mno-amx-") for f in flags)
    macros = subprocess.run(["cc", "-march=native", *flags, "-dM", "-E", "-"], input="", capture_output=True,
                            text=True, check=True).stdout
    assert "__AMX_" not in macros
    native = subprocess.run(["cc", "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True,
                            check=True).stdout
    kept = {line for line in native.splitlines() if "__AMX_" not in line}
    assert kept <= set(macros.splitlines())


def test_model_1b_has_llama_3_2_1b_widths():
    """The tensors model_1b writes are exactly those transformers' Llama of that config holds (tied head)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedserve.engine.loading.model_store import resolve_model

    shape = model_1b.Shape()
    tokenizer_dir = resolve_model(None).tokenizer_dir
    cfg = model_1b.config(shape, tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert len(tok) <= cfg["vocab_size"] == 49152
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    want = {n: tuple(p.shape) for n, p in model.state_dict().items() if n != "lm_head.weight"}
    assert model_1b.tensor_shapes(shape) == want
    assert 1.07e9 < sum(p.numel() for n, p in model.named_parameters()) < 1.08e9
    with pytest.raises(ValueError, match="num_attention_heads"):
        model_1b.Shape(num_attention_heads=30)
    assert model_1b.gguf_file("Q4_K_M").name == f"{model_1b.NAME}-q4_k_m.gguf"
    assert "1b-q4_k_m" in low_concurrency.MODEL_FILES and "1b-bf16" in low_concurrency.MODEL_FILES


def test_prefill_row_is_prompt_tokens_over_the_fastest_first_token():
    w = low_concurrency.prefill_workload(512)
    assert [len(r.prompt_token_ids) for r in w.requests] == [512] and w.requests[0].max_tokens == 2
    slow = summarize("p", "bfloat16", [RequestTiming("r", 0.0, (2.0, 2.1))], 512)
    fast = summarize("p", "bfloat16", [RequestTiming("r", 0.0, (0.5, 0.6))], 512)
    row = low_concurrency.prefill_row([slow, fast])
    assert row["ttft_s"] == pytest.approx(0.5) and row["prefill_tok_s"] == pytest.approx(1024.0)


def test_bandwidth_fraction_counts_one_weight_read_per_step():
    # 100 MB a step at 100 tok/s on 20 GB/s: half; 8 streams at 400 tok/s are 50 steps/s: a quarter
    assert host_record.bandwidth_fraction(100_000_000, 100.0, 1, 20.0) == pytest.approx(0.5)
    assert host_record.bandwidth_fraction(100_000_000, 400.0, 8, 20.0) == pytest.approx(0.25)


def test_host_record_names_the_cpu_and_its_tier_flags():
    assert host_record.cpu_model() not in ("", None)
    flags = host_record.cpu_flags()
    assert set(flags) <= set(host_record.TIER_FLAGS)
    have = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags")).split(":", 1)[1].split())
    assert ("avx2" in flags) == ("avx2" in have)


def test_pagedserve_isa_probe_reports_the_forced_tier():
    if "avx2" not in host_record.cpu_flags():
        pytest.skip("the host has no AVX2 tier to force")
    got = host_record.pagedserve_isa("avx2")
    assert "error" not in got
    if not got["tier"].startswith("unknown"):  # the ISA layer is present
        assert got["tier"] == "avx2"
        # every GGUF type's interleaved-rows kernel is the AVX2 one, none the portable fallback
        assert got["packed_kernels"]["grouped_isa_by_type"] == {q: "avx2" for q in
                                                                ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
        # and the dense bf16 kernels too: no AMX under a forced tier
        assert got["dense_kernels"] == {"grouped_gemv": "avx2", "gemm_bf16": "avx2", "gemm_fp32": "avx2"}
