"""On-policy distillation (OPD) of the AR teacher GR2 into the block-diffusion student.

The student (from the CFT checkpoint) decodes training prompts with its real
decoder (`gr2model.decoding.diffusion_decode`: block KV cache, threshold rule, sampling
temperature `OPDConfig.temperature`), `rollouts_per_prompt` rollouts per
prompt. The frozen AR teacher scores the same response tokens in one causal
forward per rollout, and the student is trained toward the teacher's
per-token distributions on its own tokens: the states it visits, not the
teacher's (which is what CFT trained on).

Alignment: both sides keep the AR token shift. The teacher's distribution for
response position s is its logits at the token before s (prompt + response[:s]);
the student's is the distribution it committed s from, i.e. the canvas of the
decode step that committed s (`gr2model.training.diffusion_replay`: position s read from
canvas position s-1, or from the finished previous block for a block's first
position). Both are per response position s, so the KL compares the two
models' next-token distributions at the same response position.

The student's distribution: the exact canvas, not an approximation
--------------------------------------------------------------------
How the student's per-token distribution on its own trajectory is obtained
is the design decision that sets the cost. We replay the canvases
(`gr2model.training.diffusion_replay`): each token is scored given exactly what the
decoder saw when it committed it (the tokens of its block committed at
earlier steps, masks elsewhere), with gradients; a trajectory costs
R = max over blocks of (decode steps in the block) canvases, packed up to
`max_copies` per row [prompt | canvases | clean response], instead of one
forward per decode step. Measured (diffusion_replay's docstring, pipeline
model size, p = 200, L = 320, B = 32): a replay forward costs about one decode
of the same trajectories, forward + backward about three. One whole OPD step
(CPU, 1 thread, 8 rollouts of 2 prompts of 200 tokens, up to 320 new tokens,
B = 32, the student a converted random model):

    decode                          rollouts   teacher   update   canvases per rollout
    a block per forward (thr 0)     0.36 s     0.14 s    0.90 s   1
    a token per forward (thr 0.9)   6.9 s      0.15 s    13.5 s   32

(diffusion RL's update: 0.81 s and 17.8 s on the same rollouts). A CFT
model sits in between (CFT's toy test: ~2.4 tokens per forward at B = 4).
The cheaper
approximation, one CFT-style row with a random mask (or the all-clean
context), is ~R/2 times cheaper at R >= 8 but distils the teacher into
contexts the decoder never visits, which is what OPD is meant to avoid.

Loss
----
Per response position, with p_T the teacher's and p_S the student's
distribution over the vocabulary (raw softmax, temperature 1, mask token
included: the decoder bans it, but both models give it ~0 mass):

    forward (default, as Diffusion-GR2):  KL(p_T || p_S) = sum_v p_T(v) log(p_T(v) / p_S(v))
    reverse (the GR2 technical report):   KL(p_S || p_T) = sum_v p_S(v) log(p_S(v) / p_T(v))

both computed exactly over the vocabulary (no sampled estimate: the full
distributions are at hand, so the reverse KL's gradient needs no policy
gradient). The loss is the token-level mean over all response tokens of the
global batch (as DAPO's: a long response weighs in proportion to its length).
Forward KL is mass-covering (the student must put mass wherever the teacher
does: it keeps the teacher's alternatives); reverse KL is mode-seeking (the
student may drop teacher modes it cannot fit, and is punished hardest for
mass where the teacher has none).

Teacher logits: full or top-k
-----------------------------
The teacher runs once per rollout (one causal forward over prompt + response,
under no_grad) right after the rollouts, and its log-probs are kept for the
step's `inner_epochs` passes. `teacher_top_k = 0` keeps the full (L, V)
float32 log-probs. `teacher_top_k = k > 0` keeps the teacher's k most likely
tokens and a "rest" bucket holding the remaining mass, and the KL is computed
between the two coarse-grained distributions over {top-k tokens, rest}
(`teacher_topk`, `topk_token_kl`): a proper KL (>= 0, 0 when the models
agree), a lower bound on the full KL (coarse-graining never increases a KL),
tight when the teacher's mass is in its top k; the student's rest mass is
exact (a logsumexp over the other logits), so the student is still pushed
off tokens the teacher rules out. Measured (CPU, 1 thread, pipeline model
size, vocab 2,000, 16 rollouts of p = 200, L = 320):

    teacher_top_k   teacher forward   kept     KL forward + backward (5,120 tokens)
    0 (full)        0.34 s            39 MB    0.48 s
    64              0.62 s            3.8 MB   0.34 s

Both are small next to the replay (seconds per rollout at B = 32), so the
default is full: the exact loss, for 39 MB per 16 rollouts at this
vocabulary. Top-k is for a large vocabulary (a real pretrained LM), where
full log-probs would not fit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.models.block_diffusion import decoding_ids
from gr2model.bounds import check
from gr2model.training.kl import KLKind, kl_terms, token_kl
from gr2model.training.dapo import RewardFn, zero_grad_forward, response_logits, shuffled_minibatches, start_policy_run
from gr2model.decoding.diffusion_decode import check_sub_block_size, diffusion_generate
from gr2model.training.diffusion_replay import (
    DEFAULT_MAX_COPIES,
    Trajectory,
    build_replay_batch,
    replay_columns,
    replay_logits,
    split_by_columns,
    trajectories_from_decode,
)
from gr2model.training.resume import Checkpointer

__all__ = [
    "KLKind",
    "OPDConfig",
    "OPDResult",
    "token_kl",
    "teacher_topk",
    "topk_token_kl",
    "opd_loss",
    "teacher_targets",
    "train_opd",
]

# ------------------------------------------------------------------ pure parts


def teacher_topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely tokens and the log-mass of all the others.

    Args:
        teacher_logits: (..., V) raw logits.
        k: 1 <= k <= V.
    Returns:
        logprobs: (..., k + 1) float32: log p_T of the top k tokens (normalised
            over the full vocabulary), then log p_T(rest) (-inf when k = V),
            computed as a logsumexp over the other logits (no 1 - sum cancellation).
        ids: (..., k) long, the top k token ids.
    """
    vocab = teacher_logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"need 1 <= k <= {vocab}, got {k}")
    log_t = torch.log_softmax(teacher_logits.float(), dim=-1)
    top, ids = log_t.topk(k, dim=-1)
    rest = torch.logsumexp(log_t.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([top, rest], dim=-1), ids


def topk_token_kl(
    student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, teacher_ids: torch.Tensor, kind: KLKind = "forward"
) -> torch.Tensor:
    """Per-token KL between the coarse-grained distributions over {teacher's top k, rest}.

    The student's probabilities of the teacher's top-k tokens come from its
    full softmax; its rest bucket is the exact mass of every other token. No
    renormalisation over the top k: the rest bucket keeps both sides proper
    distributions, so the KL is >= 0, is 0 when the models agree, equals the
    full KL when k = V, and is never above the full KL otherwise.

    Args:
        student_logits: (..., V) raw logits (gradients flow).
        teacher_logprobs: (..., k + 1) from `teacher_topk`.
        teacher_ids: (..., k) from `teacher_topk`.
        kind: "forward" or "reverse" (see `token_kl`).
    Returns:
        (...) float32.
    """
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    top = log_s.gather(-1, teacher_ids)
    rest = torch.logsumexp(log_s.scatter(-1, teacher_ids, float("-inf")), dim=-1, keepdim=True)
    coarse_s = torch.cat([top, rest], dim=-1)
    coarse_t = teacher_logprobs.float()
    if kind == "forward":
        return kl_terms(coarse_t, coarse_s)
    if kind == "reverse":
        return kl_terms(coarse_s, coarse_t)
    raise ValueError(f"kind must be 'forward' or 'reverse', got {kind!r}")


def opd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    kind: KLKind = "forward",
    top_k: int = 0,
) -> torch.Tensor:
    """The OPD loss: the per-token KL averaged over the valid tokens (token-level mean).

    Args:
        student_logits: (N, T, V) or (K, V) student logits at the response
            positions (gradients flow).
        teacher_logits: the same shape, the teacher's logits at the same
            positions (same token shift).
        mask: (N, T) or (K,), 1 on response tokens, 0 on padding.
        kind: "forward" KL(teacher || student) (default) or "reverse".
        top_k: 0 for the full distributions; k > 0 for the teacher's top-k
            tokens plus a rest bucket (`topk_token_kl`).
    Returns:
        scalar float32: sum(mask * KL) / sum(mask); 0 (zero gradient) without tokens.
    """
    if top_k > 0:
        logprobs, ids = teacher_topk(teacher_logits, top_k)
        kl = topk_token_kl(student_logits, logprobs, ids, kind)
    else:
        kl = token_kl(student_logits, teacher_logits, kind)
    m = mask.float()
    return (kl * m).sum() / m.sum().clamp(min=1.0)


