"""Supervised fine-tuning of the AR re-ranker on teacher traces (the `sft` stage's library).

Each example is a (prompt, response) pair of the re-ranking format
(`gr2model.task.rerank_format`). The model reads `prompt + response + <|eos|>` and is
trained with next-token cross-entropy on the response only, each token weighted
by what it is:

- reasoning tokens (inside the explanation string) weigh `reasoning_weight`,
  except the candidate citations there (`<pos_k>` tokens), which weigh
  `citation_weight` when it is set: in the reasoning-first format the order in
  which the reasoning cites candidates is the ranking's decision, and one
  token in a hundred would otherwise carry it at the weight of a word;
- everything else in the response weighs `answer_weight`: the JSON scaffolding
  before the explanation, the quotes around it, and the ranking part from the
  `"recommendations"` key to `<|eos|>` inclusive. The ranking is short but is
  what the metrics and the reward judge, and one wrong scaffolding token breaks
  the parse, so it weighs more by default;
- prompt tokens weigh 0 (labels -100): the model conditions on them and is never
  asked to write them.

With `decision_weight` and the teacher's scores of an example's candidates, the
response's first position token (the ranking's first decision: the first
candidate the reasoning cites, or the first recommendation when the answer comes
first) is also trained towards the teacher's whole distribution over the
candidates, softmax(scores / decision_temperature): a soft target that says how
close the runners-up were, where the label alone says only which one won.

The loss is `sum(w * nll) / sum(w)` over the batch (token-level, so a long trace
counts in proportion to its length). `train_sft` runs through
`accelerate.Accelerator`, so the same call trains on a CPU, several GPUs or nodes.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.bounds import FieldRangeError, check
from gr2model.task.rerank_format import EXPLANATION_KEY, POSITION_RE, pos_token
from gr2model.training.resume import Checkpointer, generator_state, set_generator_state, skip_batches

__all__ = [
    "IGNORE_INDEX",
    "SFTConfig",
    "SFTResult",
    "encode_example",
    "collate_right_padded",
    "weighted_lm_loss",
    "warmup_cosine_factor",
    "run_train_loop",
    "LengthGroupedBatches",
    "train_sft",
    "loss_stats",
    "sft_loss_sums",
    "explanation_span",
    "decision_cross_entropy",
    "target_nll",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label of a token that is never predicted (PyTorch's and HF's convention)


@dataclass(frozen=True)
class SFTConfig:
    """Knobs of supervised fine-tuning.

    epochs: passes over the training examples.
    batch_size: examples per optimizer step over all processes (the global
        batch: N processes each train on about batch_size / N of them, so the
        run takes the same steps whatever N; see `GlobalBatchShards`).
    lr, weight_decay: AdamW; the lr warms up linearly over `warmup_steps`
        optimizer steps, then decays to 0 on a cosine over the remaining steps.
    reasoning_weight: loss weight of the explanation tokens.
    answer_weight: loss weight of the rest of the response (ranking part from
        the "recommendations" key to <|eos|> inclusive, and the JSON scaffolding).
    citation_weight: loss weight of the position tokens (`<pos_k>`) inside the
        explanation, the candidates the reasoning cites; None: reasoning_weight.
    decision_weight: weight of the soft-target term at the first position token
        of the response (cross-entropy to the teacher's softmax over the
        candidates), for examples given the teacher's scores; 0: off.
    decision_temperature: the temperature of that softmax (> 0).
    max_length: examples longer than this are cut at the end (a warning counts them).
    seed: shuffling order; training is deterministic given it on a CPU.
    grad_clip: max global gradient norm (<= 0 disables clipping).
    """

    epochs: int = 3
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    reasoning_weight: float = 1.0
    answer_weight: float = 2.0
    citation_weight: float | None = None
    decision_weight: float = 0.0
    decision_temperature: float = 1.0
    max_length: int = 1024
    seed: int = 0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            check(self, name, ge=1)
        check(self, "lr", gt=0)
        for name in ("weight_decay", "warmup_steps", "reasoning_weight", "answer_weight", "seed"):
            check(self, name, ge=0)
        check(self, "citation_weight", ge=0, optional=True)
        check(self, "decision_weight", ge=0)
        check(self, "decision_temperature", gt=0)
        check(self, "max_length", ge=2)
        check(self, "grad_clip")  # any finite value: <= 0 disables clipping
        if self.reasoning_weight + self.answer_weight <= 0:
            # Every token would weigh 0: the run would train nothing and report loss 0.
            raise FieldRangeError("answer_weight", "and reasoning_weight are both 0: nothing would be trained")


@dataclass
class SFTResult:
    """model: the trained model (unwrapped from any distributed wrapper, eval mode).
    history: every dict passed to on_step (per-step metrics, then per-epoch valid metrics).
    steps: optimizer steps taken."""

    model: PreTrainedModel
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0


# --------------------------------------------------------------------- encoding


def explanation_span(response: str) -> tuple[int, int] | None:
    """Character span [start, end) of the explanation's words in a response, or None.

    The span runs from the first to the last non-blank character between the two
    quotes that follow `"explanation" :`, so blanks and the quotes themselves
    (scaffolding) stay outside. Explanations never contain a `"` (the format
    forbids it), so the next quote closes the string.
    """
    key = response.find(EXPLANATION_KEY)
    if key < 0:
        return None
    colon = response.find(":", key + len(EXPLANATION_KEY))
    open_q = response.find('"', colon + 1) if colon >= 0 else -1
    close_q = response.find('"', open_q + 1) if open_q >= 0 else -1
    if close_q < 0:
        return None
    inner = response[open_q + 1 : close_q]
    stripped = inner.strip()
    if not stripped:
        return None
    start = open_q + 1 + (len(inner) - len(inner.lstrip()))
    return start, start + len(stripped)


def encode_example(
    tok: PreTrainedTokenizerBase, prompt: str, response: str, cfg: SFTConfig, decision_scores: Sequence[float] | None = None
) -> dict[str, list[int] | list[float]]:
    """Token ids, labels and loss weights of one training example.

    The prompt and the response are tokenized separately (no special tokens
    added) and joined with the tokenizer's eos id: the decoders are given the
    prompt's ids alone, so training sees the same prompt ids as inference.

    Args:
        tok: a fast tokenizer (character offsets locate the explanation); its
            eos token ends the response.
        prompt, response: texts of the format (`build_prompt`, `build_response`).
        decision_scores: the teacher's K scores of the candidates in the incoming
            order; with cfg.decision_weight > 0 they give the soft target of the
            response's first position token (the first decision), when that token
            is the teacher's best candidate and lies within cfg.max_length.
    Returns:
        input_ids: L ints, prompt + response + eos, cut to cfg.max_length.
        labels: L ints, IGNORE_INDEX on prompt tokens, the token id elsewhere.
        weights: L floats, 0 on the prompt, cfg.reasoning_weight on tokens inside
            the explanation string (cfg.citation_weight, when set, on its `<pos_k>`
            tokens), cfg.answer_weight on the rest of the response.
        reasoning: L ints, 1 on the explanation tokens (the loss split reported
            by `train_sft`), 0 elsewhere.
        decision, decision_ids, decision_probs (only with a soft target): the
            index in input_ids of the first position token, the ids of
            `<pos_1>`..`<pos_K>` and the teacher's K probabilities.
    Raises:
        ValueError: a slow tokenizer (no offsets) or one without an eos token.
    """
    if not tok.is_fast:
        raise ValueError("encode_example needs a fast tokenizer (character offsets)")
    eos_id = tok.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer has no eos token")
    prompt_ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    enc = tok(response, add_special_tokens=False, return_offsets_mapping=True)
    response_ids = list(enc["input_ids"]) + [eos_id]
    span = explanation_span(response)
    in_expl = []
    for start, end in enc["offset_mapping"]:
        # A token belongs to the reasoning when it overlaps the explanation's
        # words; a BPE token such as ' "' that starts on the blank after the last
        # word does not, so the closing quote stays scaffolding.
        in_expl.append(span is not None and start < span[1] and end > span[0])
    in_expl.append(False)  # eos
    cited = [False] * len(in_expl)
    if cfg.citation_weight is not None:
        cited = [r and POSITION_RE.fullmatch(response[a:b].strip()) is not None for r, (a, b) in zip(in_expl, enc["offset_mapping"])]
        cited.append(False)  # eos

    n_prompt = len(prompt_ids)
    input_ids = prompt_ids + response_ids
    labels = [IGNORE_INDEX] * n_prompt + response_ids
    weights = [0.0] * n_prompt + [
        cfg.citation_weight if c else cfg.reasoning_weight if r else cfg.answer_weight  # type: ignore[misc]
        for r, c in zip(in_expl, cited)
    ]
    reasoning = [0] * n_prompt + [int(r) for r in in_expl]
    full = {"input_ids": input_ids, "labels": labels, "weights": weights, "reasoning": reasoning}
    out = {key: values[: cfg.max_length] for key, values in full.items()}
    if cfg.decision_weight > 0 and decision_scores is not None:
        out.update(_decision_target(tok, response, enc["offset_mapping"], n_prompt, decision_scores, cfg))
    return out


def _decision_target(
    tok: PreTrainedTokenizerBase, response: str, offsets: Sequence[tuple[int, int]], n_prompt: int,
    scores: Sequence[float], cfg: SFTConfig,
) -> dict[str, Any]:
    """The soft target of the response's first position token ({} when there is none to give:
    no position token within max_length, or one that is not the teacher's best candidate)."""
    k = len(scores)
    first = next(((j, int(m.group(1))) for j, (a, b) in enumerate(offsets) if (m := POSITION_RE.fullmatch(response[a:b].strip()))), None)
    if first is None or n_prompt + first[0] >= cfg.max_length or not 1 <= first[1] <= k:
        return {}
    s = torch.as_tensor(scores, dtype=torch.float64)
    if first[1] - 1 != int(s.argmax()):
        return {}  # the written decision is not the teacher's choice (a targeted or sampled ranking)
    probs = torch.softmax(s / cfg.decision_temperature, dim=0)
    ids = tok.convert_tokens_to_ids([pos_token(p) for p in range(1, k + 1)])
    return {"decision": n_prompt + first[0], "decision_ids": list(ids), "decision_probs": probs.tolist()}


