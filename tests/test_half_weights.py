"""16-bit weights under fp32 compute (engine/loading/dtype_plan.py): on a kernel tier without bf16 arithmetic
`--dtype auto` keeps a bf16/fp16 checkpoint's matrices in its dtype and computes in fp32. Widening bf16/fp16 to fp32
is exact, so the engine's greedy tokens equal transformers' fp32 ones, on every tier this host runs (each forced
with PAGEDSERVE_CPU_ISA in its own process: a process builds its kernels once). The kernels: the native GEMV with
x_fp32 against an fp64 reference of the unrounded activations (bound: a few fp32 ulps of sum |x_k w_k|, the
summation order being the only difference); the torch path's slice-at-a-time widening against one F.linear."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

import cpu_tiers
from conftest import hf_from_gguf, hf_greedy, make_tiny_model
from family_fixtures import write_group_quant
from gguf import GGMLQuantizationType
from gguf_fixtures import write_tiny_llama
from pagedserve.engine.host.cpu_features import tier_bf16_flags
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu.native import load_library
from pagedserve.quant.dense_layout import chunked_linear, group_rows_in_place
from pagedserve.quant.dense_native import call_native_linear, dense_native_linear

# Two prompts decode in the native step, the nine after them together on the torch path (more than 8 rows).
PROMPTS = [list(range(100, 140)), [5, 17, 300, 42], *([7 + i, 900 + i, 31] for i in range(9))]
MAX_TOKENS = 10

_ENGINE = """
import json, sys, torch
from pagedserve.engine import LLM, SamplingParams
from pagedserve.quant.linear import QuantLinear
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
prompts = json.loads(sys.argv[2])
for path in json.loads(sys.argv[1]):
    llm = LLM(path, kv_cache_memory=1 << 24, lm_head_quantization="none")
    e = llm.engine
    mats = {str(m.weight.dtype) for m in e.runner.model.modules()
            if isinstance(m, QuantLinear) and getattr(m, "weight", None) is not None}
    outs = llm.generate(prompts[:2], params) + llm.generate(prompts[2:], params)
    print(json.dumps({"path": path, "compute": str(e.loaded.dtype), "weights": str(e.loaded.weight_dtype),
                      "matrices": sorted(mats), "table": str(e.runner.model.model.embed_tokens.weight.dtype),
                      "native": e.runner.native_step is not None,
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
    del llm, e
"""


def _half_checkpoint(folder: Path, dtype: torch.dtype, tied: bool) -> Path:
    path = make_tiny_model(folder, initializer_range=0.1, tie_word_embeddings=tied)
    transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).save_pretrained(path)
    return path


def _engine_runs(paths: list[Path], tier: str) -> dict[Path, dict]:
    """One process per tier (the kernels are built once per process) loads and runs every checkpoint in turn."""
    env = {**os.environ, isa.ENV_VAR: tier}
    out = subprocess.run([sys.executable, "-P", "-c", _ENGINE, json.dumps([str(p) for p in paths]),
                          json.dumps(PROMPTS), str(MAX_TOKENS)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"path"')]
    return {Path(run.pop("path")): run for run in runs}


@dataclass(frozen=True)
class Checkpoints:
    """The avx2 tier's checkpoints, written once and run in one engine process (`runs`, by path); `quant_reference`
    holds the dequantized state transformers runs for each GPTQ/AWQ folder, on `plain`'s weights."""

    plain: Path
    half: dict[str, Path]
    quant_reference: dict[str, dict[str, torch.Tensor]]
    runs: dict[Path, dict]


@pytest.fixture(scope="module")
def avx2_checkpoints(tmp_path_factory) -> Checkpoints:
    if "avx2" not in isa.available_tiers():
        pytest.skip("this CPU has no avx2 tier")
    root = tmp_path_factory.mktemp("half-avx2")
    half = {"bf16": _half_checkpoint(root / "bf16", torch.bfloat16, tied=False),
            "fp16": _half_checkpoint(root / "fp16", torch.float16, tied=False),
            "bf16-tied": _half_checkpoint(root / "bf16-tied", torch.bfloat16, tied=True)}
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "blk.1.ffn_down")
    half["bf16-gguf"] = write_tiny_llama(root / "tiny-bf16.gguf", types={k: GGMLQuantizationType.BF16 for k in kinds})
    quant = {method: write_group_quant(half["bf16"], root / method, method) for method in ("gptq", "awq")}
    runs = _engine_runs([*half.values(), *(root / method for method in quant)], "avx2")
    return Checkpoints(half["bf16"], half, quant, runs)


def _check(got: dict, path: Path, tier: str, dtype: torch.dtype, hf=None) -> None:
    forced = None if tier == isa.NATIVE else isa.tier(tier)
    if tier_bf16_flags(forced):  # this tier multiplies bf16 natively: bf16 throughout (test_cpu_features.py)
        assert (got["compute"], got["weights"]) == ("torch.bfloat16", "None")
        return
    name = str(dtype)
    assert (got["compute"], got["weights"], got["matrices"], got["table"]) == ("torch.float32", name, [name], name)
    assert got["native"]
    hf = hf or transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert got["tokens"] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.ALL))
