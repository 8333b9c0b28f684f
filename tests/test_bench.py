"""The decode benchmark's timing (gr2model.eval.bench): warm-up, interleaved repeats, median and spread,
and the speed-up judged on time per example.

The decoder is a stand-in (`lm_rerank` replaced) whose seconds and response lengths are set
by the test, so every number below is computed by hand from those, not from the code's own
formulas; the real decoders' rows are tests/test_diffusion_decode.py's and
tests/test_speculative_wiring.py's.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

import gr2model.eval.bench as bench
from gr2model.eval.rerank_eval import LMRerankResult

N = 4  # examples
# Seconds of each timed pass over the N examples, per row (the desc names the row).
PASSES = {"ar": [1.0, 3.0, 2.0], "hf": [3.0, 3.0, 3.0], "d": [3.0, 2.8, 3.2]}
# Generated tokens per example: the diffusion model writes a three times longer (looser) explanation.
TOKENS = {"ar": 100, "hf": 100, "d": 300}


def _key(desc: str) -> str:
    return desc.split()[1] if desc.split()[1] in ("ar", "hf") else "d"


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """Replace the decoding: record (row, examples, constrained) per call; seconds from PASSES."""
    calls: list[tuple[str, int, bool]] = []
    timed: dict[str, int] = {}

    def lm_rerank(model: Any, tok: Any, df: pl.DataFrame, items: Any, fmt: Any, *, desc: str, constrained: bool = False, **kw: Any) -> LMRerankResult:
        key = _key(desc)
        calls.append((desc, df.height, constrained))
        if df.height == N:  # a timed pass (the warm-up decodes one batch)
            seconds = PASSES[key][timed.get(desc, 0) % 3]
            timed[desc] = timed.get(desc, 0) + 1
        else:
            seconds = 99.0  # a warm-up time that must not reach any row
        n = df.height
        return LMRerankResult(parsed=[None] * n, texts=[""] * n, generated_tokens=TOKENS[key] * n, nfe=TOKENS[key] * n // 2, seconds=seconds, sequences=[[1]] * n)

    monkeypatch.setattr(bench, "lm_rerank", lm_rerank)
    monkeypatch.setattr(bench, "block_diffusion_settings", lambda model: (4, 99))
    monkeypatch.setattr(bench, "rerank_metrics", lambda parsed, targets: dict.fromkeys(("recall@1", "ndcg@3", "valid_format_rate", "valid_permutation_rate"), 0.5))
    return calls


LISTS = pl.DataFrame({"history": [[1]] * N, "candidates": [[1, 2]] * N, "target": [1] * N})


def run(**kw: Any) -> list[dict[str, Any]]:
    args: dict[str, Any] = dict(taus=[0.9], batch_sizes=[2], max_new_tokens=8)
    return bench.decode_benchmark(object(), {"dgr2": object()}, None, LISTS, None, None, **{**args, **kw})


def test_warm_up_then_interleaved_passes(fake: list[tuple[str, int, bool]]) -> None:
    rows = run()
    descs = ["bench ar b2", "bench hf b2", "bench dgr2 tau 0.9 b2"]
    # One untimed warm-up batch (2 examples) per row first, then pass r of every row before pass r + 1.
    assert [(d, n) for d, n, _ in fake] == [(d, 2) for d in descs] + [(d, N) for d in descs] * 3
    assert all(r["seconds_max"] < 99.0 for r in rows)  # the warm-up's time is no pass's


def test_median_spread_and_time_per_example(fake: list[tuple[str, int, bool]]) -> None:
    ar, hf, d = run()
    assert (ar["repeats"], ar["seconds"], ar["seconds_min"], ar["seconds_max"]) == (3, 2.0, 1.0, 3.0)
    assert ar["seconds_per_example"] == pytest.approx(0.5) and hf["seconds_per_example"] == pytest.approx(0.75)
    # Our loop (0.5 s per example) is the reference, not HF (0.75 s).
    assert ar["speedup"] == 1.0 and hf["speedup"] == pytest.approx(0.5 / 0.75)
    # The diffusion row writes 300 tokens per example in 3.0 s for 4: 400 tokens/s, twice AR's 400 / 2.0 ...
    assert d["tokens_per_s"] == pytest.approx(300 * N / 3.0) and d["tokens_per_s_speedup"] == pytest.approx(2.0)
    # ... yet each response is done after 0.75 s, not AR's 0.5 s: slower (0.67x), not 2x faster.
    assert d["seconds_per_example"] == pytest.approx(3.0 / N) and d["speedup"] == pytest.approx(0.5 / 0.75)
    assert d["grammar"] is False and ar["grammar"] is False


def test_repeats_knob_and_its_floor(fake: list[tuple[str, int, bool]]) -> None:
    (ar, _, _) = run(repeats=1, warmup=False)
    assert ar["repeats"] == 1 and ar["seconds"] == 1.0 and len(fake) == 3
    with pytest.raises(ValueError, match="repeats"):
        run(repeats=0)


def test_constrained_bench_still_measures_the_plain_setting(fake: list[tuple[str, int, bool]]) -> None:
    rows = run(constrained=True, plain_settings=[(0.9, None, False)], warmup=False, repeats=1)
    diffusion = [(r["tau"], r["sub_block_size"], r["grammar"]) for r in rows if r["decoder"] == "diffusion"]
    assert diffusion == [(0.9, None, True), (0.9, None, False)]
    assert [c for _, _, c in fake] == [False, False, True, False]  # the AR rows never take the grammar
    # Without the grammar every row is plain already: no second copy.
    assert len(run(plain_settings=[(0.9, None, False)], warmup=False, repeats=1)) == 3


def test_table_shows_time_per_example_and_spread(fake: list[tuple[str, int, bool]]) -> None:
    table = bench.speed_table(run())
    header = table.splitlines()[0]
    for col in ("repeats", "seconds_per_example", "seconds_min", "seconds_max", "speedup", "tokens_per_s", "tokens_per_s_speedup"):
        assert f"| {col} |" in header
    assert "grammar" not in header
    assert set(bench.SPEED_FIELDS) >= {"repeats", "seconds_min", "seconds_max", "seconds_per_example", "tokens_per_s_speedup", "grammar"}
    assert not set(bench.SPEC_FIELDS) & {"repeats", "grammar", "seconds_per_example"}


def test_batch_one_interleaves_example_by_example_and_drops_a_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch size 1 every row decodes example i all its passes before any row decodes i + 1,
    a row's time is the sum over examples of the per-example median (a pass that a burst of
    other load hit does not count), and its answers come back in the examples' order."""
    calls: list[tuple[str, int]] = []
    # Per row, the seconds of its successive timed calls: example 0's three passes, then example 1's, ...
    burst = {"ar": [1.0, 1.0, 9.0] + [1.0] * 9, "hf": [2.0] * 12, "d": [0.5, 0.5, 0.5] * 3 + [0.5, 7.0, 0.5]}
    timed: dict[str, int] = {}

    def lm_rerank(model: Any, tok: Any, df: pl.DataFrame, items: Any, fmt: Any, *, desc: str, quiet: bool = False, **kw: Any) -> LMRerankResult:
        key = _key(desc)
        example = int(df["history"][0][0])
        calls.append((key, example))
        assert quiet  # one line per example and pass would flood the log
        seconds = burst[key][timed.get(key, 0)]
        timed[key] = timed.get(key, 0) + 1
        return LMRerankResult(parsed=[None], texts=[""], generated_tokens=TOKENS[key], nfe=TOKENS[key], seconds=seconds, sequences=[[example]])

    monkeypatch.setattr(bench, "lm_rerank", lm_rerank)
    monkeypatch.setattr(bench, "block_diffusion_settings", lambda model: (4, 99))
    monkeypatch.setattr(bench, "rerank_metrics", lambda parsed, targets: dict.fromkeys(("recall@1", "ndcg@3", "valid_format_rate", "valid_permutation_rate"), 0.5))
    lists = pl.DataFrame({"history": [[e] for e in range(N)], "candidates": [[1, 2]] * N, "target": [1] * N})
    spy: dict[str, LMRerankResult] = {}
    real_row = bench._row
    monkeypatch.setattr(bench, "_row", lambda job, out, s, t, m: spy.setdefault(job.meta["decoder"], out) and real_row(job, out, s, t, m))
    ar, hf, d = bench.decode_benchmark(object(), {"dgr2": object()}, None, lists, None, None, taus=[0.9], batch_sizes=[1], max_new_tokens=8, warmup=False)
    assert calls == [(key, e) for e in range(N) for _ in range(3) for key in ("ar", "hf", "d")]
    # AR: example 0's 9 s pass is dropped by its median; 4 examples x 1 s. Its passes total 4, 4 and 12 s.
    assert (ar["seconds"], ar["seconds_min"], ar["seconds_max"], ar["seconds_per_example"]) == (4.0, 4.0, 12.0, 1.0)
    assert (d["seconds"], d["seconds_max"]) == (2.0, 8.5)
    assert d["speedup"] == pytest.approx(1.0 / 0.5) and hf["speedup"] == pytest.approx(0.5)
    assert spy["ar"].sequences == [[e] for e in range(N)] and spy["ar"].generated_tokens == TOKENS["ar"] * N
