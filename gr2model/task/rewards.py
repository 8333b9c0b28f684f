"""The conditional verifiable reward of re-ranking (GR2, used by `ar_rl` and `rl`).

GR2 observed that an LLM re-ranker trained with an unconditional format reward
learns to copy the incoming order: it is always valid, so it always collects the
format reward at no risk. The GR2 papers make the format reward conditional on
the ranking actually improving. What we could read of them (summaries, not the
full formula) gives the shape below; the constants are ours and configurable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gr2model.task.rerank_format import ParsedResponse

__all__ = ["RewardConfig", "rerank_reward"]


@dataclass(frozen=True)
class RewardConfig:
    """format_bonus: paid on top of the promotion term when the condition holds.
    invalid_penalty: the whole reward of an answer that is not a valid permutation."""

    format_bonus: float = 0.2
    invalid_penalty: float = -1.0


def rerank_reward(
    parsed: ParsedResponse, incoming: Sequence[int], target: int, cfg: RewardConfig = RewardConfig()
) -> float:
    """Reward of one judged answer.

    With K = len(incoming), p_in the target's 0-based position in the incoming
    order and p_out its position in the answer's ranking:

        invalid (not parsed.valid_permutation):  invalid_penalty
        otherwise:  (p_in - p_out) / K  +  format_bonus * [p_out < p_in  or  p_in == p_out == 0]

    So: promoting the target earns the promotion plus the bonus (more the further
    it moves up); demoting it is negative and earns no bonus; keeping it where it
    was earns 0, in particular copying the incoming order earns 0, unless the
    target was already first and stays first, the one case where no promotion is
    possible and the answer is perfect (withholding the bonus there would teach
    the model to demote a correct first item). The promotion term lies in
    (-1, 1), so with invalid_penalty <= -1 and a non-negative bonus every valid
    answer scores above every invalid one.

    Args:
        parsed: the answer judged against `incoming` by `parse_response`.
        incoming: the K candidate ids in the pre-rank order.
        target: the item the user actually chose; must be among the candidates
            (only such examples are re-ranking examples).
    Raises:
        ValueError: target not among the candidates, or a valid ranking that is
            not a permutation of `incoming` (judged against other candidates).
    """
    incoming = [int(i) for i in incoming]
    if target not in incoming:
        raise ValueError(f"target {target} is not among the candidates; no re-ranking reward exists")
    if not parsed.valid_permutation:
        return float(cfg.invalid_penalty)
    if sorted(parsed.ranking) != sorted(incoming):
        raise ValueError("parsed ranking is not a permutation of these candidates")
    k = len(incoming)
    p_in = incoming.index(target)
    p_out = parsed.ranking.index(target)
    reward = (p_in - p_out) / k
    if p_out < p_in or p_in == p_out == 0:
        reward += cfg.format_bonus
    return float(reward)
