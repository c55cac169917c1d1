"""The fuzz suites' settings (tests/fuzz_support.py): CI replays the same inputs; a fresh campaign does not."""

from __future__ import annotations

from fuzz_support import fuzz_settings


def test_ci_replays_the_inputs_seeded_by_the_test_name(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_FUZZ_FRESH", raising=False)
    monkeypatch.delenv("PAGEDSERVE_FUZZ_EXAMPLES", raising=False)
    chosen = fuzz_settings()
    assert chosen.derandomize and chosen.max_examples == 25 and chosen.database is None


def test_a_fresh_campaign_draws_from_a_random_seed(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FUZZ_FRESH", "1")
    monkeypatch.setenv("PAGEDSERVE_FUZZ_EXAMPLES", "400")
    chosen = fuzz_settings()
    assert not chosen.derandomize and chosen.max_examples == 400
    monkeypatch.setenv("PAGEDSERVE_FUZZ_FRESH", "0")
    assert fuzz_settings().derandomize
