"""The default model served from its packed Q4_1/Q8_0 blocks against the same file dequantized at load.

Teacher-forced over a held-out text (this repository's architecture document, which no weight has seen): in fp32
compute the packed path must give the dequantized path's function (top-1 agreement >= 99%, perplexity within
0.5%; measured: identical). In bf16 the dequantized path rounds every weight to bf16 and the packed one does not,
so the two differ by bf16 noise (measured 96.7% top-1 agreement on this high-perplexity text; the dequantized
bf16 path itself agrees 97.5% with fp32): there the packed path's perplexity must be within 0.5% of the
dequantized one and its agreement with the fp32 reference no more than one point below the dequantized bf16
path's. Greedy continuations of real prompts (bf16) are counted and printed; most must be identical. The packed
runs force the packed kernel onto every row (as decode computes each row), not only a decode step's few rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.llm import LLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError
from pagedserve.engine.loading.model_loader import load_model, packed_gguf_types
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.quant import gguf as gguf_method
from pagedserve.quant.dense_layout import grouped_isa as dense_grouped_isa
from pagedserve.quant.dense_layout import row_group
from pagedserve.quant.native_linear import GROUPED_NATIVE_MAX_BATCH
from quant_fixtures import full_logits

HELD_OUT = Path(__file__).parent.parent / "docs" / "architecture.md"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "To make a cup of tea, first", "Water boils at", "import numpy as np\n", "The largest planet in the"]


def _teacher_forced(loaded, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(logits [B, T, V], perplexity of ids' next tokens)."""
    logits = full_logits(loaded, ids).float().view(*ids.shape, -1)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return logits, nll.exp().item()


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def engines():
    return {mode: LLM(dtype="bfloat16", gguf_weights=mode, kv_cache_memory=64 << 20) for mode in ("packed", "dequantized")}


@pytest.fixture(scope="module")
def held_out(engines):
    return torch.tensor(engines["packed"].tokenizer.encode(HELD_OUT.read_text())[:512]).view(2, 256)


def test_packed_engine_keeps_the_files_blocks(engines):
    loaded = engines["packed"].engine.loaded
    assert loaded.quant.describe() == "gguf (packed Q4_1, Q8_0)"
    head = loaded.model.lm_head
    assert head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()  # tied: one copy of Q8_0
    assert all(p.dtype == torch.uint8 for n, p in loaded.model.named_parameters() if n.endswith("proj.weight"))
    assert engines["dequantized"].engine.loaded.quant.describe() == "none"


def test_native_step_batch_limit_follows_the_kernels(engines):
    """Grouped Q4_1/Q8_0 blocks keep the native step up to 8 sequences in AVX-512 builds, 12 in AVX2 ones, 16 with
    AVX512-VNNI; dequantized bf16 weights up to 8 where they are regrouped for the dense GEMV, else 2."""
    packed = engines["packed"].engine.loaded.model.lm_head.packed
    isa = cpu_packed.grouped_isa(packed.lib)
    grouped = isa in cpu_packed.FAST_GROUPED_ISAS
    assert packed.row_group == (cpu_packed.GROUP_ROWS if grouped else 0)
    limit = {"avx512_vnni": 16, "avx512": 8, "avx2_vnni": 8, "avx2": 12}.get(isa, 2)
    assert engines["packed"].engine.runner.native_step.capacity.max_batch == limit
    dequantized = engines["dequantized"].engine
    proj = dequantized.loaded.model.model.layers[0].mlp.down_proj.weight
    regrouped = row_group(proj) != 0
    assert regrouped == (proj.dtype == torch.bfloat16 and dense_grouped_isa() in ("avx512", "avx2"))
    assert dequantized.runner.native_step.capacity.max_batch == (GROUPED_NATIVE_MAX_BATCH if regrouped else 2)


