"""Regenerate the client/server stubs from proto/pagedserve/v1/*.proto.

    python proto/generate.py                 # all languages (Go needs Debian's protoc plugins: clients/build.sh)
    python proto/generate.py --lang python   # one language
    python proto/generate.py --check         # exit 1 if committed stubs differ from a fresh generation

One function per language; each writes into an output root that mirrors where that language's stubs are
committed, so `--check` can generate into a temporary root and compare file by file.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_PACKAGE_DIR = PROTO_ROOT / "pagedserve" / "v1"


def proto_files() -> list[str]:
    """Proto paths relative to PROTO_ROOT, sorted so generation order (and output) is stable."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_PACKAGE_DIR.glob("*.proto"))


def run_protoc(args: list[str]) -> None:
    # grpc_tools ships its own protoc and the well-known types, so no system protoc is needed.
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *args]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)


def generate_python(out_root: Path) -> list[Path]:
    """Writes <out_root>/pagedserve/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py (imported as pagedserve.v1)."""
    out_root.mkdir(parents=True, exist_ok=True)
    run_protoc([f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
                *proto_files()])
    return sorted((out_root / "pagedserve" / "v1").glob("*_pb2*.py*"))


@dataclass(frozen=True, slots=True)
class Language:
    generate: Callable[[Path], list[Path]]
    committed_root: Path  # where generate(committed_root) writes the committed stubs
    tools: tuple[str, ...] = ()  # executables it needs; without --lang, languages missing one are skipped

    def missing_tools(self) -> list[str]:
        return [tool for tool in self.tools if shutil.which(tool) is None]


GO_MODULE = "github.com/pagedserve/pagedserve/clients/go"


def generate_go(out_root: Path) -> list[Path]:
    """Writes <out_root>/pagedservev1/*.pb.go (committed under clients/go).

    Uses Debian's protoc, protoc-gen-go and protoc-gen-go-grpc on purpose: code from newer plugins needs newer
    Go runtimes than the ones clients/go/go.mod pins (see clients/build.sh, which installs them).
    """
    missing = LANGUAGES["go"].missing_tools()
    if missing:
        raise SystemExit(f"Go stubs need {', '.join(missing)}; clients/build.sh installs them (apt)")
    out_root.mkdir(parents=True, exist_ok=True)
    cmd = ["protoc", f"-I{PROTO_ROOT}", f"--go_out={out_root}", f"--go_opt=module={GO_MODULE}",
           f"--go-grpc_out={out_root}", f"--go-grpc_opt=module={GO_MODULE}", *proto_files()]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    return sorted((out_root / "pagedservev1").glob("*.pb.go"))


LANGUAGES: dict[str, Language] = {
    "python": Language(generate_python, PROTO_ROOT),
    # Java stubs are not committed: Maven generates them from the same protos (clients/java/pom.xml).
    "go": Language(generate_go, REPO_ROOT / "clients" / "go", ("protoc", "protoc-gen-go", "protoc-gen-go-grpc")),
}


def stale_files(lang: str) -> list[str]:
    """Generated files whose committed copy is missing or differs; empty when the stubs are fresh."""
    spec = LANGUAGES[lang]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = spec.generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = spec.committed_root / path.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(committed.relative_to(REPO_ROOT).as_posix())
        return stale


def default_languages() -> list[str]:
    """Every language whose tools are installed; the others are named on stderr, not silently dropped."""
    langs = []
    for lang, spec in sorted(LANGUAGES.items()):
        missing = spec.missing_tools()
        if missing:
            print(f"skipping {lang}: {', '.join(missing)} not installed (clients/build.sh installs them)",
                  file=sys.stderr)
        else:
            langs.append(lang)
    return langs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", choices=sorted(LANGUAGES), action="append",
                        help="language to generate (repeatable; default: all whose tools are installed)")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    langs = args.lang or default_languages()
    if args.check:
        stale = [f for lang in langs for f in stale_files(lang)]
        for f in stale:
            print(f"stale: {f}", file=sys.stderr)
        if stale:
            print("run: python proto/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for lang in langs:
        spec = LANGUAGES[lang]
        for path in spec.generate(spec.committed_root):
            print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
