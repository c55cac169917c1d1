"""LoRA adapters made by `peft` itself (random non-zero A and B, saved with save_pretrained as safetensors) and the
transformers + PeftModel references the engine's LoRA tests compare against."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, make_tiny_model
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora.config import LoraConfig, LoraModule
from pagedserve.engine.sampling_params import SamplingParams

MAX_NEW = 8
BLOCK = 16

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    targets: tuple[str, ...] = ALL_TARGETS
    alpha: float | None = None  # None: 2 r
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    seed: int = 0
    std: float = 0.08  # A and B entries: the delta is as large as the base's own weights, so outputs change


# Four adapters that differ in rank, targets (fused q/k/v partly, MLP only, one module) and scaling rules.
FOUR = (
    AdapterSpec("full8", 8, seed=1),
    AdapterSpec("qv4", 4, ("q_proj", "v_proj"), seed=2),
    AdapterSpec("mlp16-rs", 16, ("gate_proj", "up_proj", "down_proj", "o_proj"), alpha=8, use_rslora=True, seed=3),
    AdapterSpec("patterned", 8, ("q_proj", "k_proj", "up_proj"), rank_pattern={"k_proj": 4},
                alpha_pattern={"up_proj": 32}, seed=4),
)


def make_adapter(base: torch.nn.Module, spec: AdapterSpec, out_dir: Path, **extra) -> Path:
    """A PEFT LoRA folder for `base` (a transformers model, left untouched), random A and B drawn from spec.seed;
    `extra` goes to peft's LoraConfig as it is (for adapters pagedserve must refuse)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha if spec.alpha is not None else 2 * spec.r,
                        target_modules=list(spec.targets), use_rslora=spec.use_rslora,
                        rank_pattern=dict(spec.rank_pattern), alpha_pattern=dict(spec.alpha_pattern),
                        init_lora_weights=False, **extra)
    model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * spec.std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    assert (out_dir / "adapter_model.safetensors").is_file()
    return out_dir


def with_adapter(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """transformers + PeftModel read from the saved folder, merged into a copy of the base."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload().eval()


def hf_base(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def references(models: dict[str | None, torch.nn.Module], requests: list[tuple[str | None, list[int]]],
               max_new: int) -> list[list[int]]:
    """Greedy continuations of (adapter name or None, prompt ids) from the matching reference model."""
    return [hf_greedy(models[name], ids, max_new) for name, ids in requests]


def assert_greedy_within(model: torch.nn.Module, prompt: list[int], tokens: list[int], atol: float, label) -> None:
    """Each generated token is the reference's argmax after the engine's own prefix, wherever the reference's best
    two logits are further apart than 2 * atol (the agreement the base's own tests state)."""
    full = prompt + tokens
    with torch.inference_mode():
        logits = model(torch.tensor([full])).logits[0].float()
    for position in range(len(prompt) - 1, len(full) - 1):
        best = logits[position].topk(2)
        if (best.values[0] - best.values[1]).item() > 2 * atol:
            assert full[position + 1] == best.indices[0].item(), (label, position)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (fp32), the four peft adapters over it, their references and mixed requests."""
    root = tmp_path_factory.mktemp("lora")
    path = make_tiny_model(root / "base", num_hidden_layers=2)
    base = hf_base(path)
    dirs = {spec.name: make_adapter(base, spec, root / spec.name) for spec in FOUR}
    models = {None: base} | {name: with_adapter(base, d) for name, d in dirs.items()}
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 12, 21, 9, 30)]
    # The base and every adapter over prompt 0 (each must change its output), and each over one more prompt.
    requests = [(name, prompts[k]) for i, name in enumerate([None, *dirs]) for k in (0, i)]
    return dict(root=root, path=path, base=base, dirs=dirs, models=models, requests=requests,
                expected=references(models, requests, MAX_NEW))


def start_modules(tiny: dict) -> tuple[LoraModule, ...]:
    return tuple(LoraModule(name, str(d)) for name, d in tiny["dirs"].items())


def tiny_engine(tiny: dict, lora: LoraConfig | None, **fields) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny["path"]), dtype="float32", block_size=BLOCK, lora=lora, **fields))


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new, min_tokens=max_new)


def generate(engine: LLMEngine, requests, params: SamplingParams | None = None) -> dict[str, list[list[int]]]:
    """Runs (adapter, prompt ids) requests r0, r1, ... to the end; {id: token ids of each sample}."""
    for i, (adapter, ids) in enumerate(requests):
        engine.add_request(f"r{i}", ids, params or greedy(), adapter=adapter)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return outputs


def peft_greedy(base: torch.nn.Module, dirs: dict[str, Path], requests, max_new: int) -> list[list[int]]:
    """Greedy continuations from ONE PeftModel holding every adapter unmerged (switched per request; the base with
    the adapters disabled), for models too large to copy once per adapter."""
    from peft import PeftModel

    names = list(dirs)
    model = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs[names[0]]), adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    out = []
    for name, ids in requests:
        if name is None:
            with model.disable_adapter():
                out.append(hf_greedy(model, ids, max_new))
        else:
            model.set_adapter(name)
            out.append(hf_greedy(model, ids, max_new))
    return out