def test_teacher_forced_fp32_is_the_dequantized_function(default_model, held_out, monkeypatch):
    monkeypatch.setattr(gguf_method, "PACKED_MAX_ROWS", 1 << 30)
    cpu = torch.device("cpu")
    packed, ppl_packed = _teacher_forced(load_model(default_model.weights, torch.float32, None, cpu, "packed"), held_out)
    dense, ppl_dense = _teacher_forced(load_model(default_model.weights, torch.float32, None, cpu), held_out)
    agreement = _agreement(packed, dense)
    print(f"fp32: top-1 agreement {agreement:.4f}; perplexity packed {ppl_packed:.4f} dequantized {ppl_dense:.4f}")
    assert agreement >= 0.99 and abs(ppl_packed / ppl_dense - 1) <= 0.005
    TEACHER_FORCED_FP32.append(dense)


TEACHER_FORCED_FP32: list[torch.Tensor] = []  # the fp32 reference logits, reused by the bf16 test


def test_teacher_forced_bf16(engines, held_out, monkeypatch, default_model):
    monkeypatch.setattr(gguf_method, "PACKED_MAX_ROWS", 1 << 30)
    if not TEACHER_FORCED_FP32:
        TEACHER_FORCED_FP32.append(_teacher_forced(load_model(default_model.weights, torch.float32, None,
                                                              torch.device("cpu")), held_out)[0])
    reference = TEACHER_FORCED_FP32[0]
    (packed, ppl_packed), (dense, ppl_dense) = (_teacher_forced(engines[m].engine.loaded, held_out)
                                                for m in ("packed", "dequantized"))
    vs_ref = {"packed": _agreement(packed, reference), "dequantized": _agreement(dense, reference)}
    print(f"bf16: top-1 agreement packed/dequantized {_agreement(packed, dense):.4f}, with fp32 {vs_ref}; "
          f"perplexity packed {ppl_packed:.4f} dequantized {ppl_dense:.4f}")
    assert abs(ppl_packed / ppl_dense - 1) <= 0.005
    assert vs_ref["packed"] >= vs_ref["dequantized"] - 0.01


def test_greedy_continuations_mostly_identical(engines):
    """Two prompts at a time, so both engines decode through the native step (fp32 hidden state) and differ only
    by their weights; a batch of 8 would put the dequantized engine's steps on the bf16 torch path, whose own
    rounding moves more continuations (measured: it matches the fp32 reference on 3 of 8, the packed path on 5)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {mode: [o.outputs[0].token_ids for i in range(0, len(PROMPTS), 2)
                   for o in llm.generate(PROMPTS[i:i + 2], params)] for mode, llm in engines.items()}
    same = sum(list(a) == list(b) for a, b in zip(outs["packed"], outs["dequantized"]))
    print(f"greedy continuations identical: {same}/{len(PROMPTS)}")
    assert same >= len(PROMPTS) // 2 + 1


def test_which_gguf_files_stay_packed():
    cpu = torch.device("cpu")
    assert packed_gguf_types("auto", None, cpu, torch.bfloat16) == frozenset(cpu_packed.FORMATS)
    assert packed_gguf_types("auto", None, cpu, torch.float32) == frozenset()  # fp32: the reference path
    # --dtype auto computing in fp32 (a CPU without bf16 arithmetic): decode still reads the blocks
    assert packed_gguf_types("auto", None, cpu, torch.float32, dtype_auto=True) == frozenset(cpu_packed.FORMATS)
    assert packed_gguf_types("dequantized", None, cpu, torch.float32, dtype_auto=True) == frozenset()
    assert packed_gguf_types("auto", "gguf", cpu, torch.float32) == frozenset(cpu_packed.FORMATS)
    assert packed_gguf_types("packed", None, cpu, torch.float32) == frozenset(cpu_packed.FORMATS)
    assert packed_gguf_types("dequantized", None, cpu, torch.bfloat16) == frozenset()
    assert packed_gguf_types("auto", "none", cpu, torch.bfloat16) == frozenset()
    assert packed_gguf_types("auto", None, torch.device("cuda"), torch.bfloat16) == frozenset()
    with pytest.raises(ModelLoadError, match="gguf_weights: packed needs the CPU"):
        packed_gguf_types("packed", "none", cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="gguf_weights.*unknown 'int4'"):
        EngineConfig(gguf_weights="int4")
    with pytest.raises(ConfigError, match="gguf_weights.*CPU only"):
        EngineConfig(gguf_weights="packed", device="cuda")
