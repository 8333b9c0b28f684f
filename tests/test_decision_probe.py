"""The lever probe's scoring: promoting one candidate, the rest in the incoming order."""

from __future__ import annotations

import numpy as np

from experiments.decision_probe import PREFIX, answer, ranks_after_promotion
from gr2model.task.rerank_format import FormatConfig, ItemText, parse_response, target_ranks

import polars as pl


def test_ranks_after_promotion_match_the_parsed_ranking() -> None:
    k = 5
    cands = [10, 20, 30, 40, 50]
    items = ItemText(pl.DataFrame({"item_id": cands, "sid": [[c, 0, 0, 0] for c in cands], "attributes": [[] for _ in cands]}))
    fmt = FormatConfig(answer="index")
    promoted, incoming = np.array([f for f in range(1, k + 1) for _ in range(k)]), np.array(list(range(k)) * k)
    # The probe's answer text, judged by the shared parser, puts each target where the shortcut says.
    parsed = [parse_response(answer(int(f), cands, items, fmt), cands, items, fmt=fmt) for f in promoted]
    assert all(p.valid_permutation for p in parsed)
    # The decision the probe reads is the token right after PREFIX.
    assert all(answer(f, cands, items, fmt).startswith(f"{PREFIX} <pos_{f}> ") for f in range(1, k + 1))
    expected = target_ranks(parsed, [cands[i] for i in incoming])
    np.testing.assert_array_equal(ranks_after_promotion(promoted, incoming), expected)
