"""Hub ids served from a Hugging Face cache on disk: `vllm serve ORG/NAME --revision REV --download-dir DIR` starts
unchanged where the snapshot was downloaded beforehand, reports the id as the model's name, reads the snapshot's
generation_config.json, and picks the revision's snapshot; `ORG/NAME:QUANT` picks a GGUF repository's file; an id
not in the cache, or a revision not in it, is refused naming the cache and the revision. The caches here are laid
out as huggingface_hub writes them (blobs, snapshot symlinks, refs), and huggingface_hub's own scan reads each
back before a test relies on it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import requests
from conftest import make_tiny_model
from service_fixtures import start_server

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError
from pagedserve.engine.loading.hub_cache import HubCache, is_hub_id
from pagedserve.engine.loading.model_store import default_served_name, resolve_model
from pagedserve.service.cli import build_parser, engine_config

REPO = "acme/tiny-llama"
MAIN, V2 = "1" * 40, "2" * 40  # two commits: main and the tag v2
PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def cache_repo(cache: Path, repo_id: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ()) -> Path:
    """One commit of a model repository in huggingface_hub's cache layout: content-addressed blobs, the snapshot's
    files as relative symlinks to them, and refs naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for relative, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{relative}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(source.resolve())  # large files stay where they are; readers follow the link
        link = repo / "snapshots" / commit / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the hash as written
    return repo / "snapshots" / commit


