"""The seeds experiment's pieces: which params a seed sets, which seed a workspace trains with, the spread."""

from __future__ import annotations

import pytest

from experiments.seeds import SEED_KEYS, seed_of_params, seeded_params, spread


def test_seeded_params_set_every_seed_and_leave_the_rest() -> None:
    params = {"sft": {"seed": 0, "train": {"epochs": 1, "lr": 0.002}}, "ar_rl": {"seed": 0, "train": {"steps": 20, "seed": 0}}, "traces": {"seed": 0}}
    out = seeded_params(params, 2)
    assert out["sft"] == {"seed": 2, "train": {"epochs": 1, "lr": 0.002, "seed": 2}}
    assert out["ar_rl"] == {"seed": 2, "train": {"steps": 20, "seed": 2}}
    assert out["traces"] == {"seed": 0}  # the traces (the data) stay the workspace's
    assert params["sft"]["seed"] == 0 and "seed" not in params["sft"]["train"]  # a copy
    assert seed_of_params(out) == 2 and len(SEED_KEYS) == 4


def test_seed_of_params_counts_a_missing_seed_as_0_and_refuses_a_mix() -> None:
    assert seed_of_params({"sft": {"train": {}}, "ar_rl": {"train": {}}}) == 0
    assert seed_of_params({"sft": {"seed": 1, "train": {"seed": 1}}, "ar_rl": {"seed": 1, "train": {"seed": 1}}}) == 1
    assert seed_of_params({"sft": {"seed": 1}, "ar_rl": {}}) is None


def test_spread_over_seeds() -> None:
    def fig(r1: float, gain: float) -> dict:
        return {"recall@1": r1, "ndcg@3": r1 / 2, "recall@1_vs_prerank": {"diff": gain, "ci95": [gain - 0.01, gain + 0.01]}, "ndcg@3_vs_prerank": {"diff": gain / 2, "ci95": [0, 0]}}

    per_seed = {0: {"test": {"gr2": fig(0.34, 0.02)}}, 1: {"test": {"gr2": fig(0.33, 0.01)}}, 2: {"test": {"gr2": fig(0.345, 0.025)}}}
    s = spread(per_seed)["test"]["gr2"]
    assert s["recall@1"]["min"] == 0.33 and s["recall@1"]["max"] == 0.345
    assert s["recall@1"]["range"] == pytest.approx(0.015)
    assert s["recall@1_vs_prerank"]["mean"] == pytest.approx(0.055 / 3)
