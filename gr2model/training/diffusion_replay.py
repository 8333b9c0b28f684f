"""Replay of block-diffusion decodes: each committed token scored on the canvas it was committed from.

On-policy distillation (`gr2model.training.opd`) and RL of the diffusion policy
(`gr2model.training.diffusion_rl`) need, under the current weights and with gradients,
the student's distribution at every response position *as the decoder saw it*:
the threshold decoder (`gr2model.decoding.diffusion_decode`) committed the token at
response position s in some forward t, given the prompt, the finished blocks
before s's block, and that block's canvas at t (the tokens of the block
committed at steps < t, the mask token elsewhere). That is the central design
decision of both trainers, and this module makes it exact and cheap.

What a decode step sees, and how a training row reproduces it
-------------------------------------------------------------
In one forward of the decoder, block k's position i >= 1 is predicted by the
logits of canvas position i-1 (which attends the prompt, the finished blocks
< k, and the whole canvas), and position 0 by the last token of the finished
block k-1 (the last prompt token for k = 0), computed once when block k-1 was
finished and reused for every step of block k (the token shift of
`gr2model.models.block_diffusion`). CFT's training layout (`gr2model.training.cft`) computes
exactly these: a noisy block k attends the prompt, the clean blocks < k and
itself; clean block k-1's last column gives position 0. And nothing attends a
noisy block but itself, so the blocks of one noisy copy are independent: one
copy can hold a *different* step's canvas in every block.

So, per trajectory, number the steps that committed something inside each
block (the j-th distinct commit step of block k, j = 0, 1, ...); noisy copy j
holds, in every block k, the canvas of block k before its j-th step, and the
tokens committed at that step are its targets, read at `prediction_sources`.
A trajectory needs R = max over blocks of (steps in the block) copies, not one
forward per decode step. Copies are packed side by side in one row (cft's
layout generalised to several noisy copies: `training_attention_mask(...,
copies=...)`), at most `max_copies` per row:

    [prompt (p) | canvas copy 0 (L) | ... | canvas copy c-1 (L) | clean response (L)]

Cost (per trajectory of a p-token prompt and an L-token response, L rounded up
to whole blocks, R canvases): ceil(R / max_copies) rows of p + (c + 1) L
columns, one forward and one backward, against the decode's NFE cached
forwards (over B or 2B tokens each). Packing saves the repeated prompt and
clean copy (linear layers: p + (R + 1) L tokens instead of R (p + 2 L)), but
the dense mask makes attention quadratic in the row width, so very wide rows
cost more than they save; `max_copies` caps the width. Measured (CPU, 1
thread, on the 2-core machine shared with a training job: +-20% noise; the
pipeline's model size, hidden 128, 2 layers, vocab 2,000; p = 200, L = 320,
B = 32; two trajectories whose blocks all take R steps; seconds for one
forward + backward, median of 3):

    R    max_copies:  1      2      4      8      all   (rows x width at 4)
    1                 0.19   0.15   0.19   0.23   0.21  (2 x 840: one layout, noise)
    4                 0.94   0.76   0.88   0.88   0.81  (2 x 1,800)
    8                 2.11   1.54   1.53   1.67   2.03  (4 x 1,800)
    16                4.51   4.08   3.76   4.01   5.91  (8 x 1,800)

so DEFAULT_MAX_COPIES = 4: 1.2-1.4x faster than one row per canvas (cft's
layout as is) from R = 8 on, and no quadratic blow-up. On a GPU the balance
may differ (attention is cheaper there); it is a knob of both trainers. The
masks of a trajectory's rows are identical and built once (that cut the
batch construction from ~10% of a step to ~1%).

The alternative is an approximation: score the whole response from one
canvas (e.g. one random CFT-style mask, or the all-clean context), i.e. one
row of p + 2 L instead of ceil(R / 4) rows of p + 5 L. It is cheaper by
about R / 2 at R >= 8, but the log-probs are then those of contexts the
decoder never saw: RL's importance ratios would not be 1 on-policy (the
clipped ratio would clip noise instead of policy change) and OPD would
distil the teacher into states the student does not visit. We pay the exact
replay. Against the decode of the same two trajectories (same setting as
the table, no eos): a block per forward (NFE 10, R = 1), decode 0.09 s,
replay forward 0.06 s, forward + backward 0.22 s; one token per forward
(NFE 320, R = 32), decode 1.2-1.7 s, replay forward 1.4 s, forward +
backward 4.2 s. So scoring a trajectory exactly costs about one more decode,
and its update about three.

Alignment with the decoder, checked by tests/test_diffusion_replay.py:
- the last block keeps its B slots; positions past `max_new_tokens` are never
  committed and stay mask tokens in every canvas (they are in the decoder's);
- positions after the eos are never proposed once the eos is committed, but
  the decoder may commit one of them *before* the eos (e.g. a block-padding
  eos). Such a token is cut from the sequence, yet it was on the canvas of
  every later step of its block, so the decoder's trace returns it
  (`tail_tokens`); the replay puts it on the canvases, and scores it only
  with `include_tail` (RL: it is an action of the policy that conditioned the
  later ones; OPD: it has no teacher target, it is outside the response);
- a prompt starts at column 0 with position 0 in every row; the decoder's left
  padding gives the same position ids and pads are never attended, so the
  logits are the same up to float rounding (atol 1e-5 in float32);
- sub-block decoding (`sub_block_size`) changes which positions a step may
  commit, not what the step sees: the forward still covers the whole block,
  so the same canvases replay it exactly and nothing here depends on S.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gr2model.training.cft import prediction_sources, training_attention_mask, training_position_ids
from gr2model.decoding.diffusion_decode import DiffusionDecodeOutput
from gr2model.training.sft import IGNORE_INDEX

__all__ = [
    "DEFAULT_MAX_COPIES",
    "Trajectory",
    "trajectories_from_decode",
    "replay_plan",
    "replay_columns",
    "split_by_columns",
    "build_replay_batch",
    "replay_logits",
    "replay_logprobs",
]

DEFAULT_MAX_COPIES = 4


@dataclass(frozen=True)
class Trajectory:
    """One decoded response and how it was decoded.

    Attributes:
        prompt: the p prompt ids (p >= 1).
        tokens: the response as the decoder left it: the sequence (cut after its
            eos, `length` tokens) followed by the rest of its last block (the
            decoder's `tail_tokens`; mask_id where never committed).
        steps: per token, the decoder's commit step (`steps` then `tail_steps`);
            -1 where never committed (tail only).
        length: how many of `tokens` are the sequence (the response proper).
        logprobs: optionally, per token, the decoder's log-prob (`logprobs` then
            `tail_logprobs`; 0.0 where never committed).
    """

    prompt: list[int]
    tokens: list[int]
    steps: list[int]
    length: int
    logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.steps) or not 0 <= self.length <= len(self.tokens):
            raise ValueError("tokens and steps must align and length must be within them")
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError("logprobs must align with tokens")
        if any(s < 0 for s in self.steps[: self.length]):
            raise ValueError("every token of the sequence has a commit step")
        if not self.prompt:
            raise ValueError("empty prompt")

    @property
    def response(self) -> list[int]:
        """The sequence the decoder returned (eos included when emitted)."""
        return self.tokens[: self.length]

    @property
    def committed(self) -> int:
        """Tokens with a commit step: the sequence and any committed tail (what a replay scores)."""
        return sum(1 for s in self.steps if s >= 0)

    @property
    def forwards(self) -> int:
        """Decoder forwards that committed this row's tokens (each forward commits at least
        one token of every row it carries, so committed / forwards is tokens per forward)."""
        return len({s for s in self.steps if s >= 0})

    def canvases(self, block_size: int, include_tail: bool) -> int:
        """R: canvases a replay of this trajectory needs, the most distinct commit steps
        among the scored tokens of any block (the sequence, plus the committed tail
        with include_tail); 0 when nothing is scored."""
        scored: dict[int, set[int]] = {}
        for pos, step in enumerate(self.steps):
            if step >= 0 and (pos < self.length or include_tail):
                scored.setdefault(pos // block_size, set()).add(step)
        return max((len(v) for v in scored.values()), default=0)


def trajectories_from_decode(prompts: Sequence[Sequence[int]], out: DiffusionDecodeOutput) -> list[Trajectory]:
    """The trajectories of a `diffusion_generate(..., return_trace=True)` call, one per prompt.

    Log-probs are attached when the decode also had `return_logprobs`.
    """
    if out.steps is None or out.tail_tokens is None or out.tail_steps is None:
        raise ValueError("decode with return_trace=True to replay")
    if len(prompts) != len(out.sequences):
        raise ValueError(f"{len(prompts)} prompts but {len(out.sequences)} sequences")
    trajs = []
    for i, prompt in enumerate(prompts):
        logprobs = None
        if out.logprobs is not None and out.tail_logprobs is not None:
            logprobs = list(out.logprobs[i]) + list(out.tail_logprobs[i])
        trajs.append(
            Trajectory(
                prompt=list(prompt),
                tokens=list(out.sequences[i]) + list(out.tail_tokens[i]),
                steps=list(out.steps[i]) + list(out.tail_steps[i]),
                length=len(out.sequences[i]),
                logprobs=logprobs,
            )
        )
    return trajs


def _padded(traj: Trajectory, block_size: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens and steps (L,) long, padded to whole blocks with mask_id / -1 (never committed)."""
    n = len(traj.tokens)
    L = math.ceil(n / block_size) * block_size
    tok = torch.full((L,), mask_id, dtype=torch.long)
    st = torch.full((L,), -1, dtype=torch.long)
    tok[:n] = torch.as_tensor(traj.tokens, dtype=torch.long)
    st[:n] = torch.as_tensor(traj.steps, dtype=torch.long)
    return tok, st


