"""The conditional verifiable reward: invalid < demotion < copy (0) < promotion."""

from __future__ import annotations

import polars as pl
import pytest

from gr2model.task.rerank_format import ItemText, ParsedResponse, build_response, parse_response
from gr2model.task.rewards import RewardConfig, rerank_reward

INCOMING = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]  # K = 10


@pytest.fixture(scope="module")
def items() -> ItemText:
    ids = list(range(10, 101, 10))
    return ItemText(
        pl.DataFrame(
            {"item_id": ids, "sid": [[i % 256, 1, 2, 3] for i in ids], "attributes": [[1] for _ in ids]},
            schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
        )
    )


def judged(ranking: list[int], items: ItemText) -> ParsedResponse:
    return parse_response(build_response(["why"], ranking, items), INCOMING, items)


def move(target: int, to: int) -> list[int]:
    """The incoming order with `target` moved to 0-based position `to`."""
    rest = [i for i in INCOMING if i != target]
    return rest[:to] + [target] + rest[to:]


def test_copying_the_incoming_order_earns_nothing_unless_target_first(items: ItemText) -> None:
    copy = judged(list(INCOMING), items)
    assert copy.copies_incoming
    for target in INCOMING[1:]:
        assert rerank_reward(copy, INCOMING, target) == 0.0
    # Already first and kept first: the perfect answer gets the format bonus.
    assert rerank_reward(copy, INCOMING, INCOMING[0]) == pytest.approx(0.2)


def test_promotion_is_positive_and_grows(items: ItemText) -> None:
    target = 70  # incoming position 6
    rewards = [rerank_reward(judged(move(target, to), items), INCOMING, target) for to in range(5, -1, -1)]
    assert all(r > 0 for r in rewards)
    assert rewards == sorted(rewards) and len(set(rewards)) == len(rewards)
    assert rewards[-1] == pytest.approx(6 / 10 + 0.2)  # position 6 -> 0
    assert rewards[0] == pytest.approx(1 / 10 + 0.2)  # position 6 -> 5


def test_demotion_is_negative_without_bonus(items: ItemText) -> None:
    target = 30  # incoming position 2
    rewards = [rerank_reward(judged(move(target, to), items), INCOMING, target) for to in range(3, 10)]
    assert all(r < 0 for r in rewards)
    assert rewards == sorted(rewards, reverse=True)
    assert rewards[-1] == pytest.approx(-7 / 10)
    # Demoting a first target loses the bonus as well.
    assert rerank_reward(judged(move(10, 1), items), INCOMING, 10) == pytest.approx(-0.1)


def test_other_items_moving_do_not_matter(items: ItemText) -> None:
    # The target keeps its place, others are shuffled: no promotion, no bonus.
    shuffled = [10, 20, 30, 40, 50, 100, 90, 80, 70, 60]
    assert rerank_reward(judged(shuffled, items), INCOMING, 40) == 0.0


def test_invalid_answers_get_the_penalty_below_any_valid_one(items: ItemText) -> None:
    bad = [
        parse_response("not json", INCOMING, items),
        judged(INCOMING[:-1], items),  # missing candidate
        judged(INCOMING[:-1] + [10], items),  # duplicate
    ]
    for p in bad:
        assert not p.valid_permutation
        assert rerank_reward(p, INCOMING, 50) == -1.0
    worst_valid = rerank_reward(judged(move(10, 9), items), INCOMING, 10)
    assert -1.0 < worst_valid < 0
    cfg = RewardConfig(format_bonus=0.5, invalid_penalty=-2.0)
    assert rerank_reward(bad[0], INCOMING, 50, cfg) == -2.0
    assert rerank_reward(judged(move(50, 0), items), INCOMING, 50, cfg) == pytest.approx(0.4 + 0.5)


def test_reward_refuses_inconsistent_inputs(items: ItemText) -> None:
    with pytest.raises(ValueError, match="not among"):
        rerank_reward(judged(list(INCOMING), items), INCOMING, 999)
    with pytest.raises(ValueError, match="permutation"):
        rerank_reward(judged(list(INCOMING), items), [10, 20], 10)
