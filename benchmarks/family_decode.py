"""One stream's decode speed and resident memory of a family at a real model's shape, beside the Llama of the same
shape, so a family is not silently slower (random bf16 weights: speed and memory do not depend on their values).

Default shape: Qwen3-0.6B's (hidden 1024, 28 layers, 16 query / 8 KV heads of 128, FFN 3072, 151,936-token tied
embedding). Each family runs in its own process, so its RSS is its own. Prints one JSON object and writes it
under benchmarks/results/ with the date; figures on a shared host are marked noisy.

    python benchmarks/family_decode.py --families qwen3 llama --new-tokens 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, eos_token_id=2, bos_token_id=1)
CONFIGS = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "llama": ("LlamaForCausalLM", "LlamaConfig"),
           "phi3": ("Phi3ForCausalLM", "Phi3Config")}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_random_folder(family: str, out: Path) -> Path:
    """config.json from the family's transformers config class, weights N(0, 0.02) in bf16 (norms 1) under the
    names transformers' model has (built on the meta device: nothing allocated)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from pagedserve.engine.loading.model_store import resolve_model

    arch, config_cls = CONFIGS[family]
    fields = dict(SHAPE)
    if family == "phi3":  # Phi-3 has no head_dim field: its heads are hidden / heads wide
        fields.pop("head_dim")
    config = getattr(transformers, config_cls)(**fields)
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in getattr(transformers, arch)(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in names.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights[name] = torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else \
            (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [arch]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    src = resolve_model(None).tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return out


def measure(family: str, prompt_len: int, new_tokens: int) -> dict:
    """In this process: build, load, one warm-up request, then one timed stream."""
    from pagedserve.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_folder(family, Path(tmp) / family)
        rss_before = _rss_mb()
        start = time.perf_counter()
        llm = LLM(str(folder), dtype="bfloat16")
        load_s = time.perf_counter() - start
    engine = llm.engine
    rss_loaded = _rss_mb()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = list(range(1000, 1000 + prompt_len))
    llm.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("timed", prompt, params)
    start, first, count = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            if first is None and count:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"family": family, "architecture": CONFIGS[family][0], "load_s": round(load_s, 2),
            "ttft_s": round(first - start, 3), "decode_tokens_per_s": round((count - 1) / (end - first), 2),
            "new_tokens": count, "native_step": engine.runner.native_step is not None,
            "rss_mb_loaded_minus_before": round(rss_loaded - rss_before, 1),
            "rss_mb_after_decode": round(_rss_mb(), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def host() -> dict:
    import torch

    from pagedserve.kernels.cpu import packed as cpu_packed

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "isa_tier": cpu_packed.group_grouped_isa(cpu_packed.build()),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["qwen3", "llama"], choices=sorted(CONFIGS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quiet-host", action="store_true", help="the host ran nothing else (else: noisy)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.prompt_len, args.new_tokens)))
        return
    runs = []
    for family in args.families:
        done = subprocess.run([sys.executable, __file__, "--child", family, "--prompt-len", str(args.prompt_len),
                               "--new-tokens", str(args.new_tokens)], check=True, capture_output=True, text=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"benchmark": "family_decode", "date": datetime.date.today().isoformat(), "shape": SHAPE,
              "dtype": "bfloat16", "prompt_len": args.prompt_len, "host": host(),
              "noisy": not args.quiet_host, "runs": runs}
    print(json.dumps(report, indent=1))
    out = args.out or Path(__file__).parent / "results" / (
        f"{report['date']}-family-decode{'-noisy' if report['noisy'] else ''}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
