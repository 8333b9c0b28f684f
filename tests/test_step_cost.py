"""The decode-cost experiments' pieces: the forward timer, bf16 linears, and the draft-tail upper bound."""

from __future__ import annotations

import torch

from experiments.draft_reuse import reusable
from experiments.step_cost import ForwardTimer, bf16_linears


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4, bias=False))


def test_forward_timer_counts_calls_and_passes_results_through() -> None:
    model = _mlp()
    x = torch.randn(3, 8)
    expected = model(x)
    timer = ForwardTimer(model)
    out = [model(x) for _ in range(3)]
    assert timer.calls == 3 and timer.seconds > 0
    assert all(torch.equal(o, expected) for o in out)
    timer.reset()
    assert (timer.calls, timer.seconds) == (0, 0.0)


def test_forward_timer_counts_a_failing_call() -> None:
    model = _mlp()
    timer = ForwardTimer(model)
    try:
        model(torch.randn(2, 5))  # wrong width
    except RuntimeError:
        pass
    assert timer.calls == 1


def test_bf16_linears_replace_every_linear_and_stay_close() -> None:
    model = _mlp()
    x = torch.randn(5, 8)
    ref = model(x)
    bf16_linears(model)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    out = model(x)
    assert out.dtype == torch.float32
    assert not torch.equal(out, ref)  # the products really ran in bf16
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_reusable_counts_the_tail_run_after_the_rejected_position() -> None:
    output = [1, 2, 3, 9, 4, 5, 6, 7]
    # Drafted at length 0: 1 2 3 accepted, 8 rejected (GR2 wrote 9); the next round
    # starts at 4, and the draft's tail 4 5 6 follows at alignment 0.
    assert reusable([1, 2, 3, 8, 4, 5, 6], 0, output) == 3
    # Drafted at length 2 (the response so far: 1 2): 3 accepted, 7 rejected; the tail 4 5 follows.
    assert reusable([3, 7, 4, 5], 2, output) == 2
    # Fully accepted drafts have no tail to reuse.
    assert reusable([1, 2], 0, output) is None
    # Nothing of the tail matches.
    assert reusable([1, 8, 8, 8], 0, output) == 0


def test_reusable_tries_shifted_alignments() -> None:
    # The draft skipped GR2's 9: its rejected 4 and what follows come right after GR2's 9 (alignment -1).
    assert reusable([1, 2, 3, 4, 5, 6], 0, [1, 2, 3, 9, 4, 5, 6]) == 3
    # The draft had an extra 0 before GR2's continuation (alignment +1): 1 rejected, 6 7 8 follow.
    assert reusable([1, 0, 6, 7, 8], 0, [5, 6, 7, 8, 9, 10]) == 3
    # Two extras (alignment +2); three would be out of reach.
    assert reusable([1, 0, 0, 6, 7], 0, [5, 6, 7, 8]) == 2
    assert reusable([1, 0, 0, 0, 6, 7], 0, [5, 6, 7, 8]) == 0
