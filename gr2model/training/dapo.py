"""DAPO reinforcement learning of a causal LM (Yu et al. 2025, "DAPO: an open-source LLM
reinforcement learning system at scale"), used by the `ar_rl` stage.

DAPO is GRPO (group-relative advantages, no value model) with four changes, of
which this module implements the three that belong to the optimiser:

- clip-higher: the PPO ratio is clipped to [1 - clip_low, 1 + clip_high] with
  clip_high > clip_low, so unlikely tokens with a positive advantage can still
  grow (a symmetric clip starves exploration and collapses entropy);
- dynamic sampling: groups whose G rewards are all equal have zero advantage
  and so no gradient; they are dropped and more prompts are drawn (up to
  `max_resample_rounds` more rounds) to fill the batch with informative groups;
- token-level loss: the loss is averaged over all valid tokens of the batch,
  not per sequence first, so a long response weighs in proportion to its length.

The fourth, overlong reward shaping, is a property of the reward: `reward_fn`
sees each completion's ids (an unfinished one has no eos) and can punish it.
There is no KL penalty and no reference model: DAPO drops both (the policy is
meant to move away from the SFT model, and the verifiable reward keeps it honest).

Everything runs through `accelerate.Accelerator`: each process samples its share
of the prompts, the per-step decisions (how many groups were kept, the number of
minibatches, token counts for the loss normaliser) are agreed through
all-reduces, so several processes take the same step as one process would.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.decoding.ar_decode import ar_generate
from gr2model.bounds import check
from gr2model.training.resume import Checkpointer, generator_state, set_generator_state

__all__ = [
    "DAPOConfig",
    "DAPOResult",
    "PolicyRun",
    "RewardFn",
    "group_advantages",
    "dapo_loss",
    "response_logits",
    "sequence_logprobs",
    "start_policy_run",
    "train_dapo",
    "zero_grad_forward",
    "sample_step",
    "step_metrics",
    "update_policy",
]

RewardFn = Callable[[int, list[int]], tuple[float, dict[str, float]]]
"""(index of the prompt in `prompts`, completion token ids, eos included when
emitted) -> (reward, info); info values are averaged and logged per step
(e.g. {"valid": 1.0, "copy": 0.0})."""


@dataclass(frozen=True)
class DAPOConfig:
    """Knobs of DAPO.

    group_size: G completions sampled per prompt.
    prompts_per_step: groups per step (global, over all processes).
    steps: policy-update steps (each with its own rollouts).
    inner_epochs: gradient passes over each step's rollouts.
    minibatch_size: completions per optimizer step (global); the kept rollouts
        of a step are split into ceil(n / minibatch_size) minibatches.
    lr: AdamW learning rate (constant).
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    temperature: sampling temperature of the rollouts.
    max_new_tokens: completion length limit.
    max_resample_rounds: extra sampling rounds per step while fewer than
        prompts_per_step groups survived dynamic sampling.
    seed: prompt order and sampling; runs are reproducible given it on a CPU.
    grad_clip: max global gradient norm (<= 0 disables; the DAPO paper clips at 1).
    weight_decay: AdamW weight decay.
    """

    group_size: int = 8
    prompts_per_step: int = 8
    steps: int = 50
    inner_epochs: int = 1
    minibatch_size: int = 16
    lr: float = 5e-5
    clip_low: float = 0.2
    clip_high: float = 0.28
    temperature: float = 1.0
    max_new_tokens: int = 256
    max_resample_rounds: int = 3
    seed: int = 0
    grad_clip: float = 1.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check(self, "group_size", ge=2, why="advantages compare within a group")
        for name in ("prompts_per_step", "steps", "inner_epochs", "minibatch_size", "max_new_tokens"):
            check(self, name, ge=1)
        check(self, "lr", gt=0)
        # 1 - clip_low is the ratio's floor: clip_low >= 1 would let it reach 0.
        check(self, "clip_low", ge=0, lt=1)
        check(self, "clip_high", ge=0)
        check(self, "temperature", gt=0, why="RL samples")
        for name in ("max_resample_rounds", "seed", "weight_decay"):
            check(self, name, ge=0)
        check(self, "grad_clip")  # any finite value: <= 0 disables clipping


@dataclass
class DAPOResult:
    """model: the trained policy (unwrapped, eval mode).
    history: the per-step metric dicts passed to on_step."""

    model: PreTrainedModel
    history: list[dict[str, float]] = field(default_factory=list)


# ------------------------------------------------------------------ pure parts


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (GRPO/DAPO) and the dynamic-sampling filter.

    Args:
        rewards: (P, G) rewards of G completions for each of P prompts.
        eps: added to the group std so a near-constant group does not explode.
    Returns:
        advantages: (P, G) float32, (r - mean) / (std + eps) within each group
            (std with Bessel's correction, as TRL and verl compute it); exactly 0
            in dropped groups.
        keep: (P,) bool, False where all G rewards of the group are equal: such a
            group has no learning signal and dynamic sampling drops it.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (P, G), got shape {tuple(rewards.shape)}")
    r = rewards.float()
    keep = (r != r[:, :1]).any(dim=1)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(mean)
    adv = (r - mean) / (std + eps)
    # A constant group's mean may differ from its values by a rounding error;
    # an exact 0 keeps dropped groups from leaking a tiny signal.
    return torch.where(keep[:, None], adv, torch.zeros_like(adv)), keep


def dapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO's clipped surrogate, averaged over tokens (not sequences). No KL term.

    With ratio = exp(logp - old_logp) per token and A the sequence's advantage:

        loss = sum over valid tokens of -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
               / number of valid tokens in the batch

    Args:
        logp: (N, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logp: (N, T) the same under the policy that sampled them (no grad needed).
        advantages: (N,) one advantage per sequence, shared by its tokens.
        mask: (N, T) 1 on completion tokens, 0 on padding.
        clip_low, clip_high: the decoupled clip range.
    Returns:
        the scalar loss, and stats over valid tokens: clip_fraction (share of
        tokens whose clipped term is active, i.e. that get no gradient),
        ratio_mean, approx_kl (mean of ratio - 1 - log ratio, the k3 estimate
        of KL(old || new), for monitoring only), tokens.
    """
    m = mask.to(logp.dtype)
    # Padding may hold anything; a zero log-ratio there keeps exp() finite, so
    # 0 * inf cannot turn the sum into nan.
    log_ratio = torch.where(mask.bool(), logp - old_logp.detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logp.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n_tokens = m.sum()
    loss = (per_token * m).sum() / n_tokens.clamp(min=1.0)
    with torch.no_grad():
        denom = max(float(n_tokens), 1.0)
        is_clipped = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))
        stats = {
            "clip_fraction": float((is_clipped.to(m.dtype) * m).sum()) / denom,
            "ratio_mean": float((ratio * m).sum()) / denom,
            "approx_kl": float(((ratio - 1.0 - log_ratio) * m).sum()) / denom,
            "tokens": float(n_tokens),
        }
    return loss, stats