def _targets(traj: Trajectory, steps: torch.Tensor, include_tail: bool) -> torch.Tensor:
    """(L,) bool: the committed positions to score (the sequence, plus the committed tail)."""
    pos = torch.arange(len(steps))
    return (steps >= 0) & ((pos < traj.length) | include_tail)


def replay_plan(steps: torch.Tensor, targets: torch.Tensor, block_size: int) -> torch.Tensor:
    """The canvases to replay: per canvas j and block k, the step whose canvas it is.

    Args:
        steps: (L,) long commit step of each response position (-1: never),
            L a multiple of block_size.
        targets: (L,) bool, the positions to score.
        block_size: B.
    Returns:
        (R, L // B) long: entry (j, k) is the j-th smallest distinct step that
        committed a target in block k, or -1 when block k has fewer than j + 1;
        R = the most such steps of any block (0 when there is no target). Steps
        that committed only non-targets need no canvas: a canvas is defined by
        its step (every token committed before it), not by its index.
    """
    n_blocks = len(steps) // block_size
    per_block = [
        torch.unique(steps[k * block_size : (k + 1) * block_size][targets[k * block_size : (k + 1) * block_size]])
        for k in range(n_blocks)
    ]
    rows = max((len(u) for u in per_block), default=0)
    plan = torch.full((rows, n_blocks), -1, dtype=torch.long)
    for k, u in enumerate(per_block):
        plan[: len(u), k] = u  # torch.unique sorts
    return plan


