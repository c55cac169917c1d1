"""A warm in-process system (pagedserve, hf_static, hf_cb) served over worker_protocol.

    python benchmarks/worker.py pagedserve --model DIR --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from systems import SYSTEMS, SystemSpec, create_system  # noqa: E402
from worker_protocol import serve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("system", choices=list(SYSTEMS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    spec = SystemSpec(args.model, args.dtype, args.threads, args.prefix_caching)

    def setup():
        system = create_system(args.system, spec)

        def run(workload):
            r = system.run(workload)
            return r.timings, r.peak_kv_blocks, r.extra

        return run

    serve(setup, {"system": args.system, "dtype": args.dtype})


if __name__ == "__main__":
    main()