@torch.no_grad()
def teacher_targets(
    teacher: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    top_k: int = 0,
) -> list[tuple[torch.Tensor, ...]]:
    """The teacher's distribution at every response position, one causal forward per batch.

    Args:
        teacher: the AR model (causal mask; `gr2model.training.dapo.response_logits`).
        prompts, responses: N prompts and the student's N responses (eos included).
        pad_id: padding id.
        top_k: 0 keeps the full log-probs; k > 0 keeps `teacher_topk`.
    Returns:
        per response: (log_probs (L_i, V),) with top_k = 0, else
        (logprobs (L_i, k + 1), ids (L_i, k)); float32 on the teacher's device.
    """
    logits, _, mask = response_logits(teacher, [list(p) for p in prompts], [list(r) for r in responses], pad_id)
    out: list[tuple[torch.Tensor, ...]] = []
    for i, r in enumerate(responses):
        row = logits[i, : len(r)].float()
        out.append((torch.log_softmax(row, dim=-1),) if top_k <= 0 else teacher_topk(row, top_k))
    return out


# ---------------------------------------------------------------------- config


@dataclass(frozen=True)
class OPDConfig:
    """Knobs of on-policy distillation.

    rollouts_per_prompt: student decodes per prompt (sampled at `temperature`).
    prompts_per_step: prompts per step (global, over all processes).
    steps: update steps, each with its own rollouts.
    inner_epochs: gradient passes over each step's rollouts (the teacher's
        log-probs are computed once and reused).
    minibatch_size: rollouts per optimizer step (global).
    lr, weight_decay: AdamW (constant lr).
    kind: "forward" KL(teacher || student) (default) or "reverse".
    teacher_top_k: 0 keeps the teacher's full distributions; k > 0 its top k
        plus a rest bucket (module docstring).
    threshold: the decoder's commit threshold (as at inference).
    sub_block_size: the decoder's sub-block size for the rollouts (None: whole
        blocks; else >= 1 and a divisor of the student's block size, checked
        when training starts). The replay needs nothing else: a sub-block step
        still sees its whole block's canvas (`gr2model.decoding.diffusion_decode`).
    temperature: sampling temperature of the rollouts (> 0; 0 decodes greedily).
    max_new_tokens: response length limit.
    max_copies: canvases per replay row (`gr2model.training.diffusion_replay`).
    micro_batch_columns: the most replay columns (tokens) per forward/backward
        inside a minibatch (`split_by_columns`; gradients accumulate: the
        optimizer step is the same); <= 0: the whole minibatch at once. A
        rollout's replay grows with its canvases (up to B), and a CPU slows
        down on wide batches: for 8 worst-case rollouts (pipeline model size,
        B = 32, one token per forward, R = 32: 8 rows of ~1,440 columns each,
        11,520 per rollout), the update took 6.2x the rollouts' decode time in
        one forward, 3.1x in parts of 4 rollouts, 1.9x in parts of 2 and 1.85x
        one by one (one run each, shared machine); while tiny rollouts
        (tests) run 5x slower one by one than together. 16,384 columns keeps
        a worst-case rollout alone and packs short ones. On a GPU a larger
        budget should pay; it is a knob.
    seed: prompt order and sampling.
    grad_clip: max global gradient norm (<= 0 disables).
    cft_weight: every optimizer step also trains CFT's loss on GR2's trajectories
        at this weight beside the KL (`train_opd(anchor=...)`,
        `gr2model.training.cft.CFTAnchor`): the student learns from its own
        rollouts without unlearning the structure CFT taught it. 0: KL only.
    cft_batch_size: trajectories of that loss per optimizer step (global).
    """

    rollouts_per_prompt: int = 4
    prompts_per_step: int = 8
    steps: int = 50
    inner_epochs: int = 1
    minibatch_size: int = 16
    lr: float = 5e-5
    weight_decay: float = 0.0
    kind: KLKind = "forward"
    teacher_top_k: int = 0
    threshold: float = 0.9
    sub_block_size: int | None = None
    temperature: float = 1.0
    max_new_tokens: int = 320
    max_copies: int = DEFAULT_MAX_COPIES
    micro_batch_columns: int = 16_384
    seed: int = 0
    grad_clip: float = 1.0
    cft_weight: float = 0.0
    cft_batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("rollouts_per_prompt", "prompts_per_step", "steps", "inner_epochs", "minibatch_size",
                     "max_new_tokens", "max_copies", "cft_batch_size"):
            check(self, name, ge=1)
        if self.kind not in ("forward", "reverse"):
            raise ValueError(f"kind must be 'forward' or 'reverse', got {self.kind!r}")
        check(self, "lr", gt=0)
        # temperature 0 is allowed: the rollouts then decode greedily.
        for name in ("weight_decay", "teacher_top_k", "temperature", "seed", "cft_weight"):
            check(self, name, ge=0)
        # A confidence threshold: 0 commits every proposal, 1 only certain ones.
        check(self, "threshold", ge=0, le=1)
        # Divisibility by the student's block size is checked when training starts (the block is the checkpoint's).
        check(self, "sub_block_size", ge=1, optional=True)
        for name in ("micro_batch_columns", "grad_clip"):
            check(self, name)  # any finite value: <= 0 means "whole minibatch" / "no clipping"


