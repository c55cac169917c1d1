"""Shared fixtures: the default model, transformers references, tiny random models."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import triton_interpreter_patch  # imports nothing of Triton until install()

# Triton reads TRITON_INTERPRET when triton.language is first imported (transformers' model classes import it), so
# the switch is made here, before any test module loads. Without CUDA the Triton kernels run under Triton's CPU
# interpreter; with CUDA they compile and the same kernel tests run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.engine import config as engine_config
from pagedserve.engine.loading.model_store import ModelSource, resolve_model
from pagedserve.engine.runner import kv_budget
from service_fixtures import server_factory, shared_server  # noqa: F401  (real server processes)

# Triton's interpreter without its redundant nested re-patching (tests/triton_interpreter_patch.py): the same
# kernels and results for less of the interpreter's own overhead.
triton_interpreter_patch.install()

# In-process engines built without a KV budget get TEST_KV_CACHE_MEMORY instead of the product's 1 GiB default:
# the arena is zeroed at build (kernels/huge_pages.py), and in a VM guest whose freed memory goes back to the host
# every build faults its pages in again, ~0.3 s a GiB; ~300 builds spent 95 s of the workers' time on it (profiled
# under py-spy). 128 MiB still holds ~2,900 tokens of the default model in fp32. Server processes the tests start
# keep the product's default; tests of the default's rule read config.DEFAULT_KV_CACHE_MEMORY, patched alike here
# before any test module imports it, and PRODUCT_KV_CACHE_MEMORY is what the product ships.
PRODUCT_KV_CACHE_MEMORY = engine_config.DEFAULT_KV_CACHE_MEMORY
TEST_KV_CACHE_MEMORY = 128 << 20
for _module in (engine_config, kv_budget):
    _module.DEFAULT_KV_CACHE_MEMORY = TEST_KV_CACHE_MEMORY


# pytest-xdist (tests/run.sh) gives each worker whole test files, so a file's module fixtures (servers, engines)
# start once. Files that share a session fixture too slow to build once per worker run on one worker together.
ONE_WORKER_FILES = {"tests/test_gemma3_gguf.py": "hf_gemma3", "tests/test_gguf_models.py": "hf_gemma3"}
# The files that take longest (1.5-5 min each on 2 cores), handed out first so that neither worker is left alone with
# one of them at the end; the rest follow in collection order.
LONG_FILES = ("tests/test_device_check.py", "tests/test_gemma3_gguf.py", "tests/test_gguf_models.py",
              "tests/test_tool_calling.py", "tests/test_engine_vs_transformers.py", "tests/test_half_weights.py",
              "tests/test_mesh_envoy.py")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (tests/run.sh) with ONE_WORKER_FILES as one unit and the files in collection order. (xdist's
    `--dist loadgroup` with a group mark per file cannot: it renames `item._nodeid`, which pytest 9's `nodeid` no
    longer reads, so every test became a unit of its own and a file's module fixtures started on both workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER_FILES.get(_file_of(nodeid), _file_of(nodeid))

    config.option.loadscopereorder = False  # keep pytest_collection_modifyitems' order: LONG_FILES first
    return FileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """LONG_FILES first (a stable sort: each file's own order is kept); and a file that uses a fixture named in
    ONE_WORKER_FILES must be listed there, or each worker would build that fixture."""
    shared = set(ONE_WORKER_FILES.values())
    for item in items:
        path = _file_of(item.nodeid)
        if shared & set(getattr(item, "fixturenames", ())) and path not in ONE_WORKER_FILES:
            raise pytest.UsageError(f"{path} uses {sorted(shared)}: add it to ONE_WORKER_FILES in tests/conftest.py")
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    _scale_fuzz_timeouts(config, items)
    items.sort(key=lambda item: rank.get(_file_of(item.nodeid), len(rank)))


def _scale_fuzz_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A long campaign (`PAGEDSERVE_FUZZ_EXAMPLES=2000 bash tests/run.sh -k fuzz`) gives the tests it selects a limit
    scaled to its budget, so pytest-timeout ends none of them midway."""
    from fuzz_support import campaign_timeout_s

    limit = campaign_timeout_s(float(config.getini("timeout") or 600))
    if limit is None:
        return
    for item in items:
        if "fuzz" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def default_model() -> ModelSource:
    """The embedded default: SmolLM2-135M-Instruct's Q4_1 GGUF, served as it is, and its exported tokenizer."""
    return resolve_model(None)


def hf_from_gguf(path: Path):
    """transformers' own GGUF loader (dequantized, fp32): the oracle for every GGUF test."""
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """During one transformers GGUF load, gguf's GGUFReader and get_tensor_name_map answer repeated calls from a
    cache. transformers parses the file twice (config, then tensors) and builds the same TensorNameMap once per
    submodule (~400 times). Both are pure functions of their arguments and transformers only reads the results: the
    loaded weights are bit-identical, at about half the time. The one parse is gguf's reader over a plain view of
    the memory map (tests/gguf_plain_reader.py: the same fields and tensors as the stock reader, which
    tests/test_gguf_header.py checks), 0.5 s where the stock reader takes 3 s for SmolLM2's 49k-token vocabulary and
    11 s for Gemma 3's 262k."""
    import gguf

    from gguf_plain_reader import gguf_reader

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def read_once(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = gguf_reader(path) if mode == "r" else reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="session")
def hf_reference(default_model):
    """transformers' own fp32 model and tokenizer for the default model: the oracle for greedy outputs."""
    from transformers import AutoTokenizer

    with gguf_parsed_once():  # the tokenizer and the model from one parse of the file
        tok = AutoTokenizer.from_pretrained(str(default_model.weights.parent), gguf_file=default_model.weights.name)
        return hf_from_gguf(default_model.weights), tok


@pytest.fixture(scope="session")
def hf_vector(hf_reference):
    """transformers' last-token final hidden state of a text (the vector an embedding server normalizes)."""
    model, tok = hf_reference

    def of(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model.model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]

    return of


@pytest.fixture(scope="session")
def hf_gemma3():
    """Gemma 3 270M's GGUF file and transformers' fp32 model from it, loaded once (a ~30 s dequantization in
    Python): the oracle of the Gemma 3 end-to-end and loader tests."""
    from pagedserve.engine.loading.model_store import gemma3_270m_gguf

    path = gemma3_270m_gguf()
    return path, hf_from_gguf(path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            min_new_tokens=max_new_tokens, pad_token_id=model.config.eos_token_id, **kwargs,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy for many prompts in one left-padded generate call (the attention mask hides the padding, and
    positions count from each row's first real token). Decoding a batch reads the weights once per step instead of
    once per prompt: several times faster on CPU. Its tokens equal one-prompt-at-a-time generation on the suite's
    prompts (checked for SmolLM2 and Gemma 3 270M, fp32), so the oracle is the same function."""
    width = max(len(p) for p in prompts)
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            min_new_tokens=max_new_tokens, pad_token_id=pad,
        )
    return out[:, width:].tolist()


def make_tiny_model(tmp_path: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> Path:
    """A small random-weight HF model saved as safetensors, with the default model's tokenizer files."""
    import transformers

    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    }[architecture]
    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )
    fields.update(overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    src = resolve_model(None).tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [architecture]
    return tmp_path


@pytest.fixture(scope="session")
def llm_fp32(default_model):
    """One shared fp32 engine on the default model (tests must leave it with no request in flight)."""
    from pagedserve.engine import LLM

    return LLM(str(default_model.weights), dtype="float32")