def replay_columns(
    traj: Trajectory, *, block_size: int, include_tail: bool = False, max_copies: int = DEFAULT_MAX_COPIES
) -> int:
    """Columns (tokens) of the replay rows of one trajectory, without building them.

    R canvases in ceil(R / c) rows of p + (copies + 1) L columns (c = max_copies,
    or R when <= 0); 0 when nothing is scored.
    """
    L = math.ceil(len(traj.tokens) / block_size) * block_size
    R = traj.canvases(block_size, include_tail)
    if R == 0:
        return 0
    chunk = R if max_copies <= 0 else max_copies
    full, rest = divmod(R, chunk)
    return full * (len(traj.prompt) + (chunk + 1) * L) + (len(traj.prompt) + (rest + 1) * L if rest else 0)


def split_by_columns(columns: Sequence[int], max_columns: int) -> list[list[int]]:
    """Consecutive parts of items whose summed columns stay within `max_columns`.

    For gradient accumulation over a minibatch: one forward per part bounds
    the width of a replay batch (on a CPU a wide batch is slower per column,
    see `gr2model.training.opd.OPDConfig.micro_batch_columns`). An item wider than the
    budget gets a part of its own; max_columns <= 0 gives one part.

    Args:
        columns: the columns of each item, in order (`replay_columns`).
    Returns:
        lists of item indices (0-based), in order, covering every item once.
    """
    if max_columns <= 0:
        return [list(range(len(columns)))] if len(columns) else []
    parts: list[list[int]] = []
    used = 0
    for i, c in enumerate(columns):
        if parts and used + c <= max_columns:
            parts[-1].append(i)
            used += c
        else:
            parts.append([i])
            used = c
    return parts