@dataclass
class OPDResult:
    """model: the trained student (unwrapped, eval mode).
    history: the per-step metric dicts passed to on_step."""

    model: PreTrainedModel
    history: list[dict[str, float]] = field(default_factory=list)


# ----------------------------------------------------------------------- train


def _gather_teacher(
    targets: list[tuple[torch.Tensor, ...]], traj: torch.Tensor, pos: torch.Tensor
) -> list[torch.Tensor]:
    """The teacher rows of K (trajectory, position) pairs, one tensor per stored field (K, ...)."""
    lengths = torch.tensor([t[0].shape[0] for t in targets], device=traj.device)
    offsets = torch.cumsum(lengths, 0) - lengths
    index = offsets[traj] + pos
    return [torch.cat([t[f] for t in targets]).to(traj.device)[index] for f in range(len(targets[0]))]


def _replay_kl(
    model: torch.nn.Module,
    trajs: list[Trajectory],
    targets: list[tuple[torch.Tensor, ...]],
    cfg: OPDConfig,
    block_size: int,
    mask_id: int,
    pad_id: int,
    device: torch.device,
    accelerator: Accelerator,
    tally: list[float] | None,
) -> torch.Tensor:
    """(K,) per-token KL of the trajectories' response tokens, student from the replay (with grad).

    tally: when given, += [canvases, rows, columns] of the replay batch."""
    batch = build_replay_batch(trajs, block_size=block_size, mask_id=mask_id, pad_id=pad_id, max_copies=cfg.max_copies)
    if tally is not None:
        tally[0] += float(batch["copies"].sum())
        tally[1] += float(batch["copies"].numel())
        tally[2] += float(batch["n_tokens"])
    batch = {k: v.to(device) for k, v in batch.items()}
    with accelerator.autocast():
        got = replay_logits(model, batch)
    teach = _gather_teacher(targets, got["traj"], got["pos"])
    if cfg.teacher_top_k > 0:
        return topk_token_kl(got["logits"], teach[0], teach[1], cfg.kind)
    return token_kl(got["logits"], teach[0], cfg.kind)


