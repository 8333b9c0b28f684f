"""RL of the block-diffusion policy: trajectory-level DAPO/GRPO in the style of TraceRL.

The policy (from the OPD checkpoint) samples G responses per prompt with its
real decoder (`gr2model.decoding.diffusion_decode`: threshold rule, block KV cache,
sampling temperature), and every rollout records the step at which each token
was committed (`return_trace`) and the log-probability it had under the
forward that committed it (`return_logprobs`). The reward is the same
conditional verifiable reward as `ar_rl` (`gr2model.task.rewards`, invalid answers
-1), given by the caller's `reward_fn`.

A diffusion policy's action at a decode step is the set of tokens it commits
given the canvas; TraceRL scores each of them under the current policy *given
that canvas* (not the clean sequence, which is not what the policy saw). So
the update replays every step's masked canvas (`gr2model.training.diffusion_replay`:
R = max steps per block canvases per rollout, packed `max_copies` per row),
and forms the clipped importance ratio per token:

    ratio = exp(log pi_theta(token | its canvas) - log pi_old(token | its canvas))

with `gr2model.training.dapo.dapo_loss` (token-level mean, clip [1 - clip_low,
1 + clip_high], no KL term) and one group-relative advantage per rollout
(`group_advantages`), all-equal groups dropped and redrawn (dynamic
sampling). The sampling, update and metric pieces are `gr2model.training.dapo`'s own;
only the sampler (the diffusion decoder) and the log-prob function (the
replay) differ. Which positions' selection (the threshold rule) is not an
action with a log-prob: it is deterministic given the confidences, as in
TraceRL.

Scored tokens: every committed token, including the cut tail (positions
after the eos that were committed before it): they are actions of the
policy, and they conditioned the later commits of their block, the eos
among them.

Old log-probs: by default the decoder's own (`old_logprobs="decode"`), which
saves one replay forward per rollout; the replay reproduces them to ~1e-6 in
float32 (tests/test_diffusion_replay.py), so the first minibatch's ratios are
1. Under mixed precision the cached decode and the training layout round
differently; `old_logprobs="replay"` then recomputes them with the replay
(no grad) before any update, as `train_dapo` does, so on-policy ratios are
exactly 1 in any precision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.models.block_diffusion import decoding_ids
from gr2model.bounds import check
from gr2model.training.dapo import (
    DAPOConfig,
    RewardFn,
    Rollout,
    sample_step,
    step_metrics,
    update_policy,
    start_policy_run,
)
from gr2model.decoding.diffusion_decode import check_sub_block_size, diffusion_generate
from gr2model.training.diffusion_replay import (
    DEFAULT_MAX_COPIES,
    replay_columns,
    replay_logprobs,
    split_by_columns,
    trajectories_from_decode,
)
from gr2model.training.resume import Checkpointer

__all__ = ["DiffusionRLConfig", "DiffusionRLResult", "train_diffusion_rl"]


@dataclass(frozen=True)
class DiffusionRLConfig(DAPOConfig):
    """Knobs of diffusion RL: DAPOConfig's (group_size G = 8, clip 0.2 on both sides
    by default, the symmetric PPO clip; clip_high > clip_low is DAPO's clip-higher), plus

    threshold: the decoder's commit threshold for the rollouts (as at inference).
    sub_block_size: the decoder's sub-block size for the rollouts (None: whole
        blocks; else >= 1 and a divisor of the model's block size, checked when
        training starts). Old log-probs and the replay are unchanged: a
        sub-block step still sees its whole block's canvas.
    old_logprobs: "decode" (the decoder's, default) or "replay" (module docstring).
    max_copies: canvases per replay row (`gr2model.training.diffusion_replay`).
    micro_batch_columns: the most replay columns per forward/backward inside a
        minibatch (gradients accumulate; <= 0: all at once); see
        `gr2model.training.opd.OPDConfig` for the measurement behind 16,384.
    """

    clip_high: float = 0.2
    threshold: float = 0.9
    sub_block_size: int | None = None
    old_logprobs: Literal["decode", "replay"] = "decode"
    max_copies: int = DEFAULT_MAX_COPIES
    micro_batch_columns: int = 16_384

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.old_logprobs not in ("decode", "replay"):
            raise ValueError(f"old_logprobs must be 'decode' or 'replay', got {self.old_logprobs!r}")
        check(self, "threshold", ge=0, le=1)  # as OPDConfig.threshold
        # Divisibility by the model's block size is checked when training starts (the block is the checkpoint's).
        check(self, "sub_block_size", ge=1, optional=True)
        check(self, "max_copies", ge=1)
        check(self, "micro_batch_columns")  # any finite value: <= 0 means the whole minibatch at once


@dataclass
class DiffusionRLResult:
    """model: the trained policy (unwrapped, eval mode).
    history: the per-step metric dicts passed to on_step."""

    model: PreTrainedModel
    history: list[dict[str, float]] = field(default_factory=list)


def train_diffusion_rl(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    reward_fn: RewardFn,
    cfg: DiffusionRLConfig,
    *,
    on_step: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    checkpointer: Checkpointer | None = None,
) -> DiffusionRLResult:
    """Train a block-diffusion policy with trajectory-level DAPO against `reward_fn`.

    Each step:
    1. rollouts: draw prompts (seeded order), decode G responses each with
       `diffusion_generate` (the model's block size and mask id, cfg.threshold,
       cfg.temperature, a seeded stream per row, return_trace and return_logprobs),
       score them, compute `group_advantages`; drop all-equal groups and redraw,
       up to cfg.max_resample_rounds extra rounds (`gr2model.training.dapo`);
    2. old log-probs: the decoder's, or a no-grad replay (cfg.old_logprobs);
    3. update: cfg.inner_epochs passes over shuffled minibatches, each rollout's
       committed tokens scored on their replayed canvases, `dapo_loss`, one
       optimizer step per minibatch.
    The model stays in eval mode (no dropout: the ratio must compare the
    function that decoded with its update).

    Args:
        model: a converted block-diffusion model (e.g. the OPD checkpoint).
        tok: its tokenizer (pad, eos and mask tokens).
        prompts: token id lists (each >= 1 token).
        reward_fn: (prompt index, response ids with eos when emitted) ->
            (reward, info), as for `train_dapo`.
        cfg: see DiffusionRLConfig.
        on_step: called on the main process with `train_dapo`'s metrics (step,
            reward_mean, reward_std, sampled_groups, kept_groups,
            resample_rounds, response_length, truncated_rate, loss,
            clip_fraction, ratio_mean, approx_kl, grad_norm, lr, rollout_s,
            update_s, reward_fn's info keys) plus tokens_per_forward (committed
            tokens per decoder forward, per rollout, over every sampled
            rollout) and canvases_per_rollout (replayed canvases of the kept ones).
        accelerator: the Accelerator to run under (a default one when None).
        checkpointer: resume from its newest state and save as it says
            (`gr2model.training.dapo.PolicyRun.restore`); None: no state.
    Returns:
        DiffusionRLResult (model unwrapped, eval mode).
    """
    accelerator = accelerator or Accelerator()
    pad_id, eos_id, mask_id, block_size = decoding_ids(model, tok)
    # Before any work: a sub-block size that does not tile the model's blocks.
    check_sub_block_size(block_size, cfg.sub_block_size)
    run = start_policy_run(
        model, accelerator, n_prompts=len(prompts), lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed
    )
    model, optimizer, policy, global_sum = run.model, run.optimizer, run.policy, run.global_sum
    G = cfg.group_size

    decode_tally = [0.0, 0.0]  # this step's committed tokens, forwards that committed them

    def sample(mine: list[int], keys: list[tuple[int, int, int]]) -> list[tuple[list[int], Any]]:
        rows = [prompts[i] for i in mine for _ in range(G)]
        out = diffusion_generate(
            policy, rows, pad_id=pad_id, eos_id=eos_id, mask_id=mask_id, block_size=block_size,
            threshold=cfg.threshold, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            generator=run.row_generators(keys, G), return_trace=True, return_logprobs=True,
            sub_block_size=cfg.sub_block_size,
        )
        trajs = trajectories_from_decode(rows, out)
        for t in trajs:
            decode_tally[0] += t.committed
            decode_tally[1] += t.forwards
        return [(t.response, t) for t in trajs]

    def logprobs(m: torch.nn.Module, chunk: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        return replay_logprobs(
            m, [r.extra for r in chunk], block_size=block_size, mask_id=mask_id, pad_id=pad_id, include_tail=True,
            max_copies=cfg.max_copies,
        )

    def split(chunk: list[Rollout]) -> list[list[int]]:
        widths = [
            replay_columns(r.extra, block_size=block_size, include_tail=True, max_copies=cfg.max_copies) for r in chunk
        ]
        return split_by_columns(widths, cfg.micro_batch_columns)

    history: list[dict[str, float]] = []
    start = run.restore(checkpointer, history, on_step)
    bar = tqdm(
        range(start, cfg.steps), initial=start, total=cfg.steps, desc="diffusion-rl",
        disable=not accelerator.is_main_process,
    )
    for step in bar:
        t0 = time.perf_counter()
        decode_tally[:] = [0.0, 0.0]
        samples = sample_step(
            run.stream, sample, reward_fn, step=step, prompts_per_step=cfg.prompts_per_step, group_size=G,
            max_resample_rounds=cfg.max_resample_rounds, eos_id=eos_id, rank=run.rank, world=run.world,
            global_sum=global_sum,
        )
        kept = samples.kept
        rollout_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        old: list[torch.Tensor] = []
        if samples.kept_groups > 0:
            if cfg.old_logprobs == "decode":
                old = [torch.tensor(r.extra.logprobs, dtype=torch.float32, device=run.device) for r in kept]
            else:
                # The unwrapped module, as in train_dapo: processes run different
                # numbers of these forwards.
                with torch.no_grad(), accelerator.autocast():
                    for start in range(0, len(kept), cfg.minibatch_size):
                        chunk = kept[start : start + cfg.minibatch_size]
                        lp, _ = logprobs(policy, chunk)
                        old += [lp[i, : len(r.extra.tokens)] for i, r in enumerate(chunk)]
        upd, grad_norms = update_policy(
            model, optimizer, accelerator, kept, old, logprobs, lambda r: r.extra.committed,
            minibatch_size=cfg.minibatch_size, inner_epochs=cfg.inner_epochs,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, grad_clip=cfg.grad_clip, shuffle_gen=run.shuffle_gen,
            pad_id=pad_id, global_sum=global_sum, split=split,
        )
        update_s = time.perf_counter() - t1

        metrics = step_metrics(
            step, samples, upd, grad_norms, float(optimizer.param_groups[0]["lr"]), rollout_s, update_s, global_sum
        )
        canvases = sum(r.extra.canvases(block_size, include_tail=True) for r in kept)
        tot = global_sum([*decode_tally, float(canvases), float(len(kept))])
        metrics["tokens_per_forward"] = tot[0] / max(tot[1], 1.0)
        metrics["canvases_per_rollout"] = tot[2] / max(tot[3], 1.0)
        if accelerator.is_main_process:
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kept=samples.kept_groups)
        if checkpointer is not None:
            checkpointer.step_done(step + 1, final=step + 1 == cfg.steps)
    bar.close()
    return DiffusionRLResult(model=run.finish(), history=history)

