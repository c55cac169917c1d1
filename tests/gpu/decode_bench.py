"""Decode speed of a Llama-3.2-1B-shaped random model as fp16, GPTQ 4-bit and AWQ 4-bit, with CUDA graphs on and
off: numbers only, printed and written as JSON (docs/gpu.md).

    python3 tests/gpu/decode_bench.py --out decode.json [--dry-run] [--layers N]

The model is made here, on the device (nothing large travels): Llama-3.2-1B's widths (hidden 2048, intermediate
8192, 32 heads, 8 KV heads, head dim 64, vocabulary 128256, tied embeddings), --layers layers (default 16, the real
depth), random fp16 weights (std 0.02), then each linear rounded to the nearest 4-bit level (RTN,
benchmarks/quant_tools/rtn.py) into a GPTQ checkpoint (group 128, symmetric, desc_act false, v1 zeros) and an AWQ
GEMM one (group 128, zero points); embedding, norms and the tied LM head stay fp16 in all three, as in the published
4-bit exports. Each (weights, mode) pair is one engine: CUDA graphs, graphs with async scheduling, or
enforce_eager (max_num_seqs 16, so graphs of 1, 2, 4, 8, 16); per batch size (1 and 16) the prompts (128 random
tokens each) are prefilled in one step and
the decode steps after it timed until all end (128 new tokens, EOS ignored): decode tokens/s and inter-token
latency. `summary` holds the ratios: GPTQ/fp16 and AWQ/fp16 tokens/s (target >= 1.8) per mode, graphs on/off, and
async scheduling on/off (both with graphs).
--dry-run: CPU, tiny widths, few tokens: the same fields, meaningless numbers (graphs have no effect on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kernel_timeline
import step_split
import tiny_models
import triton_interpreter_patch  # from tests/, which tiny_models puts on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "quant_tools"))
from rtn import quantization_config, quantized_tensors  # noqa: E402

TARGET_4BIT_VS_FP16 = 1.8
GROUP = 128
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True, slots=True)
class Scale:
    device: str
    dtype: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    split_steps: int  # decode steps of the host/device split and of the profile (step_split.py), batch 1
    kernel_steps: int  # decode steps recorded by torch.profiler (kernel_timeline.py), batch 1


GPU = Scale("cuda", "float16", 2048, 8192, 32, 8, 64, 128256, 16, 128, 128, (1, 16), 30, 5)
DRY = Scale("cpu", "bfloat16", 256, 512, 4, 2, 64, 256, 2, 8, 4, (1, 2), 4, 2)
KINDS = ("fp16", "gptq", "awq")
MAX_NUM_SEQS = 16


def hf_config(scale: Scale) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": scale.vocab,
            "hidden_size": scale.hidden, "intermediate_size": scale.intermediate,
            "num_hidden_layers": scale.layers, "num_attention_heads": scale.heads,
            "num_key_value_heads": scale.kv_heads, "head_dim": scale.head_dim, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}


def random_weights(scale: Scale) -> dict[str, torch.Tensor]:
    """The fp16 model's tensors, made on the device."""
    gen = torch.Generator(device=scale.device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=scale.device) * 0.02).half()

    q_out, kv_out = scale.heads * scale.head_dim, scale.kv_heads * scale.head_dim
    shapes = {"q_proj": (q_out, scale.hidden), "k_proj": (kv_out, scale.hidden), "v_proj": (kv_out, scale.hidden),
              "o_proj": (scale.hidden, q_out), "gate_proj": (scale.intermediate, scale.hidden),
              "up_proj": (scale.intermediate, scale.hidden), "down_proj": (scale.hidden, scale.intermediate)}
    def ones() -> torch.Tensor:  # a tensor each: safetensors refuses shared storage
        return torch.ones(scale.hidden, dtype=torch.float16, device=scale.device)

    tensors = {"model.embed_tokens.weight": rand(scale.vocab, scale.hidden), "model.norm.weight": ones()}
    for i in range(scale.layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = ones()
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = ones()
        for owner, names in LINEARS.items():
            for name in names:
                tensors[f"model.layers.{i}.{owner}.{name}.weight"] = rand(*shapes[name])
    return tensors


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in tiny_models.TOKENIZER_FILES:
        (folder / name).write_bytes((tiny_models.TOKENIZER_SOURCE / name).read_bytes())
    return folder


def build_checkpoints(scale: Scale, root: Path) -> dict[str, Path]:
    """fp16, GPTQ and AWQ folders of the same random model (the 4-bit ones rounded from the fp16 weights)."""
    dense = random_weights(scale)
    config = hf_config(scale)
    folders = {"fp16": write_checkpoint(root / "fp16", dense, config)}
    for kind in ("gptq", "awq"):
        tensors = {}
        for name, tensor in dense.items():
            if name.endswith("_proj.weight"):
                tensors.update(quantized_tensors(name.removesuffix(".weight"), tensor, kind, GROUP))
            else:
                tensors[name] = tensor
        folders[kind] = write_checkpoint(root / kind, tensors, {**config,
                                                                "quantization_config": quantization_config(kind, GROUP)})
        del tensors
    del dense
    return folders


def decode_run(llm, scale: Scale, batch: int, tag: str) -> dict:
    """`batch` prompts prefilled in one step, then every decode step timed until they all end."""
    from pagedserve.engine import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=scale.new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, tiny_models.VOCAB, (scale.prompt_len,), generator=gen).tolist()
        engine.add_request(f"{tag}-{batch}-{i}", prompt, params)
    engine.step()  # the prompts, and each one's first token
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests() and steps < 10 * scale.new_tokens:
        tokens += sum(len(o.outputs[0].new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return {"batch": batch, "decode_steps": steps, "decode_tokens": tokens, "seconds": round(elapsed, 4),
            "tokens_per_s": round(tokens / elapsed, 1), "itl_ms": round(elapsed / max(steps, 1) * 1e3, 3)}


# How each row's engine steps: CUDA graphs, graphs with async scheduling (the next step launched before the
# previous one's tokens are read), or eagerly.
MODES = {"graphs": {}, "async": {"async_scheduling": True}, "eager": {"enforce_eager": True}}


def measure(folder: Path, kind: str, mode: str, scale: Scale) -> dict:
    from pagedserve.engine import LLM, SamplingParams
    from quant_fixtures import quant_linears

    start = time.perf_counter()
    llm = LLM(str(folder), device=scale.device, dtype=scale.dtype, kv_cache_memory=1 << 29,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=4096, max_model_len=1024, **MODES[mode])
    load_s = time.perf_counter() - start
    runner = llm.engine.runner
    warm = [[5] * scale.prompt_len] * max(scale.batches)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # compiles the prefill path
    stats = runner.cuda_graphs.stats if runner.cuda_graphs is not None else None
    kernels = sorted({type(m.qkernel).name for m in quant_linears(runner.model).values()})
    row = {"weights": kind, "graphs": mode != "eager", "mode": mode, "load_s": round(load_s, 2),
           "attention": type(runner.attn_impl).__name__,
           "quant_kernels": kernels, "capture_s": None if stats is None else round(stats.seconds, 3),
           "capture_mib": None if stats is None else round(stats.memory_bytes / 2**20, 1),
           "capture_error": None if runner.cuda_graphs is None else runner.cuda_graphs.error,
           "runs": [decode_run(llm, scale, batch, f"{kind}-{mode}") for batch in scale.batches]}
    if mode == "async":
        row["lookahead_steps"] = llm.engine.num_lookahead_steps
    if mode == "graphs":  # where a graphed step's time goes, after the timed runs (the hooks and profiler cost a little)
        gen = torch.Generator().manual_seed(7)
        prompt = [torch.randint(3, tiny_models.VOCAB, (scale.prompt_len,), generator=gen).tolist()]
        row["host_split_batch1"] = step_split.split_run(llm.engine, prompt, scale.split_steps, f"{kind}-split")
        print(f"{kind} graphs batch 1 split: {json.dumps(row['host_split_batch1'])}", flush=True)
        if kind in ("fp16", "gptq"):
            row["host_profile_batch1"] = step_split.profile_run(llm.engine, prompt, scale.split_steps,
                                                                f"{kind}-profile", f"{kind}, graphs, batch 1")
            row["kernels_batch1"] = kernel_timeline.kernel_run(llm.engine, prompt, scale.kernel_steps,
                                                               f"{kind}-kernels", f"{kind}, graphs, batch 1")
    del llm, runner
    gc.collect()
    if scale.device == "cuda":
        torch.cuda.empty_cache()
    return row


def summary(rows: list[dict], scale: Scale) -> dict:
    speed = {(r["weights"], r["mode"], run["batch"]): run["tokens_per_s"] for r in rows for run in r["runs"]}
    itl = {(r["weights"], r["mode"], run["batch"]): run["itl_ms"] for r in rows for run in r["runs"]}

    def ratio(a: tuple, b: tuple) -> float | None:
        return round(speed[a] / speed[b], 3) if a in speed and b in speed else None

    out = {"target_4bit_vs_fp16": TARGET_4BIT_VS_FP16, "batches": list(scale.batches), "layers": scale.layers}
    for kind in ("gptq", "awq"):
        out[f"{kind}_vs_fp16"] = {f"{mode}_batch{b}": ratio((kind, mode, b), ("fp16", mode, b))
                                  for mode in MODES for b in scale.batches}
    out["graphs_vs_eager"] = {f"{kind}_batch{b}": ratio((kind, "graphs", b), (kind, "eager", b))
                              for kind in KINDS for b in scale.batches}
    out["async_vs_graphs"] = {f"{kind}_batch{b}": ratio((kind, "async", b), (kind, "graphs", b))
                              for kind in KINDS for b in scale.batches}
    out["tokens_per_s"] = {f"{k}_{mode}_batch{b}": v for (k, mode, b), v in speed.items()}
    out["host_split_batch1"] = {
        f"{r['weights']}_graphs": {k: r["host_split_batch1"][k] for k in ("step_ms", "host_ms_per_step",
                                                                          "device_ms_per_step")}
        for r in rows if "host_split_batch1" in r}
    out["fp16_itl_ms_batch1"] = {mode: itl.get(("fp16", mode, 1)) for mode in MODES}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 16 on the GPU, Llama-3.2-1B's)")
    args = parser.parse_args()
    triton_interpreter_patch.install()  # the dry run's interpreter only: a GPU run compiles, and this does nothing
    scale = DRY if args.dry_run else GPU
    if args.layers:
        scale = Scale(**{**asdict(scale), "layers": args.layers})
    if scale.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    result: dict = {"device": scale.device, "scale": asdict(scale), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folders = build_checkpoints(scale, Path(tmp))
        result["build_s"] = round(time.perf_counter() - start, 1)
        print(f"checkpoints built in {result['build_s']} s", flush=True)
        # The ratios the issue asks for first, so a budget that runs out still leaves them.
        for mode in MODES:
            for kind in KINDS:
                result["rows"].append(measure(folders[kind], kind, mode, scale))
            result["summary"] = summary(result["rows"], scale)
            args.out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result["rows"][-1]), flush=True)
    print(json.dumps(result["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
