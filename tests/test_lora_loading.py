"""Adapter loading and the adapter registry: bad PEFT folders are refused naming the field, file or tensor (the engine
keeps serving); a name loads once; unloading waits for its requests; evicted adapters come back from their folder
at admission without touching requests in flight; runtime loads (AsyncEngine) serve exactly as start-up ones and
only from the allowed folders."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from conftest import make_tiny_model
from lora_fixtures import (  # noqa: F401
    FOUR, MAX_NEW, AdapterSpec, generate, greedy, hf_base, make_adapter, start_modules, tiny, tiny_engine,
)
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.errors import AdapterInUseError, AdapterLoadError, AdapterNotFoundError, InvalidRequestError
from pagedserve.engine.lora.config import LoraConfig, LoraModule


@pytest.fixture(scope="module")
def engine(tiny):
    """Two adapters at start, room for two loaded, rank limit 16; tests leave no request in flight."""
    modules = start_modules(tiny)[:2]
    return tiny_engine(tiny, LoraConfig(modules=modules, max_loras=2, max_lora_rank=16, max_cpu_loras=2))


def _bad(tiny, name: str, **extra):
    spec = AdapterSpec(name, extra.pop("r", 4), tuple(extra.pop("targets", ("q_proj", "v_proj"))),
                       rank_pattern=extra.pop("rank_pattern", {}), seed=9)
    return make_adapter(tiny["base"], spec, tiny["root"] / f"bad-{name}", **extra)


@pytest.mark.parametrize("name, extra, field", [
    ("dora", {"use_dora": True}, "use_dora"),
    ("bias", {"bias": "lora_only"}, "bias"),
    ("save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("embed", {"targets": ["embed_tokens"]}, "target_modules"),
    ("rank", {"r": 32}, "r"),
    ("pattern-rank", {"rank_pattern": {"v_proj": 64}}, "rank_pattern.v_proj"),
])
def test_unsupported_peft_options_are_refused_by_name(tiny, engine, name, extra, field):
    folder = _bad(tiny, name, **extra)
    with pytest.raises(AdapterLoadError) as info:
        engine.load_adapter(LoraModule(name, str(folder)))
    assert info.value.field == field
    assert name not in {a.name for a in engine.adapters()}


def test_missing_and_pickled_files_are_named(tiny, engine):
    good = tiny["dirs"]["qv4"]
    cases = {}
    for missing in ("adapter_config.json", "adapter_model.safetensors"):
        folder = shutil.copytree(good, tiny["root"] / f"no-{missing}")
        (folder / missing).unlink()
        cases[folder] = missing
    pickled = tiny["root"] / "pickled"
    from peft import PeftModel
    PeftModel.from_pretrained(hf_base(tiny["path"]), str(good)).save_pretrained(str(pickled), safe_serialization=False)
    assert (pickled / "adapter_model.bin").is_file() and not (pickled / "adapter_model.safetensors").exists()
    cases[pickled] = "adapter_model.safetensors"
    cases[tiny["root"] / "nowhere"] = "lora_path"
    for folder, field in cases.items():
        with pytest.raises(AdapterLoadError) as info:
            engine.load_adapter(LoraModule("x", str(folder)))
        assert info.value.field == field, folder
    with pytest.raises(AdapterLoadError, match="adapter_model.bin"):
        engine.load_adapter(LoraModule("x", str(pickled)))


def test_shapes_of_another_model_are_refused_naming_the_tensor(tiny, engine, tmp_path):
    other = hf_base(make_tiny_model(tmp_path / "other", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1))
    folder = make_adapter(other, AdapterSpec("other", 4, ("q_proj",)), tmp_path / "adapter")
    with pytest.raises(AdapterLoadError) as info:
        engine.load_adapter(LoraModule("other", str(folder)))
    assert info.value.field == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config = json.loads((tiny["dirs"]["qv4"] / "adapter_config.json").read_text())
    assert config["r"] == 4  # and the engine still serves its adapters:
    assert generate(engine, [("qv4", tiny["requests"][4][1])])["r0"] == [tiny["expected"][4]]


def test_load_unload_rules(tiny, engine):
    infos = {a.name: a for a in engine.adapters()}
    first = infos["full8"]
    assert first.adapter_id > 0 and first.rank == 8 and set(first.target_modules) == set(FOUR[0].targets)
    assert engine.load_adapter(LoraModule("full8", str(tiny["dirs"]["full8"]))) == first  # same folder: no-op
    with pytest.raises(AdapterLoadError) as info:
        engine.load_adapter(LoraModule("full8", str(tiny["dirs"]["qv4"])))
    assert info.value.field == "lora_name"
    with pytest.raises(AdapterNotFoundError) as info:
        engine.unload_adapter("nope")
    assert info.value.field == "lora_name"
    with pytest.raises(AdapterNotFoundError) as info:
        engine.add_request("x", [5, 6, 7], greedy(), adapter="nope")
    assert info.value.field == "adapter"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [5, 6, 7], greedy(), adapter=3)
    assert info.value.field == "adapter" and not engine.has_unfinished_requests()

    added = engine.load_adapter(LoraModule("late", str(tiny["dirs"]["mlp16-rs"])))
    assert added.adapter_id not in {a.adapter_id for a in infos.values()}
    engine.add_request("busy", tiny["requests"][0][1], greedy(), adapter="late")
    engine.step()
    with pytest.raises(AdapterInUseError):
        engine.unload_adapter("late")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_adapter("late")
    assert "late" not in {a.name for a in engine.adapters()}
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("y", [5, 6, 7], greedy(), adapter="late")


def test_eviction_reloads_at_admission_and_never_touches_requests_in_flight(tiny):
    engine = tiny_engine(tiny, LoraConfig(modules=start_modules(tiny), max_loras=1, max_cpu_loras=1))
    requests = tiny["requests"]
    full8 = [i for i, (name, _) in enumerate(requests) if name == "full8"][0]
    first = engine.admit_prompt(requests[full8][1], greedy(), "full8").adapter
    engine.submit("held", engine.admit_prompt(requests[full8][1], greedy(), "full8"))
    engine.step()
    others = [i for i, (name, _) in enumerate(requests) if name not in (None, "full8")]
    for i in others:  # each admission loads its adapter, evicting the one before
        engine.add_request(f"o{i}", requests[i][1], greedy(), adapter=requests[i][0])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
    assert outputs["held"] == tiny["expected"][full8]
    assert all(outputs[f"o{i}"] == tiny["expected"][i] for i in others)
    again = engine.admit_prompt(requests[full8][1], greedy(), "full8").adapter
    assert again is not first and again.adapter_id == first.adapter_id  # read again from its folder


def test_lora_off_refuses_adapters(tiny):
    engine = tiny_engine(tiny, None)
    with pytest.raises(AdapterNotFoundError) as info:
        engine.add_request("x", [5, 6, 7], greedy(), adapter="full8")
    assert info.value.field == "adapter"
    with pytest.raises(AdapterLoadError):
        engine.load_adapter(LoraModule("full8", str(tiny["dirs"]["full8"])))
    assert engine.adapters() == () and engine.stats().max_loras == 0


def test_runtime_load_serves_like_start_up_and_only_from_allowed_folders(tiny):
    lora = LoraConfig(max_loras=2, runtime_updates=True, allowed_dirs=(str(tiny["root"]),))
    config = tiny_engine(tiny, lora).config
    requests, expected = tiny["requests"], tiny["expected"]
    picks = [i for i, (name, _) in enumerate(requests) if name in (None, "patterned")]

    async def run():
        engine = AsyncEngine(config)
        await engine.start()
        try:
            with pytest.raises(AdapterLoadError) as info:
                await engine.load_adapter(LoraModule("outside", "/tmp"))
            assert info.value.field == "lora_path"

            async def one(i):
                out = None
                async for out in engine.generate(f"q{i}", requests[i][1], greedy(), adapter=requests[i][0]):
                    pass
                return list(out.outputs[0].token_ids)

            base_first = asyncio.ensure_future(one(picks[0]))  # in flight while the adapter loads
            info = await engine.load_adapter(LoraModule("patterned", str(tiny["dirs"]["patterned"])))
            assert info.name == "patterned" and engine.adapters() == (info,)
            results = [await base_first] + list(await asyncio.gather(*(one(i) for i in picks[1:])))
            await engine.unload_adapter("patterned")
            assert engine.adapters() == ()
            return results
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == [expected[i] for i in picks]


def test_adapter_stats_name_running_and_waiting_adapters(tiny):
    engine = tiny_engine(tiny, LoraConfig(modules=start_modules(tiny), max_loras=1, max_cpu_loras=4))
    for name in ("qv4", "full8", None, "qv4"):
        engine.add_request(f"s-{name}-{engine.stats().num_waiting}", [5, 6, 7, 8], greedy(2), adapter=name)
    engine.step()
    stats = engine.stats()
    assert stats.max_loras == 1 and stats.running_adapters == ("qv4",) and stats.waiting_adapters == ("full8",)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().running_adapters == () == engine.stats().waiting_adapters


def test_adapter_weights_fold_the_scale_into_b(tiny, engine):
    """rsLoRA divides alpha by sqrt(r); alpha_pattern / rank_pattern pick per-module values (as PEFT merges them)."""
    manager = engine.lora_manager
    for spec in (FOUR[2], FOUR[3]):
        weights = manager.read(LoraModule(spec.name, str(tiny["dirs"][spec.name])))
        merged = tiny["models"][spec.name]
        for index, slot in enumerate(manager.layout.slots):
            pair = weights.slots[index]
            delta = torch.zeros(slot.out_features, slot.in_features) if pair is None else (pair[0].T @ pair[1]).T
            base = torch.cat([tiny["base"].get_submodule(f"model.layers.{slot.layer}.{slot.owner}.{p}").weight
                              for p, _ in slot.parts])
            after = torch.cat([merged.get_submodule(f"model.layers.{slot.layer}.{slot.owner}.{p}").weight
                               for p, _ in slot.parts])
            torch.testing.assert_close(base + delta, after, rtol=1e-5, atol=1e-6)
