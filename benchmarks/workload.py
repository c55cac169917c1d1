"""Seeded benchmark workload shared by every system we measure.

The same (seed, config) always yields the same prompts, output lengths and arrival
times, so pagedserve, transformers, vLLM and llama-server see identical work.
Prompts are random token ids: the measurement is about serving, not about text.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, replace

ARRIVAL_MODES = ("all", "poisson")
# "file": arrival times read from a workload file (workload_file.py); build_workload cannot redraw them.
CONFIG_ARRIVALS = (*ARRIVAL_MODES, "file")


class WorkloadError(ValueError):
    """A workload configuration that cannot produce a valid workload."""


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_requests: int = 64
    prompt_len_min: int = 32
    prompt_len_max: int = 256
    output_len_min: int = 16
    output_len_max: int = 128
    seed: int = 1234
    token_id_low: int = 100  # inclusive: skips the special/control tokens at the start of the vocab
    token_id_high: int = 49000  # exclusive: stays inside SmolLM2's 49,152-token vocab
    arrival: str = "all"
    rate: float = 0.0  # requests per second, only for arrival="poisson"

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise WorkloadError(f"need 1 <= prompt_len_min <= prompt_len_max, got "
                                f"{self.prompt_len_min}..{self.prompt_len_max}")
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise WorkloadError(f"need 1 <= output_len_min <= output_len_max, got "
                                f"{self.output_len_min}..{self.output_len_max}")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise WorkloadError(f"bad token id range [{self.token_id_low}, {self.token_id_high})")
        if self.arrival not in CONFIG_ARRIVALS:
            raise WorkloadError(f"arrival must be one of {CONFIG_ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "poisson" and self.rate <= 0:
            raise WorkloadError(f"poisson arrival needs rate > 0, got {self.rate}")



# The --quick smoke test of throughput.py and peers/compare.py: 16 small requests.
QUICK = WorkloadConfig(num_requests=16, prompt_len_min=32, prompt_len_max=128, output_len_min=8, output_len_max=32)

@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float  # offset from the start of the run


@dataclass(frozen=True, slots=True)
class Workload:
    config: WorkloadConfig
    requests: tuple[BenchRequest, ...]
    source: str = "seeded"  # or the workload file's path

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict:
        return {**asdict(self.config), "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens, "source": self.source}


def build_workload(config: WorkloadConfig) -> Workload:
    """Draws lengths and token ids from one RNG, in request order (this order
    reproduces the perf-anchor workload: 8,976 prompt + 5,167 output tokens for the
    defaults). Arrival times come from a second RNG so that switching between
    all-at-once and Poisson never changes the prompts."""
    rng = random.Random(config.seed)
    arrivals = _arrival_offsets(config)
    requests = []
    for i in range(config.num_requests):
        prompt_len = rng.randint(config.prompt_len_min, config.prompt_len_max)
        output_len = rng.randint(config.output_len_min, config.output_len_max)
        ids = tuple(rng.randint(config.token_id_low, config.token_id_high - 1)
                    for _ in range(prompt_len))
        requests.append(BenchRequest(f"req-{i}", ids, output_len, arrivals[i]))
    return Workload(config, tuple(requests))


def with_poisson_arrivals(workload: Workload, rate: float) -> Workload:
    """The same requests (prompts, output lengths) with Poisson arrivals at `rate` req/s; for a seeded
    workload this equals build_workload(config with arrival="poisson"), and it works for file workloads too."""
    config = replace(workload.config, arrival="poisson", rate=rate)
    offsets = _arrival_offsets(config)
    requests = tuple(replace(r, arrival_s=t) for r, t in zip(workload.requests, offsets))
    return Workload(config, requests, workload.source)


def _arrival_offsets(config: WorkloadConfig) -> list[float]:
    if config.arrival == "file":
        raise WorkloadError("arrival='file' times come from the workload file, not from the config")
    if config.arrival == "all":
        return [0.0] * config.num_requests
    rng = random.Random(config.seed + 7919)
    t, out = 0.0, []
    for _ in range(config.num_requests):
        out.append(t)
        t += rng.expovariate(config.rate)
    return out


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    d = WorkloadConfig()
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(d.prompt_len_min, d.prompt_len_max),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(d.output_len_min, d.output_len_max),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--arrival", choices=ARRIVAL_MODES, default=d.arrival)
    parser.add_argument("--rate", type=float, default=d.rate, help="requests/s for --arrival poisson")


def workload_config_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(num_requests=args.num_requests, prompt_len_min=args.prompt_len[0],
                          prompt_len_max=args.prompt_len[1], output_len_min=args.output_len[0],
                          output_len_max=args.output_len[1], seed=args.seed,
                          arrival=args.arrival, rate=args.rate)


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the seeded workload (summary or full JSON)")
    add_workload_args(parser)
    parser.add_argument("--full", action="store_true", help="dump every request, not only the summary")
    args = parser.parse_args()
    workload = build_workload(workload_config_from_args(args))
    if args.full:
        print(json.dumps([asdict(r) for r in workload.requests]))
    else:
        print(json.dumps(workload.summary(), indent=2))


if __name__ == "__main__":
    main()