def test_bf16_checkpoint_computes_fp32_over_bf16_weights_on_every_tier(tmp_path, tier, request):
    if tier == "avx2":  # run with the tier's other checkpoints
        checkpoints = request.getfixturevalue("avx2_checkpoints")
        path, got = checkpoints.plain, checkpoints.runs[checkpoints.plain]
    else:
        path = _half_checkpoint(tmp_path, torch.bfloat16, tied=False)
        got = _engine_runs([path], tier)[path]
    _check(got, path, tier, torch.bfloat16)


@pytest.mark.parametrize("kind,dtype", [("fp16", torch.float16), ("bf16-tied", torch.bfloat16)])
def test_fp16_and_tied_checkpoints_on_the_avx2_tier(avx2_checkpoints, kind, dtype):
    path = avx2_checkpoints.half[kind]
    _check(avx2_checkpoints.runs[path], path, "avx2", dtype)


def test_an_all_bf16_gguf_is_a_bf16_checkpoint(avx2_checkpoints):
    """llama.cpp's bf16 files (matrices BF16, norms F32): the same plan, against transformers' own GGUF loader."""
    path = avx2_checkpoints.half["bf16-gguf"]
    _check(avx2_checkpoints.runs[path], path, "avx2", torch.bfloat16, hf=hf_from_gguf(path))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_keep_their_unquantized_layers_16_bit_on_the_avx2_tier(avx2_checkpoints, method):
    """The layers a GPTQ/AWQ checkpoint leaves unquantized (embedding, LM head) are held in its 16-bit dtype like a
    plain checkpoint's (in fp32 a SmolLM2 head alone read 113 MB a token instead of 57), and the greedy tokens are
    transformers' fp32 ones over the dequantized weights."""
    plain = avx2_checkpoints.plain
    got = avx2_checkpoints.runs[plain.parent / method]
    assert (got["compute"], got["weights"], got["matrices"], got["table"]) == \
        ("torch.float32", "torch.bfloat16", ["torch.bfloat16"], "torch.bfloat16")
    assert got["native"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    hf.load_state_dict({k: v.float() for k, v in avx2_checkpoints.quant_reference[method].items()}, strict=False)
    assert got["tokens"] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_gemv_reads_fp32_activations_unrounded(tier, dtype):
    lib = load_library(tier)
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(160, 576, generator=gen).to(dtype), torch.randn(160, generator=gen)
    layouts = [w]
    if dtype == torch.bfloat16 and lib.pagedserve_dense_grouped_isa() in (b"avx2", b"avx512"):
        grouped = w.clone()
        group_rows_in_place(grouped)
        layouts.append(grouped)
    for weight in layouts:
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, 576, generator=gen)
            got = call_native_linear(dense_native_linear(weight, bias, lib=lib, x_fp32=True), x).double()
            want = x.double() @ w.double().T + bias.double()
            bound = 4 * 576 * 2.0**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs())
            assert ((got - want).abs() <= bound).all(), f"{tier} rows {rows}"
            rounded = x.to(dtype).double() @ w.double().T + bias.double()
            assert not torch.allclose(got, rounded, rtol=0, atol=1e-6)  # x was not rounded to 16 bits first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_widens_a_slice_at_a_time_as_one_linear(dtype):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4096, 512, generator=gen).to(dtype)  # 8 MB in fp32: two slices
    bias = torch.randn(4096, generator=gen)
    x = torch.randn(37, 512, generator=gen)
    want = F.linear(x, w.float(), bias)
    torch.testing.assert_close(chunked_linear(x, w, bias), want, rtol=1e-6, atol=1e-5)