def build_replay_batch(
    trajectories: Sequence[Trajectory],
    *,
    block_size: int,
    mask_id: int,
    pad_id: int,
    include_tail: bool = False,
    max_copies: int = DEFAULT_MAX_COPIES,
) -> dict[str, torch.Tensor]:
    """The training rows that replay every canvas of the trajectories (module docstring).

    Args:
        trajectories: N decoded trajectories (a trajectory with nothing to score
            gives no row).
        block_size, mask_id, pad_id: the decoder's B and ids.
        include_tail: also score the committed tail tokens (positions after the
            eos that were committed before it).
        max_copies: most canvases per row (<= 0: all of a trajectory's in one row).
    Returns (R rows, T = the widest row):
        input_ids: (R, T) long, [prompt, canvases, clean response, pad_id...].
        position_ids: (R, T) long, attention_mask: (R, 1, T, T) bool (cft's
            layout with `copies` noisy copies).
        targets: (R, T) long, the token the logits of each column must score
            (token shift applied), IGNORE_INDEX elsewhere; every scored
            position of every trajectory appears exactly once.
        target_traj, target_pos: (R, T) long, the trajectory index and response
            position of each target, -1 elsewhere.
        copies: (R,) long, canvases per row.
        n_tokens: () long, non-pad columns.
    """
    bsz = block_size
    # Per row: prompt, its canvases (c L,), the clean response (L,), c, the
    # trajectory index, the response tokens (L,), the scored positions (c, L).
    rows: list[tuple[list[int], torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor]] = []
    for n, traj in enumerate(trajectories):
        tok, st = _padded(traj, bsz, mask_id)
        want = _targets(traj, st, include_tail)
        plan = replay_plan(st, want, bsz)  # (R, n_blocks)
        if plan.shape[0] == 0:
            continue
        thr = plan.repeat_interleave(bsz, dim=1)  # (R, L): the canvas step of each position
        committed = st >= 0
        canvases = torch.where(committed & (st < thr), tok, mask_id)
        scored = want & (st == thr) & (thr >= 0)
        clean = torch.where(committed, tok, mask_id)
        chunk = plan.shape[0] if max_copies <= 0 else max_copies
        for j0 in range(0, plan.shape[0], chunk):
            c = min(chunk, plan.shape[0] - j0)
            rows.append((traj.prompt, canvases[j0 : j0 + c].reshape(-1), clean, c, n, tok, scored[j0 : j0 + c]))
    if not rows:
        raise ValueError("no position to score in these trajectories")
    p = torch.tensor([len(r[0]) for r in rows], dtype=torch.long)
    L = torch.tensor([len(r[2]) for r in rows], dtype=torch.long)
    copies = torch.tensor([r[3] for r in rows], dtype=torch.long)
    width = int((p + (copies + 1) * L).max())
    R = len(rows)
    out = {
        "input_ids": torch.full((R, width), pad_id, dtype=torch.long),
        "targets": torch.full((R, width), IGNORE_INDEX, dtype=torch.long),
        "target_traj": torch.full((R, width), -1, dtype=torch.long),
        "target_pos": torch.full((R, width), -1, dtype=torch.long),
    }
    for r, (prompt, noisy, clean, c, n, tok, scored) in enumerate(rows):
        np_, nl = len(prompt), len(clean)
        out["input_ids"][r, :np_] = torch.as_tensor(prompt, dtype=torch.long)
        out["input_ids"][r, np_ : np_ + c * nl] = noisy
        out["input_ids"][r, np_ + c * nl : np_ + (c + 1) * nl] = clean
        for j in range(c):
            pos = scored[j].nonzero().squeeze(-1)
            src = prediction_sources(np_, nl, bsz, copy=j, copies=c)[pos]
            out["targets"][r, src] = tok[pos]
            out["target_traj"][r, src] = n
            out["target_pos"][r, src] = pos
    out["position_ids"] = training_position_ids(p, L, width, copies)
    # Rows of one trajectory share (p, L, copies), hence their mask: build each
    # distinct mask once (the (R, T, T) construction is ~10% of a CPU step otherwise).
    shapes, inverse = torch.unique(torch.stack([p, L, copies], dim=1), dim=0, return_inverse=True)
    out["attention_mask"] = training_attention_mask(shapes[:, 0], shapes[:, 1], bsz, width, shapes[:, 2])[inverse]
    out["copies"] = copies
    out["n_tokens"] = (p + (copies + 1) * L).sum()
    return out


