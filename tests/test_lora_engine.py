"""Multi-LoRA serving against transformers + PEFT: four adapters made by peft (different ranks, targets, rsLoRA,
rank/alpha patterns) and the base in the same steps; greedy output of every request equals the PeftModel's token for
token, and each adapter visibly changes the output. Also under the adapter cap, chunked prefill with preemption,
n > 1 forks, an FP8 KV cache, the prefix cache (never shared across adapters) and its KV events."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_from_gguf, make_tiny_model
from gguf_fixtures import write_tiny_llama
from lora_fixtures import (  # noqa: F401  (tiny: the shared module fixture)
    BLOCK, FOUR, MAX_NEW, AdapterSpec, assert_greedy_within, generate, greedy, hf_base, make_adapter, peft_greedy,
    references, start_modules, tiny, tiny_engine, with_adapter,
)
from pagedserve.engine import LLM, LoRARequest
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.kv_events import BlockStored
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora.config import LoraConfig, LoraModule
from pagedserve.service.router.kv_events import EventBatch
from pagedserve.service.router.vllm_replies import kv_batch
from pagedserve.engine.sampling_params import SamplingParams
from quant_fixtures import dequantized_reference, fixture_dir


def _engine(tiny, max_loras: int = 4, **fields) -> LLMEngine:
    return tiny_engine(tiny, LoraConfig(modules=start_modules(tiny), max_loras=max_loras, max_lora_rank=16), **fields)


def _record_adapters_per_step(engine: LLMEngine, monkeypatch) -> list[set]:
    seen: list[set] = []
    schedule = engine.scheduler.schedule

    def observed():
        out = schedule()
        seen.append({item.seq.adapter_name for item in out.scheduled})
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", observed)
    return seen


def test_four_adapters_and_the_base_in_the_same_steps_match_peft(tiny, monkeypatch):
    engine = _engine(tiny, max_loras=4)
    seen = _record_adapters_per_step(engine, monkeypatch)
    outputs = generate(engine, tiny["requests"])
    for i, expected in enumerate(tiny["expected"]):
        assert outputs[f"r{i}"] == [expected], tiny["requests"][i][0]
    assert len(seen[0]) == 5, "all four adapters and the base run in the first step"
    base = tiny["expected"][0]
    unchanged = [name for (name, ids), toks in zip(tiny["requests"], tiny["expected"])
                 if name is not None and ids == tiny["requests"][0][1] and toks == base]
    assert not unchanged, f"these adapters did not change the greedy output: {unchanged}"
    stats = engine.stats()
    assert stats.max_loras == 4 and stats.running_adapters == () and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_vllms_offline_lora_request_loads_on_first_use_and_matches_peft(tiny):
    """vLLM's script: LLM(model, enable_lora=True).generate(prompts, params, lora_request=LoRARequest(...)), one
    request for all prompts or one per prompt (None: the base); an id reused for another adapter is refused."""
    llm = LLM(str(tiny["path"]), dtype="float32", block_size=BLOCK, enable_lora=True, max_loras=4, max_lora_rank=16)
    handles = {name: LoRARequest(name, i + 1, str(d)) for i, (name, d) in enumerate(tiny["dirs"].items())}
    names, prompts = zip(*tiny["requests"])
    outs = llm.generate(list(prompts), greedy(), lora_request=[None if n is None else handles[n] for n in names])
    assert [list(o.outputs[0].token_ids) for o in outs] == tiny["expected"]
    first = next(iter(handles))
    [again] = llm.generate([prompts[names.index(first)]], greedy(), lora_request=handles[first])
    assert list(again.outputs[0].token_ids) == tiny["expected"][names.index(first)]
    assert {a.name for a in llm.adapters()} == set(handles)
    with pytest.raises(ConfigError, match="lora_int_id: 1 already names"):
        llm.generate([prompts[0]], greedy(), lora_request=LoRARequest("other", 1, str(tiny["dirs"][first])))
    with pytest.raises(ConfigError, match="not both"):
        llm.generate([prompts[0]], greedy(), adapter=first, lora_request=handles[first])
    with pytest.raises(ConfigError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


def test_the_adapter_cap_holds_per_step_and_everyone_finishes(tiny, monkeypatch):
    engine = _engine(tiny, max_loras=2)
    seen = _record_adapters_per_step(engine, monkeypatch)
    outputs = generate(engine, tiny["requests"])
    assert [outputs[f"r{i}"][0] for i in range(len(tiny["requests"]))] == tiny["expected"]
    assert max(len(s - {None}) for s in seen) == 2
    assert all(len(s - {None}) <= 2 for s in seen)


def test_chunked_prefill_and_preemption_with_adapters(tiny):
    # 21-token steps split the 30-token prompt and the prompts that share a step with others; 32 new tokens each in
    # a cache of 5 blocks: requests admitted with one block to spare each outgrow it, so some are preempted as they
    # decode (8 new tokens grow no request by more than the block it keeps: nobody would be).
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    engine = _engine(tiny, max_loras=3, max_num_batched_tokens=21, kv_cache_memory=5 * block_bytes)
    outputs = generate(engine, tiny["requests"], greedy(32))
    expected = references(tiny["models"], tiny["requests"], 32)
    assert [outputs[f"r{i}"][0] for i in range(len(tiny["requests"]))] == expected
    assert engine.stats().num_preemptions > 0


def test_forks_of_an_adapter_request_keep_the_adapter(tiny):
    engine = _engine(tiny)
    adapter, ids = tiny["requests"][2]
    params = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=MAX_NEW, min_tokens=MAX_NEW, seed=3)
    outputs = generate(engine, [(adapter, ids)], params)
    assert outputs["r0"] == [tiny["expected"][2]] * 2


def test_fp8_kv_cache_with_adapters(tiny):
    engine = _engine(tiny, kv_cache_dtype="fp8_e4m3")
    outputs = generate(engine, tiny["requests"])
    for i, (adapter, ids) in enumerate(tiny["requests"]):
        # test_quant_engine's stated FP8 agreement on logits (3 mantissa bits of K and V).
        assert_greedy_within(tiny["models"][adapter], ids, outputs[f"r{i}"][0], 0.3, (adapter, i))


def test_prefix_cache_is_never_shared_across_adapters(tiny):
    engine = _engine(tiny)
    engine.block_manager.record_events()
    prompt = tiny["requests"][-1][1]  # 30 tokens: one full block to share
    runs = [(None, prompt), ("full8", prompt), (None, prompt), ("full8", prompt), ("qv4", prompt)]
    cached = []
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for i, (adapter, ids) in enumerate(runs):
        engine.add_request(f"p{i}", ids, params, adapter=adapter)
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        cached.append(final.metrics.num_cached_tokens)
        assert list(final.outputs[0].token_ids) == references(tiny["models"], [(adapter, ids)], MAX_NEW)[0]
    assert cached == [0, 0, BLOCK, BLOCK, 0]
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    ids = {info.name: info.adapter_id for info in engine.adapters()}
    assert {(e.lora_id, e.lora_name) for e in stored} == {(None, None), (ids["full8"], "full8"), (ids["qv4"], "qv4")}
    firsts = [e for e in stored if e.parent_hash is None]  # same tokens, three keys: base, full8, qv4
    assert len(firsts) == 3 and len({e.block_hash for e in firsts}) == 3
    # The router protocol's fields (KvBlock.lora_id, KvBlocksStored.lora_name), as the replica publishes them.
    reply = kv_batch(EventBatch(1, 0.0, tuple(stored), first_event_id=1))
    published = [(e.stored.blocks[0].lora_id if e.stored.blocks[0].HasField("lora_id") else None,
                  e.stored.lora_name if e.stored.HasField("lora_name") else None) for e in reply.events]
    assert published == [(e.lora_id, e.lora_name) for e in stored]


def _other_base_case(path, reference, root, atol: float, **fields):
    """Two adapters and the base over another base (quantized: its reference is the dequantized transformers model)
    with the peft adapters merged into the reference."""
    dirs = {spec.name: make_adapter(reference, spec, root / spec.name) for spec in (FOUR[0], FOUR[3])}
    models = {None: reference} | {name: with_adapter(reference, d) for name, d in dirs.items()}
    vocab = reference.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 19)]
    requests = [(name, p) for name in models for p in prompts]
    lora = LoraConfig(modules=tuple(LoraModule(n, str(d)) for n, d in dirs.items()), max_loras=2)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, lora=lora,
                                    max_num_batched_tokens=11, **fields))
    outputs = generate(engine, requests)
    for i, (name, ids) in enumerate(requests):
        assert_greedy_within(models[name], ids, outputs[f"r{i}"][0], atol, (name, i))
    for name in dirs:
        with torch.inference_mode():
            changed = (models[name](torch.tensor([prompts[1]])).logits - reference(torch.tensor([prompts[1]])).logits)
        assert changed.abs().max() > 0.1, f"{name} must change the logits"
    return engine


def test_gptq_base_with_adapters(tmp_path):
    name = "gptq_4bit_g128_actorder_sym"
    # test_quant_engine's fp32 agreement: the same dequantized weights summed in another order.
    _other_base_case(fixture_dir(name), dequantized_reference(name), tmp_path, atol=1e-4)


def test_gemma3_base_with_adapters(tmp_path):
    path = make_tiny_model(tmp_path / "gemma", "Gemma3ForCausalLM", head_dim=16)
    _other_base_case(path, hf_base(path), tmp_path, atol=1e-4)


def test_gguf_base_with_adapters(tmp_path):
    """The GGUF's own blocks (packed kernels) with the adapters' deltas on top; the dequantized path is the dense one."""
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    engine = _other_base_case(path, hf_from_gguf(path), tmp_path, atol=1e-3, gguf_weights="packed")
    assert engine.describe().quantization.startswith("gguf (packed")


def test_smollm2_with_adapters_matches_peft(default_model, hf_reference, tmp_path):
    """The default model (its Q4_1 GGUF, dequantized to fp32 like transformers' own loader) with two peft adapters
    and the base in the same steps, against one unmerged PeftModel."""
    model, tok = hf_reference
    specs = (AdapterSpec("smol-a", 16, seed=21, std=0.04), AdapterSpec("smol-b", 8, ("q_proj", "v_proj", "down_proj"),
                                                                      seed=22, std=0.04))
    dirs = {spec.name: make_adapter(model, spec, tmp_path / spec.name) for spec in specs}
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    requests = [(name, ids) for name in (None, *dirs) for ids in prompts]
    expected = peft_greedy(model, dirs, requests, MAX_NEW)
    lora = LoraConfig(modules=tuple(LoraModule(n, str(d)) for n, d in dirs.items()), max_loras=2)
    engine = LLMEngine(EngineConfig(model=str(default_model.weights), dtype="float32", lora=lora))
    outputs = generate(engine, requests)
    assert [outputs[f"r{i}"][0] for i in range(len(requests))] == expected
    n = len(prompts)
    for j, name in enumerate(dirs, start=1):
        assert any(expected[j * n + k] != expected[k] for k in range(n)), f"{name} must change the output"


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_adds_each_adapter_to_its_own_rows(dtype, native):
    """One wrapped linear over base rows and two adapters' spans: each span gets exactly its adapter's x A^T B^T
    (float32 LoRA matrices over a bf16 base included), the base rows nothing; the native kernel and the torch path."""
    from pagedserve.engine.lora.config import AdapterInfo
    from pagedserve.engine.lora.layers import LoraLinear, StepAdapters, lora_dtype
    from pagedserve.engine.lora.weights import LoraWeights
    from pagedserve.kernels.cpu.native import available
    from pagedserve.quant.linear import QuantLinear
    from pagedserve.quant.unquantized import UnquantizedLinearMethod

    assert available(), "the native kernels build on every supported host"
    g = torch.Generator().manual_seed(0)
    base = QuantLinear(32, 48, False, UnquantizedLinearMethod(), dtype)
    base.weight.data.copy_(torch.randn(48, 32, generator=g))
    plain = base.weight.detach().float().clone()
    base.method.process_weights_after_loading(base)
    lora_type = lora_dtype(dtype, torch.device("cpu"))
    # a0: one dense block; a1: a fused layer's block-diagonal B^T (ranks 0-2 -> outputs 0-32, ranks 2-6 -> 32-48)
    block_diag = torch.randn(6, 48, generator=g, dtype=lora_type)
    block_diag[:2, 32:] = 0
    block_diag[2:, :32] = 0
    adapters = [
        LoraWeights(AdapterInfo("a0", 1, "/x", 4, ()), ((torch.randn(4, 32, generator=g, dtype=lora_type),
                                                        torch.randn(4, 48, generator=g, dtype=lora_type)),)),
        LoraWeights(AdapterInfo("a1", 2, "/x", 6, ()), ((torch.randn(6, 32, generator=g, dtype=lora_type), block_diag,
                                                        ((0, 2, 0, 32), (2, 6, 32, 48))),)),
    ]
    step = StepAdapters(native=native)
    layer = LoraLinear(base, 0, step)
    x = torch.randn(21, 32, generator=g).to(dtype)
    step.set_spans([(None, 0, 2), (adapters[0], 2, 3), (adapters[0], 3, 10), (adapters[1], 10, 21)])
    assert [(a.name, s, e) for a, s, e in step.groups] == [("a0", 2, 10), ("a1", 10, 21)]
    assert (step.refs is not None) == native
    with torch.inference_mode():
        got = layer(x).float()
    expected = x.float() @ plain.T
    for adapter, start, end in step.groups:
        a, b_t = adapter.slots[0][:2]
        expected[start:end] += x[start:end].float() @ a.float().T @ b_t.float()
    tol = dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.15)
    torch.testing.assert_close(got, expected, **tol)
    step.clear()
    torch.testing.assert_close(layer(x).float(), (x.float() @ plain.T), **tol)