def _model_device(model: torch.nn.Module) -> torch.device:
    # A DDP wrapper has no `.device`; its parameters do.
    return next(model.parameters()).device


def response_logits(
    model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal LM's logits predicting every completion token, in one forward pass.

    Rows are laid out as [left pads][prompt][completion][right pads], with
    position ids restarting at 0 on each row's first real token: the same
    inputs `ar_generate` sees. Only the logits of the completion positions are
    computed (`logits_to_keep`). Gradients flow unless the caller disables them.

    Args:
        model: causal LM, forward(input_ids, attention_mask, position_ids,
            logits_to_keep) -> logits.
        prompt_ids: N prompts (each >= 1 token).
        completion_ids: N completions (any lengths, may be empty).
        pad_id: padding id.
    Returns:
        logits: (N, T, V) as the model returns them, T = longest completion;
            logits[i, t] predict completion token t of row i (token shift
            applied); rows past their completion hold pads' logits. (N, 0, 0)
            when every completion is empty (no forward is run).
        targets: (N, T) long, the completion tokens (pad_id past the end).
        mask: (N, T) float32, 1 on completion tokens.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    device = _model_device(model)
    n = len(prompt_ids)
    p_len = max(len(p) for p in prompt_ids)
    t_len = max((len(c) for c in completion_ids), default=0)
    if min(len(p) for p in prompt_ids) == 0:
        raise ValueError("empty prompt")
    if t_len == 0:
        # No forward at all: the logits are (N, 0, 0), nothing to predict.
        empty = torch.zeros((n, 0), device=device)
        return torch.zeros((n, 0, 0), device=device), empty.long(), empty
    ids = torch.full((n, p_len + t_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + t_len), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[row, p_len - len(p) : p_len] = torch.as_tensor(p, dtype=torch.long)
        attn[row, p_len - len(p) : p_len] = 1
        if c:
            ids[row, p_len : p_len + len(c)] = torch.as_tensor(c, dtype=torch.long)
            attn[row, p_len : p_len + len(c)] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    # The last t_len + 1 positions: p_len - 1 (predicts the first completion
    # token) through the end; the very last predicts nothing and is dropped.
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False, logits_to_keep=t_len + 1)
    return out.logits[:, :-1], ids[:, p_len:], attn[:, p_len:].float()


def sequence_logprobs(
    model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of completion tokens under `model`, in one forward pass (`response_logits`).

    The rows are the inputs `ar_generate` sees, so the values match its
    `return_logprobs`. Gradients flow (wrap in `torch.no_grad()` for old log-probs).

    Args:
        model: causal LM, forward(input_ids, attention_mask, position_ids,
            logits_to_keep) -> logits.
        prompt_ids: N prompts (each >= 1 token).
        completion_ids: N completions (any lengths, may be empty).
        pad_id: padding id.
    Returns:
        logp: (N, T) float32, T = longest completion; log p(token | prefix) from
            log_softmax of the raw logits (temperature 1), 0 on padding.
        mask: (N, T) float32, 1 on completion tokens.
    """
    logits, targets, mask = response_logits(model, prompt_ids, completion_ids, pad_id)
    if targets.shape[1] == 0:
        return mask.clone(), mask
    logits = logits.float()
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp * mask, mask


# ------------------------------------------------------------------------ train


class _PromptStream:
    """Prompt indices in a seeded random order, reshuffled after every pass."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.order, self.pos = n, seed, 0, [], 0
        self._shuffle()

    def _shuffle(self) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.order = torch.randperm(self.n, generator=g).tolist()
        self.pos = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.order, self.pos = state["epoch"], list(state["order"]), state["pos"]

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.pos == self.n:
                self._shuffle()
            out.append(self.order[self.pos])
            self.pos += 1
        return out


@dataclass
class PolicyRun:
    """What every on-policy loop here (`train_dapo`, OPD, diffusion RL) sets up the same way.

    `model` is the prepared module the optimizer trains (DDP-wrapped under several
    processes); `policy` is the same weights unwrapped, for decoding and no-grad
    forwards, whose number may differ between processes (a DDP forward may sync
    buffers, a collective). The prompt stream and the shuffling generator have the
    same state on every process. Rollouts draw their noise from `row_generators`,
    one stream per sampled row seeded by where the row sits in the run, so the
    samples do not depend on the number of processes (nor on a resume).
    """

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    policy: torch.nn.Module
    stream: _PromptStream
    shuffle_gen: torch.Generator
    seed: int = 0

    def row_generators(self, keys: Sequence[tuple[int, int, int]], group_size: int) -> list[torch.Generator]:
        """One sampling stream per rollout row (on the run's device), prompt-major: for each
        prompt's key (step, round, slot: its position among the prompts drawn that round),
        `group_size` streams seeded by (seed, step, round, slot, member)."""
        gens = []
        for step, rnd, slot in keys:
            for member in range(group_size):
                digest = hashlib.blake2b(f"{self.seed}/{step}/{rnd}/{slot}/{member}".encode(), digest_size=8).digest()
                gens.append(torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") >> 1))
        return gens

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def global_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of `values` over processes (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.accelerator.reduce(t, reduction="sum").tolist()

    def restore(
        self,
        checkpointer: Checkpointer | None,
        history: list[dict[str, float]],
        on_step: Callable[[dict[str, float]], None] | None = None,
    ) -> int:
        """Steps already done: those of the checkpointer's newest state, loaded into this
        run (weights, optimizer, every RNG, the prompt stream, both generators) and
        `history` (in place); 0 without a checkpointer or a saved state. On a resume the
        restored history is passed to `on_step` first (main process), so a tracker that
        starts with this process still records the whole curve.

        The loop then calls `checkpointer.step_done(step + 1, final=...)` after each
        step. A resumed run draws the same prompts and the same noise as one that
        was never stopped, so it ends with the same weights (on a CPU).
        """
        if checkpointer is None:
            return 0
        checkpointer.attach(self.accelerator, _PolicyRunState(self, history))
        start = checkpointer.restore()
        checkpointer.replay(history, on_step)
        return start

    def finish(self) -> PreTrainedModel:
        """Wait for every process; the trained weights, unwrapped, in eval mode."""
        self.accelerator.wait_for_everyone()
        trained = self.accelerator.unwrap_model(self.model)
        trained.eval()
        return trained


class _PolicyRunState:
    """A `PolicyRun`'s own resumable state (`gr2model.training.resume.Stateful`): the prompt
    stream, the shuffling generator and the emitted history."""

    def __init__(self, run: PolicyRun, history: list[dict[str, float]]) -> None:
        self.run, self.history = run, history

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.run.stream.state_dict(),
            "shuffle_gen": generator_state(self.run.shuffle_gen),
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run.stream.load_state_dict(state["stream"])
        set_generator_state(self.run.shuffle_gen, state["shuffle_gen"])
        self.history[:] = state["history"]


def start_policy_run(
    model: PreTrainedModel, accelerator: Accelerator, *, n_prompts: int, lr: float, weight_decay: float, seed: int
) -> PolicyRun:
    """AdamW over `model`, both prepared by `accelerator`, the model in eval mode (dropout
    would make a ratio or a replay compare two different functions; gradients flow in
    eval mode all the same), a seeded prompt stream over `n_prompts` and the shuffling
    generator (the same on every process)."""
    if n_prompts == 0:
        raise ValueError("no prompts")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    prepared.eval()
    return PolicyRun(
        accelerator=accelerator,
        model=prepared,
        optimizer=optimizer,
        policy=accelerator.unwrap_model(prepared),
        stream=_PromptStream(n_prompts, seed),
        # Shared: `shuffled_minibatches` shuffles the rollouts of all processes as one list.
        shuffle_gen=torch.Generator().manual_seed(seed * 1_000_003 + 7919),
        seed=seed,
    )


@dataclass
class Rollout:
    """One rollout kept for the update: its prompt, completion, reward and group-relative advantage."""

    prompt_index: int
    completion: list[int]
    reward: float
    advantage: float
    extra: Any = None  # what the sampler kept besides the completion (e.g. a diffusion trajectory)
    # (round, slot, member): its place in the step's rollouts over all processes, in
    # the order one process would hold them.
    key: tuple[int, int, int] = (0, 0, 0)


Sampler = Callable[[list[int], list[tuple[int, int, int]]], list[tuple[list[int], Any]]]
"""(prompt indices, their keys (step, round, slot)) -> for each prompt, G (completion,
extra) pairs, prompt-major; `PolicyRun.row_generators(keys, G)` gives the rows' streams."""


@dataclass
class _StepSamples:
    """One step's rollouts after dynamic sampling, and the tallies of every sampled one."""

    kept: list[Rollout]
    rewards: list[float]
    lengths: list[int]
    truncated: int
    info_sums: dict[str, list[float]]  # key -> [sum, count]
    sampled_groups: int
    kept_groups: int
    rounds: int


def sample_step(
    stream: _PromptStream,
    sample: Sampler,
    reward_fn: RewardFn,
    *,
    step: int,
    prompts_per_step: int,
    group_size: int,
    max_resample_rounds: int,
    eos_id: int,
    rank: int,
    world: int,
    global_sum: Callable[[list[float]], list[float]],
) -> _StepSamples:
    """Draw prompts, sample G completions each, score them, keep the informative groups.

    Dynamic sampling: all-equal groups are dropped and the shortfall of prompts
    is drawn again, up to `max_resample_rounds` extra rounds. Every process
    draws the same prompts (the stream is shared) and samples its slice
    (rank::world), each prompt keyed by (step, round, slot); the number of kept
    groups is agreed by an all-reduce, so all processes take the same number of
    rounds.
    """
    G = group_size
    out = _StepSamples([], [], [], 0, {}, 0, 0, 0)
    to_draw = prompts_per_step
    while True:
        drawn = stream.take(to_draw)
        mine = drawn[rank::world]
        slots = list(range(rank, len(drawn), world))
        if mine:
            completions = sample(mine, [(step, out.rounds, slot) for slot in slots])
            rewards = torch.zeros((len(mine), G))
            for j, (seq, _) in enumerate(completions):
                value, info = reward_fn(mine[j // G], list(seq))
                rewards[j // G, j % G] = float(value)
                out.rewards.append(float(value))
                out.lengths.append(len(seq))
                out.truncated += int(not seq or seq[-1] != eos_id)
                for k, v in info.items():
                    tally = out.info_sums.setdefault(k, [0.0, 0.0])
                    tally[0] += float(v)
                    tally[1] += 1.0
            adv, keep = group_advantages(rewards)
            for g in keep.nonzero().flatten().tolist():
                for j in range(G):
                    seq, extra = completions[g * G + j]
                    key = (out.rounds, slots[g], j)
                    out.kept.append(Rollout(mine[g], seq, float(rewards[g, j]), float(adv[g, j]), extra, key))
        # Every process must agree on whether to draw again.
        out.kept_groups = int(global_sum([len(out.kept) / G])[0])
        out.sampled_groups += len(drawn)
        out.rounds += 1
        if out.kept_groups >= prompts_per_step or out.rounds > max_resample_rounds:
            return out
        to_draw = prompts_per_step - out.kept_groups


def shuffled_minibatches(
    keys: Sequence[tuple[int, ...]], minibatch_size: int, shuffle_gen: torch.Generator, world: int
) -> list[list[int]]:
    """One pass's minibatches over the rollouts of all processes, as this process's share.

    `keys` name this process's rollouts (distinct over all processes; sorted, they give
    the order one process would hold them in). All keys are gathered and sorted,
    shuffled with `shuffle_gen` (the same state on every process) and cut into
    ceil(n / minibatch_size) minibatches as one process would; each process then gets,
    per minibatch, the indices into `keys` of the members it holds (possibly none: the
    list has the same length on every process, as DDP needs matching backwards). A
    minibatch's gradient is the same sum whichever process holds a member, so a run
    does not depend on the number of processes (up to the order of float sums).
    A collective with several processes: every process must call it.
    """
    every = sorted(gather_object(list(keys))) if world > 1 else list(keys)
    if not every:
        return []
    local = {k: i for i, k in enumerate(keys)}
    order = torch.randperm(len(every), generator=shuffle_gen)
    return [
        [local[every[g]] for g in members.tolist() if every[g] in local]
        for members in torch.tensor_split(order, math.ceil(len(every) / minibatch_size))
    ]


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accelerator: Accelerator,
    kept: list[Rollout],
    old: list[torch.Tensor],
    logprobs: Callable[[torch.nn.Module, list[Rollout]], tuple[torch.Tensor, torch.Tensor]],
    n_scored: Callable[[Rollout], int],
    *,
    minibatch_size: int,
    inner_epochs: int,
    clip_low: float,
    clip_high: float,
    grad_clip: float,
    shuffle_gen: torch.Generator,
    pad_id: int,
    global_sum: Callable[[list[float]], list[float]],
    split: Callable[[list[Rollout]], list[list[int]]] | None = None,
) -> tuple[dict[str, float], list[float]]:
    """`inner_epochs` passes of `dapo_loss` over shuffled minibatches, one optimizer step each.

    Args:
        kept: this process's rollouts; old: their old log-probs, one (T_i,)
            tensor each, aligned with the columns of `logprobs`'s rows.
        logprobs: (model, rollouts) -> (logp (n, T), mask (n, T)) with gradients.
        n_scored: the number of scored tokens of a rollout (= its mask's sum).
        split: optionally, (a minibatch's rollouts) -> parts (lists of their
            indices), one forward/backward each, gradients accumulated (the
            step is the same); None: the whole minibatch in one forward.
    Returns:
        token-weighted sums {loss, clip_fraction, ratio_mean, approx_kl, tokens}
        and the grad norms of the optimizer steps.
    """
    world = accelerator.num_processes
    upd = {"loss": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0, "tokens": 0.0}
    grad_norms: list[float] = []
    for _ in range(inner_epochs):
        for idx in shuffled_minibatches([r.key for r in kept], minibatch_size, shuffle_gen, world):
            n_tok_local = sum(n_scored(kept[i]) for i in idx)
            n_tok_global = global_sum([float(n_tok_local)])[0]
            if n_tok_global == 0:
                # Empty on every process (possible when the local splits
                # misalign): skip together, no Adam step on a zero gradient.
                continue
            if idx:
                parts = [idx] if split is None else [[idx[k] for k in part] for part in split([kept[i] for i in idx])]
                for j, part in enumerate(parts):
                    # DDP all-reduces once, at the last backward of the minibatch.
                    with accelerator.no_sync(model) if j < len(parts) - 1 else contextlib.nullcontext():
                        chunk = [kept[i] for i in part]
                        logp, mask = logprobs(model, chunk)
                        old_lp = torch.zeros_like(logp)
                        for row, i in enumerate(part):
                            old_lp[row, : old[i].shape[0]] = old[i]
                        advs = torch.tensor([r.advantage for r in chunk], device=logp.device)
                        loss, stats = dapo_loss(logp, old_lp, advs, mask, clip_low, clip_high)
                        # Token-level over the global minibatch: rescale this part's
                        # token mean to its share of all tokens; DDP then averages
                        # over processes, hence * world.
                        scaled = loss * (stats["tokens"] * world / max(n_tok_global, 1.0))
                        for k in ("clip_fraction", "ratio_mean", "approx_kl"):
                            upd[k] += stats[k] * stats["tokens"]
                        upd["loss"] += float(loss.detach()) * stats["tokens"]
                        upd["tokens"] += stats["tokens"]
                        accelerator.backward(scaled)
            else:
                accelerator.backward(zero_grad_forward(model, pad_id))
            if grad_clip > 0:
                grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), grad_clip)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return upd, grad_norms


def step_metrics(
    step: int,
    samples: _StepSamples,
    upd: dict[str, float],
    grad_norms: list[float],
    lr: float,
    rollout_s: float,
    update_s: float,
    global_sum: Callable[[list[float]], list[float]],
) -> dict[str, float]:
    """The metrics of one step, summed over processes (see `train_dapo`'s on_step)."""
    keys = sorted({k for ks in gather_object([sorted(samples.info_sums)]) for k in ks})
    rewards_all = samples.rewards
    local = [
        sum(rewards_all), sum(r * r for r in rewards_all), float(len(rewards_all)), float(sum(samples.lengths)),
        float(samples.truncated), upd["loss"], upd["clip_fraction"], upd["ratio_mean"], upd["approx_kl"],
        upd["tokens"],
    ]
    for k in keys:
        local += samples.info_sums.get(k, [0.0, 0.0])
    tot = global_sum(local)
    n = max(tot[2], 1.0)
    tokens = max(tot[9], 1.0)
    mean = tot[0] / n
    metrics: dict[str, float] = {
        "step": float(step + 1),
        "reward_mean": mean,
        "reward_std": math.sqrt(max(tot[1] / n - mean * mean, 0.0)),
        "sampled_groups": float(samples.sampled_groups),
        "kept_groups": float(samples.kept_groups),
        "resample_rounds": float(samples.rounds - 1),
        "response_length": tot[3] / n,
        "truncated_rate": tot[4] / n,
        "loss": tot[5] / tokens,
        "clip_fraction": tot[6] / tokens,
        "ratio_mean": tot[7] / tokens if tot[9] > 0 else 1.0,
        "approx_kl": tot[8] / tokens,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "lr": lr,
        "rollout_s": rollout_s,
        "update_s": update_s,
    }
    for j, k in enumerate(keys):
        s, c = tot[10 + 2 * j], tot[11 + 2 * j]
        metrics[k if k not in metrics else f"info_{k}"] = s / c if c > 0 else 0.0
    return metrics


def zero_grad_forward(model: torch.nn.Module, pad_id: int) -> torch.Tensor:
    """A loss of exactly 0 that still touches every parameter.

    A process with no rollout in a minibatch must still join DDP's gradient
    all-reduce, or the others wait for it forever.
    """
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=_model_device(model))
    return model(input_ids=ids, use_cache=False).logits.sum() * 0.0


def train_dapo(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    reward_fn: RewardFn,
    cfg: DAPOConfig,
    *,
    on_step: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    checkpointer: Checkpointer | None = None,
) -> DAPOResult:
    """Train a policy with DAPO against `reward_fn` (no KL penalty, no reference model).

    Each step:
    1. rollouts: draw prompts (seeded order), sample G completions each with
       `ar_generate` (cfg.temperature, a seeded stream per row, the tokenizer's pad
       and eos), score them with reward_fn, compute `group_advantages`; drop
       all-equal groups and draw the shortfall of prompts again, up to
       cfg.max_resample_rounds extra rounds;
    2. old log-probs: `sequence_logprobs` of the kept completions under the
       current weights, before any update (no grad);
    3. update: cfg.inner_epochs passes over shuffled minibatches with
       `dapo_loss`, one optimizer step per minibatch.
    A step where no group survives takes no update.

    The model stays in eval mode throughout: dropout would make the ratio
    compare two different functions (gradients flow in eval mode all the same).

    Args:
        model: the policy (e.g. the SFT model), a causal LM.
        tok: its tokenizer; pad_token_id and eos_token_id are used.
        prompts: token id lists (each >= 1 token).
        reward_fn: see RewardFn.
        cfg: see DAPOConfig.
        on_step: called on the main process with each step's metrics: step,
            reward_mean, reward_std (over all sampled completions, dropped groups
            included: the policy's current reward), sampled_groups, kept_groups,
            resample_rounds, response_length, truncated_rate (no eos within
            max_new_tokens), loss, clip_fraction, ratio_mean, approx_kl, grad_norm,
            lr, rollout_s, update_s, and every reward_fn info key averaged over
            the sampled completions (under its own name, or `info_<name>` if that
            name is taken).
        accelerator: the Accelerator to run under (a default one when None).
        checkpointer: resume from its newest state and save after the steps it
            says are due and after the last (`PolicyRun.restore`); None: no state.
    Returns:
        DAPOResult (model unwrapped, eval mode).
    """
    accelerator = accelerator or Accelerator()
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    if pad_id is None or eos_id is None:
        raise ValueError("tokenizer needs pad and eos tokens")
    run = start_policy_run(
        model, accelerator, n_prompts=len(prompts), lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed
    )
    model, optimizer, policy, global_sum = run.model, run.optimizer, run.policy, run.global_sum
    G = cfg.group_size

    def sample(mine: list[int], keys: list[tuple[int, int, int]]) -> list[tuple[list[int], Any]]:
        rows = [prompts[i] for i in mine for _ in range(G)]
        out = ar_generate(
            policy, rows, pad_id=pad_id, eos_id=eos_id, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, generator=run.row_generators(keys, G),
        )
        return [(seq, None) for seq in out.sequences]

    def logprobs(m: torch.nn.Module, chunk: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logprobs(m, [prompts[r.prompt_index] for r in chunk], [r.completion for r in chunk], pad_id)

    history: list[dict[str, float]] = []
    start = run.restore(checkpointer, history, on_step)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="dapo", disable=not accelerator.is_main_process)
    for step in bar:
        t0 = time.perf_counter()
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
            # The unwrapped module: processes run different numbers of these
            # forwards, and a DDP forward may sync buffers (a collective). autocast
            # gives the same numerics as the prepared model's forward under mixed precision.
            with torch.no_grad(), accelerator.autocast():
                for start in range(0, len(kept), cfg.minibatch_size):
                    chunk = kept[start : start + cfg.minibatch_size]
                    lp, _ = logprobs(policy, chunk)
                    old += [lp[i, : len(r.completion)] for i, r in enumerate(chunk)]
        upd, grad_norms = update_policy(
            model, optimizer, accelerator, kept, old, logprobs, lambda r: len(r.completion),
            minibatch_size=cfg.minibatch_size, inner_epochs=cfg.inner_epochs,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, grad_clip=cfg.grad_clip, shuffle_gen=run.shuffle_gen,
            pad_id=pad_id, global_sum=global_sum,
        )
        update_s = time.perf_counter() - t1

        metrics = step_metrics(
            step, samples, upd, grad_norms, float(optimizer.param_groups[0]["lr"]), rollout_s, update_s, global_sum
        )
        if accelerator.is_main_process:
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kept=samples.kept_groups)
        if checkpointer is not None:
            checkpointer.step_done(step + 1, final=step + 1 == cfg.steps)
    bar.close()
    return DAPOResult(model=run.finish(), history=history)