def collate_right_padded(examples: Sequence[dict[str, list]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad encoded examples into one batch.

    Right padding keeps each row's positions 0..len-1, as in an unpadded
    forward; pads sit after the last real token, so the causal mask already
    hides them from every real token and they only need zero weight.

    Returns:
        input_ids (B, L) long (pad_id on padding), attention_mask (B, L) long,
        labels (B, L) long (IGNORE_INDEX on padding), weights (B, L) float
        (0 on padding), reasoning (B, L) long; when any example has a soft
        target, decision (B,) long (-1: none), decision_ids (B, K) long and
        decision_probs (B, K) float.
    """
    width = max(len(e["input_ids"]) for e in examples)
    batch = len(examples)
    out = {
        "input_ids": torch.full((batch, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((batch, width), dtype=torch.long),
        "labels": torch.full((batch, width), IGNORE_INDEX, dtype=torch.long),
        "weights": torch.zeros((batch, width), dtype=torch.float32),
        "reasoning": torch.zeros((batch, width), dtype=torch.long),
    }
    if any("decision" in e for e in examples):
        # Soft targets (`encode_example`): -1 marks a row without one; ids / probs padded with 0.
        k = max(len(e.get("decision_ids", [])) for e in examples)
        out["decision"] = torch.tensor([e.get("decision", -1) for e in examples], dtype=torch.long)
        out["decision_ids"] = torch.zeros((batch, k), dtype=torch.long)
        out["decision_probs"] = torch.zeros((batch, k), dtype=torch.float32)
        for row, e in enumerate(examples):
            if "decision" in e:
                out["decision_ids"][row, : len(e["decision_ids"])] = torch.as_tensor(e["decision_ids"])
                out["decision_probs"][row, : len(e["decision_probs"])] = torch.as_tensor(e["decision_probs"])
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        out["input_ids"][row, :n] = torch.as_tensor(e["input_ids"])
        out["attention_mask"][row, :n] = 1
        out["labels"][row, :n] = torch.as_tensor(e["labels"])
        out["weights"][row, :n] = torch.as_tensor(e["weights"], dtype=torch.float32)
        out["reasoning"][row, :n] = torch.as_tensor(e.get("reasoning", [0] * n))
    return out


# ------------------------------------------------------------------------- loss


def target_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target NLL (no shift: logits[..., c, :] predict targets[..., c]).

    Args: logits (..., V); targets (...) long, IGNORE_INDEX where nothing is predicted.
    Returns: nll (...) float32 (0 where ignored) and valid (...) bool.
    """
    nll = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    return nll, targets != IGNORE_INDEX


def _shifted_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL with the causal shift: position i-1 predicts token i.

    Args:
        logits: (B, T, V); labels: (B, T) with IGNORE_INDEX where nothing is predicted.
    Returns:
        nll (B, T-1) float32 (0 where the label is ignored) and valid (B, T-1) bool,
        both aligned with labels[:, 1:].
    """
    return target_nll(logits[:, :-1], labels[:, 1:])


def weighted_lm_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token-weighted causal LM loss: sum(w * nll) / sum(w).

    Position i-1's logits predict token i (the shift is done here, as in HF's
    own loss). A token counts only when its label is not IGNORE_INDEX *and* its
    weight is non-zero, so prompt tokens never contribute whatever their label
    or weight says.

    Args:
        logits: (B, T, V) model outputs.
        labels: (B, T) long, IGNORE_INDEX on tokens that are not predicted.
        weights: (B, T) float, the weight of each token (of the token, not of
            the position predicting it).
    Returns:
        scalar float32 loss; 0 (with a zero gradient) when no token has weight.
    """
    nll, valid = _shifted_nll(logits, labels)
    w = weights[:, 1:].float() * valid
    # clamp: an all-prompt batch has no weight; its loss is 0, not nan.
    return (w * nll).sum() / w.sum().clamp(min=torch.finfo(torch.float32).tiny)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier of optimizer step `step` (0-based): linear warmup over
    `warmup_steps` steps (the first step already gets 1/warmup_steps: a step at
    lr 0 would be wasted), then a cosine from 1 at step `warmup_steps` towards 0
    (the last step gets a small positive lr)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ------------------------------------------------------------------------ train


def sft_loss_sums(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], decision_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum(w * nll) with grad, stats (6,) without grad, non-pad tokens) of one batch.

    stats: [sum w, sum w*nll, reasoning nll sum, reasoning count, answer nll sum,
    answer count]; sums rather than means so processes can add them up. With
    `decision_weight` and soft targets in the batch (`collate_right_padded`), each
    row's soft-target cross-entropy (`decision_cross_entropy`) adds to the sum
    with that weight, and the weight to sum w.

    Logits are computed only at the K positions that predict a labelled token
    (`logits_to_keep` with a boolean (B, T) mask, flattened row by row to (K, V)):
    a re-ranking trace is mostly prompt, and the (B, T, V) logits over a vocabulary
    of every item would spend most of a step on positions nothing is learnt from.
    """
    labels = batch["labels"]
    valid = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): position i predicts token i + 1
    keep = F.pad(valid, (0, 1), value=False)  # (B, T)
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, logits_to_keep=keep
    )
    flat, _ = target_nll(out.logits, labels[:, 1:][valid])  # (K,)
    nll = flat.new_zeros(valid.shape).masked_scatter(valid, flat)  # (B, T-1)
    w = batch["weights"][:, 1:].float() * valid
    weighted = (w * nll).sum()
    extra_w = torch.zeros((), device=weighted.device)
    if decision_weight > 0 and "decision" in batch:
        rows = (batch["decision"] >= 1).nonzero().squeeze(-1)
        at = batch["decision"][rows] - 1  # the position that predicts each row's decision token
        if not bool(keep[rows, at].all()):
            raise ValueError("a soft decision target sits on a token that is not labelled")
        flat_index = keep.flatten().cumsum(0).view_as(keep) - 1  # (B, T): row of out.logits
        ce = decision_cross_entropy(
            out.logits[flat_index[rows, at]], batch["decision_ids"][rows], batch["decision_probs"][rows]
        )
        weighted = weighted + decision_weight * ce.sum()
        extra_w = extra_w + decision_weight * ce.numel()
    with torch.no_grad():
        is_reason = (batch["reasoning"][:, 1:] == 1) & valid
        stats = loss_stats(w, weighted, nll, is_reason, valid & ~is_reason)
        stats[0] += extra_w
    return weighted, stats, batch["attention_mask"].sum()


def decision_cross_entropy(
    logits: torch.Tensor, decision_ids: torch.Tensor, decision_probs: torch.Tensor
) -> torch.Tensor:
    """(R,) float32: for each of R soft targets, -sum_k p_k log q(<pos_k>), where q is the model's
    next-token distribution (over the whole vocabulary) at the position that predicts the decision
    token and p the teacher's probabilities.

    Args:
        logits: (R, V), the logits at those R positions; decision_ids: (R, K) long;
        decision_probs: (R, K) float (0 on padding).
    """
    logp = F.log_softmax(logits.float(), dim=-1)  # (R, V)
    return -(decision_probs * logp.gather(-1, decision_ids)).sum(-1)


def loss_stats(
    w: torch.Tensor, weighted: torch.Tensor, nll: torch.Tensor, is_reason: torch.Tensor, is_answer: torch.Tensor
) -> torch.Tensor:
    """The 6 summed loss stats (see `sft_loss_sums`; also `gr2model.training.cft._loss_sums`)."""
    return torch.stack(
        [
            w.sum(),
            weighted.detach(),
            (nll * is_reason).sum(),
            is_reason.sum().float(),
            (nll * is_answer).sum(),
            is_answer.sum().float(),
        ]
    )


def _split_metrics(stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """loss, reasoning_loss, answer_loss from summed stats (see `sft_loss_sums`)."""
    s = stats.tolist()
    return {
        f"{prefix}loss": s[1] / s[0] if s[0] > 0 else 0.0,
        f"{prefix}reasoning_loss": s[2] / s[3] if s[3] > 0 else 0.0,
        f"{prefix}answer_loss": s[4] / s[5] if s[5] > 0 else 0.0,
    }


@torch.no_grad()
def _valid_stats(
    model: torch.nn.Module, encoded: list[dict[str, list]], cfg: SFTConfig, pad_id: int, accelerator: Accelerator
) -> torch.Tensor:
    """Summed loss stats (6,) of the validation set over all processes.

    Each process scores a disjoint slice (i::world) and the sums are added, so
    every example counts exactly once (a prepared DataLoader would pad the last
    batch with repeats).
    """
    stats = torch.zeros(6, device=accelerator.device)
    mine = encoded[accelerator.process_index :: accelerator.num_processes]
    for start in range(0, len(mine), cfg.batch_size):
        batch = collate_right_padded(mine[start : start + cfg.batch_size], pad_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            stats += sft_loss_sums(model, batch)[1]
    return accelerator.reduce(stats, reduction="sum")


class LengthGroupedBatches:
    """Batch sampler of examples of similar length, in a seeded random order (HF's `group_by_length`).

    Each pass: shuffle the indices, cut them into megabatches of `batch_size *
    group` examples, sort each megabatch by length (longest first), cut it into
    batches, shuffle the batches. Right padding then wastes little (random
    batches of mid-training sequences, 3 to 200 items long, are ~2.8x padding).
    The order is a function of (seed, pass number) only, so every process of a
    distributed run iterates the same batches (accelerate shards them).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, group: int = 64) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group = group
        self._epoch = 0

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self._epoch)
        self._epoch += 1
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        mega = self.batch_size * self.group
        batches = []
        for start in range(0, len(order), mega):
            chunk = sorted(order[start : start + mega], key=lambda i: -self.lengths[i])
            batches += [chunk[j : j + self.batch_size] for j in range(0, len(chunk), self.batch_size)]
        for b in torch.randperm(len(batches), generator=g).tolist():
            yield batches[b]


