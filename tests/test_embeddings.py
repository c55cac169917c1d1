"""Embeddings (the pooling runner, engine/pooling.py): each vector equals transformers' final hidden states of the
same fp32 model, pooled (last token, mean, first token) and normalized as sentence-transformers' modules say, however
the prefill is chunked, cached or preempted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_fixtures import make_family_model
from pagedserve.engine import LLM, PoolingParams, SamplingParams
from pagedserve.engine.errors import ConfigError, InvalidRequestError, ModelLoadError, UnsupportedTaskError

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Les Misérables est un roman de Victor Hugo, publié en 1862.", "Hi"]
TOLERANCE = 1e-4  # fp32 both sides, normalized vectors; the kernels sum in other orders than transformers' (~1e-6)


def pooled(hidden: torch.Tensor, kind: str, normalize: bool = True, dims: int | None = None) -> torch.Tensor:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]
    vector = vector[:dims] if dims else vector
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(embedding, reference: torch.Tensor) -> None:
    got = torch.tensor(embedding)
    assert got.shape == reference.shape
    assert (got - reference).abs().max().item() < TOLERANCE * max(1.0, reference.abs().max().item())


@pytest.fixture(scope="module")
def smollm_hidden(hf_reference):
    """transformers' final hidden states (after the last norm) for TEXTS and a 300-token prompt."""
    model, tok = hf_reference
    ids = [tok.encode(t) for t in TEXTS]
    ids.append([(i * 7919) % 40000 + 50 for i in range(300)])  # longer than the chunks below
    with torch.no_grad():
        return ids, [model.model(torch.tensor([p])).last_hidden_state[0] for p in ids]


@pytest.fixture(scope="module")
def smollm_embedder(default_model):
    """SmolLM2 as an embedding model (vLLM's `--runner pooling`: last token, normalized), 64-token prefill chunks."""
    return LLM(str(default_model.weights), dtype="float32", runner="pooling", max_num_batched_tokens=64, max_num_seqs=8)


def test_last_token_embeddings_equal_transformers_in_chunks(smollm_embedder, smollm_hidden):
    ids, hidden = smollm_hidden
    outs = smollm_embedder.embed(ids)
    for out, h in zip(outs, hidden):
        assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].num_tokens == 0
        assert_close(out.embedding, pooled(h, "LAST"))
    stats = smollm_embedder.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and not smollm_embedder.engine.has_unfinished_requests()