def train_opd(
    student: PreTrainedModel,
    teacher: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    cfg: OPDConfig,
    *,
    reward_fn: RewardFn | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    checkpointer: Checkpointer | None = None,
    anchor: Callable[[torch.nn.Module, torch.device, int], torch.Tensor] | None = None,
) -> OPDResult:
    """Distil `teacher` into the block-diffusion `student` on the student's own rollouts.

    Each step:
    1. rollouts: draw prompts (seeded order), decode `rollouts_per_prompt`
       responses each with `diffusion_generate` (the student's block size and
       mask id from its config, cfg.threshold, cfg.temperature, a seeded
       stream per row, return_trace);
    2. teacher: one causal forward per rollout over prompt + response
       (`teacher_targets`, no grad), kept for the step;
    3. update: cfg.inner_epochs passes over shuffled minibatches; per
       minibatch, the student's logits at every response position from the
       replayed canvases (`gr2model.training.diffusion_replay`), the per-token KL to the
       teacher, averaged over the global minibatch's tokens, plus cfg.cft_weight
       times `anchor`'s loss (when cfg.cft_weight > 0); one optimizer step.
    The student stays in eval mode (no dropout: the replay must score the
    function that decoded). The teacher is never updated.

    Args:
        student: a converted block-diffusion model (`convert_to_block_diffusion`).
        teacher: the AR teacher; same vocabulary (its logits' width must match).
        tok: the shared tokenizer (pad, eos and mask tokens).
        prompts: token id lists (each >= 1 token).
        cfg: see OPDConfig.
        reward_fn: optional, for monitoring only (not trained on): each
            rollout's reward and info are averaged into the step's metrics.
        on_step: called on the main process with each step's metrics: step, kl
            (mean per-token KL of the step's first pass, before each
            minibatch's update), kl_last_pass (the same over the last pass), response_length,
            truncated_rate, tokens_per_forward, canvases_per_rollout,
            replay_rows, replay_columns, grad_norm, lr, rollout_s, teacher_s,
            update_s (and reward_mean + info keys with reward_fn).
        accelerator: the Accelerator to run under (a default one when None).
        checkpointer: resume from its newest state and save as it says
            (`gr2model.training.dapo.PolicyRun.restore`); None: no state.
        anchor: called once per optimizer step on every process with (the
            student, its device, the step's number in the run); returns a scalar
            loss to add at cfg.cft_weight (`gr2model.training.cft.CFTAnchor`, whose
            batch is a function of that number, so a resumed run draws the same).
            Required when cfg.cft_weight > 0.
    Returns:
        OPDResult (student unwrapped, eval mode); with an anchor each step's
        metrics also carry cft_loss (its mean over the step's calls).
    """
    accelerator = accelerator or Accelerator()
    if cfg.cft_weight > 0 and anchor is None:
        raise ValueError(f"cft_weight={cfg.cft_weight} needs an anchor (the CFT loss to keep)")
    pad_id, eos_id, mask_id, block_size = decoding_ids(student, tok)
    # Before any work: a sub-block size that does not tile the student's blocks.
    check_sub_block_size(block_size, cfg.sub_block_size)
    if _vocab_of(teacher) != _vocab_of(student):
        raise ValueError(f"teacher vocabulary {_vocab_of(teacher)} != student's {_vocab_of(student)}")
    teacher = teacher.to(accelerator.device).eval()
    run = start_policy_run(
        student, accelerator, n_prompts=len(prompts), lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed
    )
    model, optimizer, policy, global_sum = run.model, run.optimizer, run.policy, run.global_sum
    world, device = run.world, run.device

    history: list[dict[str, float]] = []
    start = run.restore(checkpointer, history, on_step)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="opd", disable=not accelerator.is_main_process)
    for step in bar:
        # ---------------------------------------------------------- rollouts
        t0 = time.perf_counter()
        drawn = run.stream.take(cfg.prompts_per_step)
        mine, slots = drawn[run.rank :: world], list(range(run.rank, len(drawn), world))
        trajs: list[Trajectory] = []
        prompt_of: list[int] = []
        committed = forwards = 0  # per rollout: tokens committed, forwards that committed them
        rewards: list[float] = []
        info_sums: dict[str, list[float]] = {}
        if mine:
            rows = [prompts[i] for i in mine for _ in range(cfg.rollouts_per_prompt)]
            prompt_of = [i for i in mine for _ in range(cfg.rollouts_per_prompt)]
            out = diffusion_generate(
                policy, rows, pad_id=pad_id, eos_id=eos_id, mask_id=mask_id, block_size=block_size,
                threshold=cfg.threshold, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                generator=run.row_generators([(step, 0, slot) for slot in slots], cfg.rollouts_per_prompt),
                return_trace=True, sub_block_size=cfg.sub_block_size,
            )
            trajs = trajectories_from_decode(rows, out)
            committed = sum(t.committed for t in trajs)
            forwards = sum(t.forwards for t in trajs)
            if reward_fn is not None:
                for i, seq in zip(prompt_of, out.sequences):
                    value, info = reward_fn(i, list(seq))
                    rewards.append(float(value))
                    for k, v in info.items():
                        tally = info_sums.setdefault(k, [0.0, 0.0])
                        tally[0] += float(v)
                        tally[1] += 1.0
        rollout_s = time.perf_counter() - t0

        # ----------------------------------------------------------- teacher
        t1 = time.perf_counter()
        targets: list[tuple[torch.Tensor, ...]] = []
        with accelerator.autocast():
            for start in range(0, len(trajs), cfg.minibatch_size):
                chunk = trajs[start : start + cfg.minibatch_size]
                targets += teacher_targets(
                    teacher, [t.prompt for t in chunk], [t.response for t in chunk], pad_id, cfg.teacher_top_k
                )
        teacher_s = time.perf_counter() - t1

        # ------------------------------------------------------------ update
        t2 = time.perf_counter()
        # Each rollout keyed (prompt slot, member): the minibatches of one process (see `shuffled_minibatches`).
        keys = [(slot, m) for slot in slots for m in range(cfg.rollouts_per_prompt)] if mine else []
        grad_norms: list[float] = []
        kl_sums = [[0.0, 0.0] for _ in range(cfg.inner_epochs)]  # per pass: KL sum, tokens
        anchor_sums = [0.0, 0.0]  # CFT loss sum, calls
        replay = [0.0, 0.0, 0.0]  # canvases, rows, columns (first pass)
        per_pass = -(-cfg.prompts_per_step * cfg.rollouts_per_prompt // cfg.minibatch_size)  # minibatches of a pass
        for epoch in range(cfg.inner_epochs):
            for mb, idx in enumerate(shuffled_minibatches(keys, cfg.minibatch_size, run.shuffle_gen, world)):
                n_tok_local = sum(trajs[i].length for i in idx)
                n_tok_global = global_sum([float(n_tok_local)])[0]
                if n_tok_global == 0:
                    continue  # empty on every process: skip together
                if anchor is not None and cfg.cft_weight > 0:
                    # Before the KL parts: the last of those backwards is the one DDP all-reduces at.
                    with accelerator.no_sync(model):
                        with accelerator.autocast():
                            kept = anchor(model, device, (step * cfg.inner_epochs + epoch) * per_pass + mb)
                        if kept.requires_grad:
                            accelerator.backward(cfg.cft_weight * kept)
                    anchor_sums[0] += float(kept.detach())
                    anchor_sums[1] += 1.0
                if n_tok_local > 0:
                    widths = [
                        replay_columns(trajs[i], block_size=block_size, max_copies=cfg.max_copies) for i in idx
                    ]
                    parts = [[idx[k] for k in part] for part in split_by_columns(widths, cfg.micro_batch_columns)]
                    for j, part in enumerate(parts):
                        # DDP all-reduces once, at the last backward of the minibatch.
                        with accelerator.no_sync(model) if j < len(parts) - 1 else contextlib.nullcontext():
                            kl = _replay_kl(
                                model, [trajs[i] for i in part], [targets[i] for i in part], cfg, block_size,
                                mask_id, pad_id, device, accelerator, replay if epoch == 0 else None,
                            )
                            # Token-level mean over the global minibatch; DDP averages
                            # gradients over processes, hence * world.
                            accelerator.backward(kl.sum() * world / n_tok_global)
                            kl_sums[epoch][0] += float(kl.detach().sum())
                            kl_sums[epoch][1] += float(kl.numel())
                else:
                    accelerator.backward(zero_grad_forward(model, pad_id))
                if cfg.grad_clip > 0:
                    grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        update_s = time.perf_counter() - t2

        # ----------------------------------------------------------- metrics
        lengths = [t.length for t in trajs]
        truncated = sum(1 for t in trajs if not t.response or t.response[-1] != eos_id)
        info_keys = sorted({k for ks in gather_object([sorted(info_sums)]) for k in ks})
        local = {
            "rollouts": float(len(trajs)),
            "response_tokens": float(sum(lengths)),
            "truncated": float(truncated),
            "forwards": float(forwards),
            "committed": float(committed),
            "kl_sum": kl_sums[0][0],
            "kl_tokens": kl_sums[0][1],
            "kl_last_pass_sum": kl_sums[-1][0],
            "kl_last_pass_tokens": kl_sums[-1][1],
            "canvases": replay[0],
            "replay_rows": replay[1],
            "replay_columns": replay[2],
            "reward_sum": sum(rewards),
            "rewards": float(len(rewards)),
            "cft_loss_sum": anchor_sums[0],
            "cft_calls": anchor_sums[1],
        }
        for k in info_keys:  # the same sorted keys on every process, so the same order
            local[f"info_sum:{k}"], local[f"info_count:{k}"] = info_sums.get(k, [0.0, 0.0])
        tot = _sum_by_name(global_sum, local)
        n = max(tot["rollouts"], 1.0)
        metrics: dict[str, float] = {
            "step": float(step + 1),
            "kl": tot["kl_sum"] / max(tot["kl_tokens"], 1.0),
            "kl_last_pass": tot["kl_last_pass_sum"] / max(tot["kl_last_pass_tokens"], 1.0),
            "response_length": tot["response_tokens"] / n,
            "truncated_rate": tot["truncated"] / n,
            # Per rollout (each forward commits >= 1 token of every row it carries).
            "tokens_per_forward": tot["committed"] / max(tot["forwards"], 1.0),
            "canvases_per_rollout": tot["canvases"] / n,
            "replay_rows": tot["replay_rows"],
            "replay_columns": tot["replay_columns"],
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "lr": float(optimizer.param_groups[0]["lr"]),
            "rollout_s": rollout_s,
            "teacher_s": teacher_s,
            "update_s": update_s,
        }
        if reward_fn is not None:
            metrics["reward_mean"] = tot["reward_sum"] / max(tot["rewards"], 1.0)
        if anchor is not None and cfg.cft_weight > 0:
            metrics["cft_loss"] = tot["cft_loss_sum"] / max(tot["cft_calls"], 1.0)
        for k in info_keys:
            s, c = tot[f"info_sum:{k}"], tot[f"info_count:{k}"]
            metrics[k if k not in metrics else f"info_{k}"] = s / c if c > 0 else 0.0
        if accelerator.is_main_process:
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            bar.set_postfix(kl=f"{metrics['kl']:.4f}")
        if checkpointer is not None:
            checkpointer.step_done(step + 1, final=step + 1 == cfg.steps)
    bar.close()
    return OPDResult(model=run.finish(), history=history)


def _sum_by_name(global_sum: Callable[[list[float]], list[float]], local: dict[str, float]) -> dict[str, float]:
    """Each value of `local` summed over processes, by name, in one all-reduce.

    The values travel as one (len(local),) float64 tensor in the dict's order, so every
    process must pass the same names in the same order (build the dict the same way on
    each); the sums come back under their names, never by position."""
    names = list(local)
    return dict(zip(names, global_sum([local[k] for k in names]), strict=True))


def _vocab_of(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
