"""evaluate's intervals: paired differences on the same examples, also when a model saw only the first N."""

from __future__ import annotations

import numpy as np

from tasks.evaluate import add_intervals


def test_paired_differences_use_the_examples_both_models_saw() -> None:
    rng = np.random.default_rng(0)
    prerank = rng.integers(0, 10, size=400)
    gr2 = np.where(rng.random(400) < 0.3, 0, prerank)  # promotes the target in 30% of the lists
    dgr2 = gr2[:100].copy()  # the diffusion row decoded only the first 100 (diffusion_max_examples)
    ranks = {"prerank": {"test": prerank}, "gr2": {"test": gr2}, "dgr2": {"test": dgr2}}
    results = {m: {"test": {}} for m in ranks}
    add_intervals(results, ranks, n_boot=200, seed=0)

    g = results["gr2"]["test"]["recall@1_vs_prerank"]
    assert g["diff"] == float((gr2 == 0).mean() - (prerank == 0).mean()) > 0
    assert 0 < g["ci95"][0] <= g["diff"] <= g["ci95"][1]
    # Identical answers on the shared examples: a zero difference with a zero-width interval.
    d = results["dgr2"]["test"]["recall@1_vs_gr2"]
    assert d == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert results["dgr2"]["test"]["recall@1_vs_prerank"]["diff"] == float((dgr2 == 0).mean() - (prerank[:100] == 0).mean())
    assert "recall@1_vs_prerank" not in results["prerank"]["test"]
    lo, hi = results["prerank"]["test"]["ndcg@3_ci95"]
    assert lo <= float(np.where(prerank < 3, 1 / np.log2(prerank + 2), 0).mean()) <= hi


def test_bench_rows_with_the_sub_block_cache_are_their_own_setting() -> None:
    """A cached row has its own MLflow key, and takes the accuracy table's judgement only when
    the table decoded with the cache too."""
    from tasks.evaluate import EvaluateConfig, mark_every_example, speed_metric_key

    base = {"decoder": "diffusion", "model": "dgr2", "tau": 0.9, "sub_block_size": 8, "explanation_tau": None,
            "explanation_sub_block_size": None, "batch_size": 1}  # fmt: skip
    plain, cached = {**base, "sub_block_cache": False}, {**base, "sub_block_cache": True}
    assert speed_metric_key(plain) == "speed.dgr2.diffusion.tau0.9.b1.s8.speedup"
    assert speed_metric_key(cached) == "speed.dgr2.diffusion.tau0.9.b1.s8.cache.speedup"
    results = {"dgr2": {"test": {"recall@1_vs_gr2": {"diff": -0.001}, "valid_format_rate": 1.0}}}
    for flag in (False, True):
        rows = [dict(plain), dict(cached)]
        mark_every_example(rows, results, EvaluateConfig(tau=0.9, sub_block_size=8, sub_block_cache=flag))
        assert ["every_example_recall@1_vs_gr2" in r for r in rows] == [not flag, flag]