def test_text_prompts_cache_hits_and_request_normalize(smollm_embedder, smollm_hidden):
    ids, hidden = smollm_hidden
    first = smollm_embedder.embed(TEXTS[1])[0]
    again = smollm_embedder.embed(TEXTS[1])[0]  # the prompt's full blocks are cached: only its tail is computed
    assert len(ids[1]) > 16 and again.metrics.num_cached_tokens == 16 * ((len(ids[1]) - 1) // 16)
    assert_close(first.embedding, pooled(hidden[1], "LAST"))
    assert_close(again.embedding, pooled(hidden[1], "LAST"))
    raw = smollm_embedder.embed(ids[4], PoolingParams(normalize=False))[0]
    assert_close(raw.embedding, pooled(hidden[4], "LAST", normalize=False))


def test_wrong_task_and_bad_values_are_refused(smollm_embedder, default_model):
    with pytest.raises(UnsupportedTaskError, match="embedding model"):
        smollm_embedder.generate("Hi", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError) as info:
        smollm_embedder.embed("Hi", PoolingParams(dimensions=16))
    assert info.value.field == "dimensions" and "Matryoshka" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        PoolingParams(normalize="yes")
    assert info.value.field == "normalize"
    with pytest.raises(InvalidRequestError) as info:
        smollm_embedder.embed([[]])
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as info:
        smollm_embedder.embed([10**7])
    assert info.value.field == "prompt_token_ids"
    stats = smollm_embedder.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    with pytest.raises(ConfigError) as info:
        LLM(str(default_model.weights), runner="pooling", pooler_config='{"pooling_type": "MAX"}')
    assert info.value.field == "pooling_type"
    with pytest.raises(ConfigError, match="supported: pooling_type, normalize"):
        LLM(str(default_model.weights), runner="pooling", pooler_config='{"softmax": true}')
    with pytest.raises(ConfigError, match="pooling runner"):
        LLM(str(default_model.weights), runner="generate", pooler_config='{"normalize": false}')


def test_a_generation_engine_refuses_embeddings(default_model):
    llm = LLM(str(default_model.weights), dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(UnsupportedTaskError, match="--runner pooling"):
        llm.embed("Hi")
    assert llm.engine.describe().runner == "generate"


def sentence_transformers_folder(path, pooling: str, normalize: bool = True, tied: bool = True):
    """A Qwen3-Embedding-shaped folder: the bare decoder's tensors (no `model.` prefix, no LM head), with
    sentence-transformers' modules.json and pooling config beside them."""
    make_family_model(path, "qwen3", seed=3)
    weights = load_file(str(path / "model.safetensors"))
    bare = {name.removeprefix("model."): t for name, t in weights.items() if not name.startswith("lm_head.")}
    save_file(bare, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    (path / "config.json").write_text(json.dumps(config))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    mode = {"MEAN": "pooling_mode_mean_tokens", "LAST": "pooling_mode_lasttoken", "CLS": "pooling_mode_cls_token"}
    settings = {"word_embedding_dimension": 64, **{key: kind == pooling for kind, key in mode.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    return path


def bare_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.fixture(scope="module")
def mean_folder(tmp_path_factory):
    return sentence_transformers_folder(tmp_path_factory.mktemp("qwen3-embed-mean"), "MEAN")


PROMPTS = [[(i * 131 + k * 17) % 49000 + 3 for i in range(n)] for k, n in enumerate((1, 5, 40, 97, 160, 33))]


@pytest.fixture(scope="module")
def mean_embedder(mean_folder):
    """runner auto reads modules.json (mean pooling, normalized); 16-token prefill chunks."""
    return LLM(str(mean_folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=6)


def test_sentence_transformers_mean_pooling_in_chunks(mean_folder, mean_embedder):
    description = mean_embedder.engine.describe()
    assert (description.runner, description.pooling_type, description.embedding_size) == ("pooling", "MEAN", 64)
    outs = mean_embedder.embed(PROMPTS)
    for out, h in zip(outs, bare_hidden(mean_folder, PROMPTS)):
        assert_close(out.embedding, pooled(h, "MEAN"))
    again = mean_embedder.embed(PROMPTS[4])[0]
    assert again.metrics.num_cached_tokens == 0  # mean pooling reads every position: no prefix-cache hits
    assert_close(again.embedding, pooled(bare_hidden(mean_folder, PROMPTS[4:5])[0], "MEAN"))


def test_a_prefill_preempted_midway_pools_from_its_first_position_again(mean_folder, mean_embedder):
    engine = mean_embedder.engine
    engine.add_embedding_request("preempted", PROMPTS[4])
    engine.step(), engine.step()  # two 16-token chunks pooled
    (seq,) = engine.scheduler.running
    assert seq.num_computed_tokens == 32
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq)  # what KV pressure does: blocks dropped, recomputed from position 0
    outs = [out for _ in range(40) for out in engine.step()]
    assert [out.request_id for out in outs] == ["preempted"]  # one output: the finished vector, no partial ones
    assert outs[0].finished and outs[0].metrics.num_preemptions == 1
    assert_close(outs[0].embedding, pooled(bare_hidden(mean_folder, PROMPTS[4:5])[0], "MEAN"))


def test_pooler_config_overrides_and_matryoshka(mean_folder, tmp_path):
    folder = shutil.copytree(mean_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(folder), dtype="float32", pooler_config='{"pooling_type": "CLS", "normalize": false}')
    hidden = bare_hidden(folder, PROMPTS[:3])
    for out, h in zip(llm.embed(PROMPTS[:3]), hidden):
        assert_close(out.embedding, pooled(h, "CLS", normalize=False))
    cut = llm.embed(PROMPTS[2], PoolingParams(dimensions=16, normalize=True))[0]
    assert_close(cut.embedding, pooled(hidden[2], "CLS", dims=16))
    with pytest.raises(InvalidRequestError, match="16, 32") as info:
        llm.embed(PROMPTS[2], PoolingParams(dimensions=24))
    assert info.value.field == "dimensions"
    assert len(llm.embed(PROMPTS[2], PoolingParams(dimensions=64))[0].embedding) == 64


def test_untied_checkpoint_without_a_head_loads(tmp_path):
    folder = sentence_transformers_folder(tmp_path / "u", "LAST", normalize=False, tied=False)
    llm = LLM(str(folder), dtype="float32")
    out = llm.embed(PROMPTS[:2])
    for got, h in zip(out, bare_hidden(folder, PROMPTS[:2])):
        assert_close(got.embedding, pooled(h, "LAST", normalize=False))


def test_sentence_transformers_modules_that_change_the_vector_are_refused(mean_folder, tmp_path):
    folder = shutil.copytree(mean_folder, tmp_path / "dense")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        LLM(str(folder))
    (folder / "modules.json").write_text(json.dumps([m for m in modules if "Dense" not in m["type"]]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="not one of last-token, mean or CLS"):
        LLM(str(folder))
