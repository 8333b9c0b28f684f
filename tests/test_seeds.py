"""The seeds experiment's pieces: which params a seed sets, which seed a workspace trains with, the spread."""

from __future__ import annotations

import pytest

import numpy as np

from experiments.seeds import (
    SEED_KEYS,
    against_base,
    parse_overrides,
    pooled,
    ranks_path,
    seed_dir,
    seed_of_params,
    seeded_params,
    spread,
    with_overrides,
)


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


def test_overrides_name_the_field_and_change_only_a_copy() -> None:
    params = {"sft": {"seed": 0, "train": {"decision_weight": 0.0, "lr": 0.002}}}
    over = parse_overrides(["sft.train.decision_weight=20", "sft.train.lr=1e-3"], params)
    assert over == {"sft.train.decision_weight": 20, "sft.train.lr": 0.001}
    out = with_overrides(params, over)
    assert out["sft"]["train"] == {"decision_weight": 20, "lr": 0.001}
    assert params["sft"]["train"]["decision_weight"] == 0.0  # a copy
    with pytest.raises(SystemExit, match="no field 'sft.train.decision_wieght'"):
        parse_overrides(["sft.train.decision_wieght=20"], params)
    with pytest.raises(SystemExit, match="a section"):
        parse_overrides(["sft.train=1"], params)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_overrides(["sft.train.lr"], params)


def test_a_recipe_seed_is_paired_against_the_same_base_seed(tmp_path) -> None:
    # 0-based ranks of the target on 6 examples: the recipe moves two targets to first place.
    base = np.array([0, 1, 2, 0, 1, 3])
    own = np.array([0, 0, 2, 0, 0, 3])
    for recipe, ranks in ((None, base), ("soft", own)):
        seed_dir(tmp_path, 0, recipe).mkdir(parents=True)
        np.savez(ranks_path(tmp_path, 0, recipe), **{"gr2/test": ranks})
    per_seed = {0: {"test": {"gr2": {}}}, 1: {"test": {"gr2": {}}}}  # seed 1 has no base ranks
    assert against_base(tmp_path, "soft", per_seed, n_boot=200) == [0]
    d = per_seed[0]["test"]["gr2"]["recall@1_vs_base"]
    assert d["diff"] == pytest.approx(2 / 6)
    assert d["ci95"][0] <= d["diff"] <= d["ci95"][1]
    assert per_seed[0]["test"]["gr2"]["ndcg@3_vs_base"]["diff"] > 0
    assert per_seed[1]["test"]["gr2"] == {}
    assert seed_dir(tmp_path, 2, "soft") == tmp_path / "recipes" / "soft" / "seed2"


def test_pooled_averages_each_example_over_the_seeds_before_comparing(tmp_path) -> None:
    # 0-based target ranks on 4 examples. Seed 0's gr2 puts example 1's target first, seed 1's
    # does not: averaged over the seeds, example 1 gains half a hit; gr2-sft equals the incoming order.
    prerank = np.array([0, 1, 1, 2])
    ranks = {0: np.array([0, 0, 1, 2]), 1: np.array([0, 1, 1, 2])}
    for seed, gr2 in ranks.items():
        seed_dir(tmp_path, seed, None).mkdir(parents=True)
        np.savez(ranks_path(tmp_path, seed), **{"prerank/test": prerank, "gr2-sft/test": prerank, "gr2/test": gr2})
    out = pooled(tmp_path, [0, 1], ["test"], n_boot=200)["test"]
    assert out["gr2"]["recall@1"]["diff"] == pytest.approx(0.5 / 4)
    assert out["gr2-sft"]["recall@1"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert out["gr2_vs_gr2-sft"]["recall@1"]["diff"] == pytest.approx(0.5 / 4)
    lo, hi = out["gr2"]["ndcg@3"]["ci95"]
    assert 0 <= lo <= out["gr2"]["ndcg@3"]["diff"] <= hi
