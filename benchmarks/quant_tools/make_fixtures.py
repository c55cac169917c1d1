"""Make the GPTQ/AWQ test fixtures with the real tools (run by hand, never in CI).

    python benchmarks/quant_tools/make_fixtures.py [--only NAME ...] [--setup-only]

1. Creates one throwaway venv per tool under the tools cache (benchmarks/peers/paths.py:
   $PAGEDSERVE_TOOLS_CACHE, else ~/.cache/pagedserve-tools) (their transformers pins
   conflict with each other and with pagedserve's): GPTQModel 7.3.6, AutoGPTQ 0.7.1, AutoAWQ 0.2.9.
2. Writes a small random fp16 Llama (base_model.py) and quantizes it with each recipe below.
3. Each worker reloads its checkpoint with the tool's own CPU loader and records the tool's logits on
   fixed ids and its dequantized weights (tool_common.record).
4. Copies the checkpoints + records into tests/fixtures/quant/NAME/ (tests need none of the tools).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "peers"))
from paths import tools_cache  # noqa: E402  (the harness's cache, under the user's home)

FIXTURES = REPO / "tests" / "fixtures" / "quant"

# venv name -> pip install steps (each a list of args after `pip install`)
VENVS: dict[str, list[list[str]]] = {
    "gptqm": [["torch==2.13.0"], ["transformers==5.18.0", "gptqmodel==7.3.6", "optimum", "requests"]],
    "agptq": [["torch==2.13.0"], ["transformers==4.44.2", "peft==0.11.1", "numpy", "safetensors", "accelerate",
                                  "gekko", "rouge", "datasets", "sentencepiece"],
              ["--no-binary", "auto-gptq", "--no-build-isolation", "auto-gptq==0.7.1"]],
    "awq": [["torch==2.13.0"], ["transformers==4.51.3", "autoawq==0.2.9", "numpy", "safetensors", "accelerate",
                                "datasets"]],
}


@dataclass(frozen=True)
class Recipe:
    name: str
    venv: str
    worker: str
    args: tuple[str, ...]


RECIPES = (
    Recipe("gptq_4bit_g128_actorder_sym", "gptqm", "tool_gptqmodel.py", ("gptq", "4", "128", "1", "1", "gptq")),
    Recipe("gptq_4bit_gm1_sym", "agptq", "tool_autogptq.py", ("4", "-1", "0", "1")),
    Recipe("gptq_8bit_g64_actorder_asym", "agptq", "tool_autogptq.py", ("8", "64", "1", "0")),
    # lm_head=True: the tool quantizes the head too, by default 8-bit g32 sym with mse 2.4 (a `dynamic` entry
    # it writes into the config). GPTQModel refuses it on a tied model; the base's head is untied.
    Recipe("gptq_4bit_g128_lm_head", "gptqm", "tool_gptqmodel.py",
           ("gptq", "4", "128", "1", "1", "gptq", "--set=lm_head=true")),
    Recipe("gptq_v2_4bit_g64_asym", "gptqm", "tool_gptqmodel.py", ("gptq", "4", "64", "0", "0", "gptq_v2")),
    Recipe("awq_4bit_g64", "awq", "tool_autoawq.py", ("64",)),
    Recipe("awq_4bit_g128", "gptqm", "tool_gptqmodel.py", ("awq", "4", "128", "0")),
    Recipe("awq_4bit_g128_no_zero_point", "gptqm", "tool_gptqmodel.py", ("awq", "4", "128", "1")),
)

# Only what the tests read: the checkpoint, its configs, the tokenizer and the tool's records.
KEEP_SUFFIXES = (".safetensors", ".tensors", ".json")
DROP_NAMES = ("generation_config.json",)


def ensure_venv(name: str) -> Path:
    tools = tools_cache()
    py = tools / name / "bin" / "python"
    if py.exists():
        return py
    tools.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(tools / name)], check=True)
    env = {"BUILD_CUDA_EXT": "0", "PATH": "/usr/bin:/bin"}
    for step in VENVS[name]:
        subprocess.run([str(tools / name / "bin" / "pip"), "install", "-q", *step], check=True,
                       env={**__import__("os").environ, **env})
    return py


def run_recipe(recipe: Recipe, base: Path, work: Path) -> Path:
    out = work / recipe.name
    py = ensure_venv(recipe.venv)
    log = work / f"{recipe.name}.log"
    with log.open("w") as fh:
        proc = subprocess.run([str(py), str(HERE / recipe.worker), str(base), str(out), *recipe.args],
                              stdout=fh, stderr=subprocess.STDOUT, cwd=str(work))
    if proc.returncode != 0:
        raise SystemExit(f"{recipe.name} failed; see {log}:\n" + log.read_text()[-3000:])
    return out


def install_fixture(src: Path, name: str) -> None:
    dst = FIXTURES / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.suffix in KEEP_SUFFIXES and f.name not in DROP_NAMES:
            shutil.copy(f, dst / f.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--work", type=Path, default=None, help="keep intermediate outputs here")
    args = ap.parse_args()
    for venv in VENVS:
        ensure_venv(venv)
    if args.setup_only:
        return
    sys.path.insert(0, str(HERE))
    from base_model import write_base_model

    work = args.work or Path(tempfile.mkdtemp(prefix="pagedserve-quant-"))
    base = write_base_model(work / "base")
    for recipe in RECIPES:
        if args.only and recipe.name not in args.only:
            continue
        print(f"[{recipe.name}] quantizing with {recipe.worker} {' '.join(recipe.args)}", flush=True)
        install_fixture(run_recipe(recipe, base, work), recipe.name)
    print(f"fixtures in {FIXTURES}; intermediate files in {work}")


if __name__ == "__main__":
    main()