def replay_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logits of every replayed target, in one forward (gradients flow).

    Only the K target columns get logits (`logits_to_keep` with the (R, T)
    boolean mask), in row-major order.

    Args:
        model: the block-diffusion policy (any causal LM taking a 4D boolean
            mask, position ids and a boolean logits_to_keep).
        batch: `build_replay_batch`'s output, on the model's device.
    Returns:
        logits: (K, V) as the model returns them.
        targets, traj, pos: (K,) long, the scored token, its trajectory and its
            response position.
    """
    keep = batch["targets"] != IGNORE_INDEX
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=keep,
    )
    return {
        "logits": out.logits,
        "targets": batch["targets"][keep],
        "traj": batch["target_traj"][keep],
        "pos": batch["target_pos"][keep],
    }


def replay_logprobs(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    *,
    block_size: int,
    mask_id: int,
    pad_id: int,
    include_tail: bool = False,
    max_copies: int = DEFAULT_MAX_COPIES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the trajectories' committed tokens under `model`, each on its own canvas.

    The counterpart of `gr2model.training.dapo.sequence_logprobs` for the diffusion
    policy: log_softmax of the raw logits (temperature 1, the full vocabulary,
    as the decoder's `return_logprobs`). Gradients flow (wrap in
    `torch.no_grad()` for old log-probs).

    Returns:
        logp: (N, W) float32, aligned with each trajectory's `tokens` (W = the
            longest scored span: `length`, or all of `tokens` with
            include_tail); 0 where nothing is scored.
        mask: (N, W) float32, 1 on scored positions.
    """
    device = next(model.parameters()).device
    n = len(trajectories)
    width = max((len(t.tokens) if include_tail else t.length for t in trajectories), default=0)
    if width == 0 or all(t.length == 0 and not include_tail for t in trajectories):
        empty = torch.zeros((n, width), device=device)
        return empty, empty.clone()
    batch = build_replay_batch(
        trajectories, block_size=block_size, mask_id=mask_id, pad_id=pad_id, include_tail=include_tail,
        max_copies=max_copies,
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    got = replay_logits(model, batch)
    logits = got["logits"].float()
    lp = logits.gather(-1, got["targets"][:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    index = got["traj"] * width + got["pos"]
    logp = torch.zeros(n * width, device=device, dtype=lp.dtype).index_add(0, index, lp)
    mask = torch.zeros(n * width, device=device).index_add(0, index, torch.ones_like(lp))
    return logp.view(n, width), mask.view(n, width)