class GlobalBatchShards:
    """Batch sampler: each global batch of `batches`, cut into `num_processes` consecutive parts.

    A loader prepared by accelerate deals its batches round-robin (process r gets
    batches r, r + N, ...), so with this sampler process r trains on part r of
    every global batch: one step of N processes sees exactly the examples of one
    step of a single process, and `batch_size` in the params means the same run
    whatever N (the lock file and the results do not depend on the launcher).
    Part sizes differ by at most one; each must hold an example (a DDP step needs
    a forward on every process), so a batch smaller than N is an error. With one
    process the batches pass through unchanged.

    There is deliberately no `batch_size` attribute: accelerate then treats the
    parts as batches of varying size and never pads the epoch with repeated
    examples (its `even_batches`), which a single process would not see.
    """

    def __init__(self, batches: BatchSampler | LengthGroupedBatches, num_processes: int) -> None:
        self.batches = batches
        self.num_processes = num_processes

    def __len__(self) -> int:
        return len(self.batches) * self.num_processes

    def __iter__(self):
        n = self.num_processes
        for batch in self.batches:
            if len(batch) < n:
                raise ValueError(
                    f"a batch of {len(batch)} examples cannot be split between {n} processes: "
                    "choose batch_size (and the number of examples modulo batch_size) of at least the process count"
                )
            cuts = [len(batch) * r // n for r in range(n + 1)]
            for r in range(n):
                yield batch[cuts[r] : cuts[r + 1]]


def check_global_batches(n_examples: int, batch_size: int, num_processes: int) -> None:
    """ValueError, before any work, when a global batch (the last, partial one included) has fewer
    examples than there are processes (`GlobalBatchShards` could not give each one a part)."""
    last = n_examples % batch_size
    if num_processes > 1 and (batch_size < num_processes or 0 < last < num_processes):
        raise ValueError(
            f"batch_size {batch_size} over {n_examples} examples leaves a batch of "
            f"{min(batch_size, last or batch_size)} examples, fewer than the {num_processes} processes: "
            "every process needs an example of every step; change batch_size or the number of examples"
        )


class _TrainPosition:
    """`run_train_loop`'s own resumable state (`gr2model.training.resume.Stateful`).

    step: optimizer steps done; epoch, batch: the current epoch and the batches of
    it done; epoch_start: the shuffle state when the epoch's iterator was made (the
    DataLoader generator's state, or `LengthGroupedBatches`' pass number), from
    which the epoch's order is drawn again on resume; history: the emitted metrics
    (the list `run_train_loop` returns, updated in place).
    """

    def __init__(
        self,
        history: list[dict[str, float]],
        shuffle_gen: torch.Generator | None,
        grouped: LengthGroupedBatches | None,
    ) -> None:
        self.history = history
        self._gen = shuffle_gen
        self._grouped = grouped
        self.step = self.epoch = self.batch = 0
        self.epoch_start: torch.Tensor | int | None = None

    def begin_epoch(self, epoch: int) -> None:
        self.epoch, self.batch = epoch, 0
        self.epoch_start = self._grouped._epoch if self._grouped is not None else generator_state(self._gen)

    def rewind_epoch(self) -> None:
        if self._grouped is not None:
            self._grouped._epoch = int(self.epoch_start)
        else:
            set_generator_state(self._gen, self.epoch_start)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch": self.batch, "epoch_start": self.epoch_start,
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch = state["step"], state["epoch"], state["batch"]
        self.epoch_start = state["epoch_start"]
        self.history[:] = state["history"]


class LoopConfig(Protocol):
    """What `run_train_loop` reads of a trainer's config (SFTConfig, CFTConfig)."""

    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    grad_clip: float


def run_train_loop(
    model: PreTrainedModel,
    dataset: Sequence,
    collate_fn: Callable[[list], Any],
    loss_sums: Callable[[torch.nn.Module, Any, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    cfg: LoopConfig,
    *,
    accelerator: Accelerator,
    valid_stats: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    valid_every: int = 0,
    on_step: Callable[[dict[str, float]], None] | None = None,
    desc: str = "train",
    lengths: Sequence[int] | None = None,
    checkpointer: Checkpointer | None = None,
) -> tuple[PreTrainedModel, list[dict[str, float]], int]:
    """The accelerate training loop shared by `train_sft` and `gr2model.training.cft.train_cft`.

    Setup: a shuffled DataLoader of `dataset` (seeded by cfg.seed) in global batches of
    cfg.batch_size, each process training on its part (`GlobalBatchShards`), AdamW, linear
    warmup then cosine decay (`warmup_cosine_factor`); model, optimizer and
    DataLoader go through `accelerator.prepare`. Per step: `loss_sums(model,
    batch, epoch)` gives (sum(w * nll) with grad, the 6 stats of `sft_loss_sums`,
    token count); the loss is that sum normalised by the global batch's weight
    (all processes), then `accelerator.backward`, clip, step, and the step's
    metrics go to `on_step` (main process only).

    valid_stats(unwrapped model) gives the summed validation stats (reduced over
    processes); it runs every `valid_every` steps (0: never) and after each epoch
    unless a step validation just ran, its metrics prefixed "valid_".

    lengths: the examples' lengths; when given, batches group examples of
    similar length (`LengthGroupedBatches`) instead of a plain shuffle.

    checkpointer: when given, the loop starts from its newest saved state (model,
    optimizer, scheduler, RNG states, data position, history; see
    `gr2model.training.resume`) and saves after the steps it says are due and after the
    last one. A resumed run replays the interrupted epoch's batch order from the
    shuffle state at that epoch's start and skips the batches already done, so
    it ends with the same weights as a run that was never stopped (on a CPU).
    On a resume, `on_step` first receives the restored history.

    Returns:
        (the trained model, unwrapped, in eval mode; the history of emitted
        metrics, empty off the main process; the number of optimizer steps).
    """
    # A seeded generator makes the order of the global batches a function of cfg.seed
    # only, the same on every process; GlobalBatchShards gives each process its part.
    world = accelerator.num_processes
    check_global_batches(len(dataset), cfg.batch_size, world)
    grouped: LengthGroupedBatches | None = None
    shuffle_gen: torch.Generator | None = None
    if lengths is not None:
        grouped = LengthGroupedBatches(lengths, cfg.batch_size, cfg.seed)
        batches: BatchSampler | LengthGroupedBatches = grouped
    else:
        shuffle_gen = torch.Generator().manual_seed(cfg.seed)
        # What DataLoader(shuffle=True, generator=shuffle_gen) builds, so one process draws the same order.
        batches = BatchSampler(RandomSampler(dataset, generator=shuffle_gen), cfg.batch_size, drop_last=False)
    # The loader gets the generator too: each new iterator draws its workers' base seed from it
    # before the sampler shuffles, as the DataLoader(shuffle=True) this replaces did.
    loader = DataLoader(dataset, batch_sampler=GlobalBatchShards(batches, world), collate_fn=collate_fn, generator=shuffle_gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total_steps = cfg.epochs * len(loader)
    # Built after prepare, on the per-process number of steps, and not prepared
    # itself: accelerate's scheduler wrapper would step it once per process.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine_factor(s, cfg.warmup_steps, total_steps)
    )

    history: list[dict[str, float]] = []

    def emit(metrics: dict[str, float]) -> None:
        if accelerator.is_main_process:
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)

    def validate(epoch: int) -> None:
        model.eval()
        # The unwrapped module: processes may score different numbers of
        # batches, and a DDP forward may sync buffers (a collective).
        vstats = valid_stats(accelerator.unwrap_model(model))
        emit({"step": float(step), "epoch": float(epoch), **_split_metrics(vstats, "valid_")})
        model.train()

    position = _TrainPosition(history, shuffle_gen, grouped)
    resumed = False
    if checkpointer is not None:
        checkpointer.attach(accelerator, position, scheduler)
        resumed = checkpointer.restore() > 0
        checkpointer.replay(history, on_step)

    step = position.step
    bar = tqdm(total=total_steps, initial=step, desc=desc, disable=not accelerator.is_main_process)
    for epoch in range(position.epoch, cfg.epochs):
        model.train()
        if resumed and epoch == position.epoch:
            position.rewind_epoch()  # the interrupted epoch: its order again, minus what was done
            batches = skip_batches(loader, position.batch)
        else:
            position.begin_epoch(epoch)
            batches = iter(loader)
        for batch in batches:
            t0 = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            weighted, stats, n_tokens = loss_sums(model, batch, epoch)
            # One all-reduce gives the global weight (for the normaliser) and the
            # logged sums together; DDP averages gradients over processes, hence * world.
            totals = accelerator.reduce(torch.cat([stats, n_tokens.float()[None]]), reduction="sum")
            loss = weighted * world / totals[0].clamp(min=torch.finfo(torch.float32).tiny)
            accelerator.backward(loss)
            grad_norm = float("nan")
            if cfg.grad_clip > 0:
                grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            position.step, position.batch = step, position.batch + 1
            seconds = time.perf_counter() - t0
            metrics = {"step": float(step), "epoch": float(epoch), **_split_metrics(totals[:6])}
            metrics.update(lr=lr, grad_norm=grad_norm, tokens_per_s=float(totals[6]) / max(seconds, 1e-9))
            emit(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            if valid_stats is not None and valid_every and step % valid_every == 0:
                validate(epoch)
            if checkpointer is not None:
                checkpointer.step_done(step, final=step == total_steps)
        if valid_stats is not None and not (valid_every and step % valid_every == 0):
            validate(epoch)  # once per epoch, unless a step validation just ran
    bar.close()
    accelerator.wait_for_everyone()
    trained = accelerator.unwrap_model(model)
    trained.eval()
    return trained, history, step


Example = tuple[str, str] | tuple[str, str, Sequence[float]]  # (prompt, response[, the teacher's K scores])


def _encode_all(tok: PreTrainedTokenizerBase, examples: Sequence[Example], cfg: SFTConfig, what: str) -> list[dict[str, list]]:
    encoded = [encode_example(tok, e[0], e[1], cfg, e[2] if len(e) > 2 else None) for e in examples]  # type: ignore[misc]
    if cfg.decision_weight > 0:
        given = sum(len(e) > 2 for e in examples)
        log.info("%s: soft decision targets on %d of %d examples (%d given the teacher's scores)", what, sum("decision" in e for e in encoded), len(encoded), given)
    # A cut example loses its end (the ranking, eos) and still trains its start;
    # one cut before its response has nothing to learn and is dropped.
    n_cut = sum(1 for e in encoded if len(e["input_ids"]) == cfg.max_length)
    kept = [e for e in encoded if any(w > 0 for w in e["weights"][1:])]
    if n_cut:
        log.warning(
            "%s: %d of %d examples reach max_length=%d (longer ones are cut)", what, n_cut, len(encoded), cfg.max_length
        )
    if len(kept) < len(encoded):
        log.warning("%s: %d examples have no response token left and are dropped", what, len(encoded) - len(kept))
    return kept


def train_sft(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    cfg: SFTConfig,
    *,
    valid: Sequence[Example] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    checkpointer: Checkpointer | None = None,
) -> SFTResult:
    """Fine-tune a causal LM on (prompt, response) pairs with `weighted_lm_loss`.

    Setup (`run_train_loop`): encode (`encode_example`), a shuffled DataLoader (seeded) of
    right-padded batches, AdamW, linear warmup then cosine decay; model,
    optimizer and DataLoader go through `accelerator.prepare`. Loop: forward,
    `accelerator.backward`, clip, step. The loss is normalised by the total
    weight of the global batch (all processes), so several processes compute
    the same gradient as one process with their batches together.

    Args:
        model: a causal LM whose forward maps input_ids (B, L) and attention_mask
            (B, L) to logits (B, L, V).
        tok: its tokenizer (fast; pad and eos tokens set).
        examples: (prompt, response) texts, the response without the eos token, or
            (prompt, response, the teacher's K scores) for a soft decision target.
        cfg: see SFTConfig.
        valid: optional held-out pairs; their loss is computed after every epoch.
        on_step: called on the main process with each step's metrics (step, epoch,
            loss, reasoning_loss, answer_loss, lr, grad_norm, tokens_per_s) and
            after each epoch with valid metrics (step, epoch, valid_loss,
            valid_reasoning_loss, valid_answer_loss). reasoning_loss and
            answer_loss are plain mean NLLs over those tokens (unweighted).
        accelerator: the Accelerator to run under (a default one when None).
        checkpointer: resume from its newest state and save as it says (see
            `run_train_loop`); None: no state is saved.
    Returns:
        SFTResult (model unwrapped, in eval mode).
    """
    accelerator = accelerator or Accelerator()
    pad_id = tok.pad_token_id
    if pad_id is None:
        raise ValueError("tokenizer has no pad token")
    train_enc = _encode_all(tok, examples, cfg, "train")
    if not train_enc:
        raise ValueError("no training example with a response token")
    valid_enc = _encode_all(tok, valid, cfg, "valid") if valid else []

    trained, history, steps = run_train_loop(
        model,
        train_enc,
        functools.partial(collate_right_padded, pad_id=pad_id),  # picklable, for worker processes
        lambda m, batch, epoch: sft_loss_sums(m, batch, cfg.decision_weight),
        cfg,
        accelerator=accelerator,
        valid_stats=(lambda m: _valid_stats(m, valid_enc, cfg, pad_id, accelerator)) if valid_enc else None,
        on_step=on_step,
        desc="sft",
        checkpointer=checkpointer,
    )
    return SFTResult(model=trained, history=history, steps=steps)