def _files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A cache holding REPO at two commits (different random weights) and a GGUF repository of two quantizations;
    returns (cache, local folder of main's weights, local folder of v2's weights)."""
    from huggingface_hub import scan_cache_dir

    root = tmp_path_factory.mktemp("hub")
    main_model = make_tiny_model(root / "main", seed=0)
    (main_model / "generation_config.json").write_text('{"max_new_tokens": 3, "temperature": 0.0}')
    v2_model = make_tiny_model(root / "v2", seed=1)
    cache = root / "cache"
    cache_repo(cache, REPO, MAIN, _files(main_model), refs=("main",))
    cache_repo(cache, REPO, V2, _files(v2_model), refs=("v2",))
    gguf = resolve_model(None).weights
    cache_repo(cache, "acme/smol-GGUF", MAIN, {"smol-Q4_1.gguf": gguf, "smol-Q8_0.gguf": gguf,
                                              "smol-Q8_0-00001-of-00002.gguf": gguf}, refs=("main",))
    scanned = {repo.repo_id: repo for repo in scan_cache_dir(cache).repos}  # huggingface_hub reads it back
    assert {r.commit_hash for r in scanned[REPO].revisions} == {MAIN, V2}
    assert {ref for r in scanned[REPO].revisions for ref in r.refs} == {"main", "v2"}
    return cache, main_model, v2_model


def _text(llm: LLM) -> str:
    [out] = llm.generate([PROMPT], GREEDY)
    return out.outputs[0].text


def test_a_hub_id_serves_the_revisions_snapshot(hub):
    cache, main_model, v2_model = hub
    expected = {local: _text(LLM(str(local), dtype="float32")) for local in (main_model, v2_model)}
    assert expected[main_model] != expected[v2_model]  # so the text tells which snapshot was served
    for revision, local in ((None, main_model), ("v2", v2_model), (V2, v2_model)):
        served = LLM(REPO, download_dir=str(cache), revision=revision, dtype="float32",
                     hf_token="hf_unused", code_revision="unused")  # vLLM's arguments that fetch: nothing here
        assert _text(served) == expected[local], revision


def test_a_missing_id_or_revision_names_the_cache(hub, tmp_path):
    cache, _, _ = hub
    with pytest.raises(ModelLoadError, match=rf"acme/absent is neither a local path nor cached in {cache}.*"
                                             r"hf download acme/absent"):
        resolve_model("acme/absent", hub=HubCache(str(cache)))
    with pytest.raises(ModelLoadError, match=rf"{REPO} at revision 'v3' is neither"):
        resolve_model(REPO, hub=HubCache(str(cache), "v3"))
    with pytest.raises(ModelLoadError, match=r"HF_HUB_CACHE"):  # no --download-dir: the default cache is named
        resolve_model("acme/absent-everywhere")


def test_a_gguf_repository_takes_the_quantization_after_a_colon(hub):
    cache, _, _ = hub
    source = resolve_model("acme/smol-GGUF:Q8_0", hub=HubCache(str(cache)))
    assert source.weights.name == "smol-Q8_0.gguf" and source.name == "acme/smol-GGUF:Q8_0"  # unsharded first
    assert resolve_model("acme/smol-GGUF:Q4_1", hub=HubCache(str(cache))).weights.name == "smol-Q4_1.gguf"
    with pytest.raises(ModelLoadError, match=r"no \*-Q5_K_M\.gguf file \(it holds smol-Q4_1\.gguf, "):
        resolve_model("acme/smol-GGUF:Q5_K_M", hub=HubCache(str(cache)))
    with pytest.raises(ModelLoadError, match=r"holds 3 \.gguf files .*pass the file \(or acme/smol-GGUF:QUANT\)"):
        resolve_model("acme/smol-GGUF", hub=HubCache(str(cache)))


def test_a_hub_id_tokenizer_at_its_own_revision(hub):
    cache, main_model, _ = hub
    source = resolve_model(str(main_model), tokenizer=REPO, hub=HubCache(str(cache)), tokenizer_revision="v2")
    assert source.tokenizer == cache / "models--acme--tiny-llama" / "snapshots" / V2
    assert source.weights == main_model
    with pytest.raises(ModelLoadError, match=rf"tokenizer: {REPO} at revision 'v9' is neither"):
        resolve_model(str(main_model), tokenizer=REPO, hub=HubCache(str(cache)), tokenizer_revision="v9")


def test_names_and_config_checks(tmp_path):
    assert default_served_name("acme/tiny-llama") == "acme/tiny-llama"  # as vLLM reports a hub id
    assert default_served_name(str(tmp_path / "model.gguf")) == "model"
    assert default_served_name(None) == "SmolLM2-135M-Instruct"
    assert is_hub_id("acme/x:Q4_K_M") and not is_hub_id(str(tmp_path)) and not is_hub_id("a/b/c")
    with pytest.raises(ConfigError, match="supported: auto, hf") as info:
        EngineConfig(tokenizer_mode="mistral")
    assert info.value.field == "tokenizer_mode"
    for field in ("revision", "tokenizer_revision", "download_dir"):
        with pytest.raises(ConfigError) as info:
            EngineConfig(**{field: " "})
        assert info.value.field == field
    with pytest.raises(ConfigError, match="neither a folder nor a hub id"):
        EngineConfig(tokenizer="./not/here")


def test_vllms_hub_flags_reach_the_engine_config(tmp_path):
    args = build_parser().parse_args(["serve", REPO, "--revision", "v2", "--tokenizer-revision", "main",
                                      "--download-dir", str(tmp_path), "--tokenizer-mode", "hf",
                                      "--code-revision", "abc", "--hf-token", "hf_x"])
    config = engine_config(args)
    assert (config.model, config.revision, config.tokenizer_revision, config.download_dir, config.tokenizer_mode) \
        == (REPO, "v2", "main", str(tmp_path), "hf")
    assert config.hub == HubCache(str(tmp_path), "v2")


def test_vllm_serve_launch_line_with_a_hub_id(hub, tmp_path):
    """The default cache comes from HF_HUB_CACHE, as for vLLM; the id is the served name; the snapshot's
    generation_config.json gives requests that leave max_tokens out their default (3 tokens)."""
    cache, main_model, _ = hub
    server = start_server(tmp_path, REPO, "--revision", MAIN, "--http-port", "0", "--tokenizer-mode", "auto",
                          env={"HF_HUB_CACHE": str(cache)})
    try:
        base = f"http://127.0.0.1:{server.http_port}/v1"
        assert [m["id"] for m in requests.get(f"{base}/models", timeout=30).json()["data"]] == [REPO]
        body = {"model": REPO, "prompt": PROMPT, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
        reply = requests.post(f"{base}/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == _text(LLM(str(main_model), dtype="float32")), reply
        body.pop("max_tokens")
        reply = requests.post(f"{base}/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 3, reply  # the snapshot's max_new_tokens
    finally:
        server.stop()
