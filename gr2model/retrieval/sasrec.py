"""SASRec pre-ranker (Kang & McAuley 2018): a causal transformer over a user's item sequence.

What is standard here: item embedding scaled by sqrt(H) plus a learned positional
embedding, pre-LN transformer blocks with causal self-attention, a final
LayerNorm, and an output layer tied to the item embedding
(logits = hidden @ item_embedding.T).

What differs from the 2018 paper, on purpose:
- Loss: full softmax cross-entropy over the whole catalogue at every non-pad
  position instead of one sampled negative with a binary loss; on Beauty this is
  known to be far stronger. It is also most of the training cost (131k target
  positions x 12k items per epoch), so it is computed by a chunked, fused
  kernel (`softmax_cross_entropy`) with bf16 matmuls on CPUs that have native
  bf16: 3-4x faster than `F.cross_entropy(h @ E.T, y)` on 2 cores, with
  validation curves that match fp32 to the 3rd digit. `num_negatives > 0` gives
  a sampled softmax instead: cheaper still, but weaker on Beauty (at hidden 64
  and lr 1e-3, 1,024 uniform negatives trailed the full softmax in validation
  NDCG@10 at every epoch, 0.048 vs 0.057 at epoch 10).
- Positions are counted from the first real item of the (cropped) sequence, not
  from the left edge of the padded tensor. The hidden state at position t then
  depends only on items 0..t, so the representation of a prefix is the same in
  training and at inference, and extra left padding changes nothing.
- Each user contributes one training window, the last max_len + 1 items (input =
  window[:-1], targets = window[1:]); no random crops (only 136 of 22,363 Beauty
  users have more than 52 items, so crops would add little). Batches group
  users of similar length (`LengthBucketBatchSampler`) so that they are not
  mostly padding.

Padding is on the left (id 0). Padded query rows are allowed to attend to
themselves so that no attention row is fully masked (which would give NaN);
real positions never attend to pads, so pads cannot leak into real outputs.

Training (`train_sasrec`) goes through `accelerate.Accelerator`, so the same loop
runs on a CPU, several GPUs or several nodes. Given a `gr2model.training.resume.Checkpointer`
it saves its full state (model, optimizer, RNG states, data position, early-stopping
state, history) as the checkpointer says and resumes from the newest one
(`_TrainState`), ending with the weights of a run that was never stopped (on a CPU).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from tqdm.auto import tqdm

from gr2model.task.metrics import ranking_metrics, target_rank_full
from gr2model.training.resume import Checkpointer, skip_batches

logger = logging.getLogger("gr2model.retrieval.sasrec")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class SASRecConfig:
    """Architecture of a SASRec model.

    Defaults measured on Amazon Beauty (full ranking, 2 CPU cores): hidden 128
    beat 64 by about +0.004 test R@10 / +0.002 NDCG@10 at 1.4x the epoch time;
    256 was another 2x slower per epoch (not run to the end). Dropout 0.2/0.5 at
    hidden 64 and 0.3/0.5 at hidden 128 were tied within noise; the positional
    scheme (from the first item, from the end, none) made no measurable difference.
    """

    num_items: int  # item ids 1..num_items, 0 = padding
    max_len: int = 50  # the model sees at most the last max_len items
    hidden: int = 128
    heads: int = 2
    layers: int = 2
    dropout: float = 0.3


@dataclass
class SASRecTrainConfig:
    """How `train_sasrec` trains.

    Defaults: batch 256 at lr 3e-3 converges in about 9-10 epochs on Beauty
    (batch 128 at lr 1e-3 needs 20+ for the same validation NDCG), and a
    5,000-user validation subset costs ~1.5 s per epoch instead of ~7 s.
    """

    epochs: int = 200  # upper bound; early stopping decides when `valid` is given
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.0
    patience: int = 5  # epochs without a better validation NDCG@10 before stopping
    num_negatives: int = 0  # 0 = full softmax CE over the catalogue; >0 = sampled softmax with uniform negatives
    eval_every: int = 1
    seed: int = 0
    max_valid_users: int = 5000  # 0 = all; else a fixed random subset of the validation users


# --------------------------------------------------------------------------- model


def attention_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask for left-padded sequences (True = may attend).

    Causal, keys that are padding are masked, and every query may attend to
    itself: padded query rows would otherwise have no allowed key and SDPA would
    return NaN for them (which then poisons gradients).

    Args:
        input_ids: (B, L) item ids, 0 = padding.
    Returns:
        (B, 1, L, L) bool.
    """
    L = input_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=input_ids.device).tril()
    eye = torch.eye(L, dtype=torch.bool, device=input_ids.device)
    key_ok = (input_ids != 0)[:, None, None, :]  # (B, 1, 1, L)
    return causal & (key_ok | eye)


def positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Position of each item counted from the first real item (pads get 0).

    Args:
        input_ids: (B, L) left-padded item ids.
    Returns:
        (B, L) int64.
    """
    return ((input_ids != 0).long().cumsum(dim=1) - 1).clamp(min=0)


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.heads = heads
        self.dropout = dropout
        self.ln_attn = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_ff = nn.LayerNorm(hidden)
        # Point-wise FFN of width H as in the SASRec paper: on this data a wider
        # FFN costs time without helping (the softmax dominates anyway).
        self.ff_in = nn.Linear(hidden, hidden)
        self.ff_out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, H), mask (B, 1, L, L) bool -> (B, L, H)."""
        B, L, H = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(B, L, 3, self.heads, H // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, L, H/heads)
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, H)))
        h = self.ff_out(self.drop(F.gelu(self.ff_in(self.ln_ff(x)))))
        return x + self.drop(h)


class SASRec(nn.Module):
    """Self-attentive sequential recommender with an output layer tied to the item embedding."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden
        self.item_emb = nn.Embedding(cfg.num_items + 1, H, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, H)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(H, cfg.heads, cfg.dropout) for _ in range(cfg.layers))
        self.ln_out = nn.LayerNorm(H)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Item/position embeddings ~ N(0, 1/H): the sqrt(H)-scaled input then has unit
        scale, and tied logits (LN output of unit scale dot an item vector) start near 1."""
        std = 1.0 / math.sqrt(self.cfg.hidden)
        nn.init.normal_(self.item_emb.weight, std=std)
        nn.init.normal_(self.pos_emb.weight, std=std)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    @property
    def num_items(self) -> int:
        return self.cfg.num_items

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal hidden states.

        Args:
            input_ids: (B, L) left-padded item ids, 0 = padding, L <= max_len.
        Returns:
            (B, L, H); the row at position t summarises items 0..t and scores item t+1.
            Rows at padded positions are finite but meaningless.
        """
        if input_ids.shape[1] > self.cfg.max_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} > max_len {self.cfg.max_len}")
        real = (input_ids != 0).unsqueeze(-1)  # (B, L, 1)
        x = self.item_emb(input_ids) * math.sqrt(self.cfg.hidden) + self.pos_emb(positions(input_ids))
        # Pads enter as exact zeros, so their content cannot depend on the padding amount.
        x = self.emb_drop(x * real)
        mask = attention_mask(input_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_out(x)

    def item_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output layer: (..., H) -> (..., num_items + 1); column 0 is padding."""
        return hidden @ self.item_emb.weight.T


def _default_head_dtype(device: torch.device) -> torch.dtype:
    """bf16 for the output-layer matmuls on CPUs with native bf16 (3-4x faster GEMMs), else fp32.

    The softmax itself is always computed in fp32.
    """
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


class _ChunkedSoftmaxCE(torch.autograd.Function):
    """Full-softmax cross-entropy with tied weights, computed chunk by chunk of rows.

    The (N, V) logits matrix never exists at once: each chunk's logits, softmax
    and gradients are computed together while they are in cache, and the
    gradients w.r.t. hidden and weight are accumulated in the forward pass
    (backward only scales them). On a 2-core CPU this is ~3x faster than
    `F.cross_entropy(h @ W.T, y)` with its N x V intermediates; the FLOPs are the same.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, dtype: torch.dtype):  # type: ignore[override]
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(dtype, torch.float32)  # softmax and accumulators: at least fp32
        h_c, w_c = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hidden, dtype=acc) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, n, chunk):
            hc, yc = h_c[start:start + chunk], targets[start:start + chunk]
            logits = hc @ w_c.T  # (c, V)
            logits[:, 0] = float("-inf")  # padding is never a next item
            # torch.softmax is one fused pass; logsumexp + exp would read the chunk twice more.
            probs = torch.softmax(logits.to(acc), dim=1)
            rows = torch.arange(len(yc), device=probs.device)
            # The loss is only reported; the gradient below is exact whatever the clamp.
            total -= probs[rows, yc].clamp_min(1e-30).log().sum()
            if need_h or need_w:
                probs[rows, yc] -= 1.0  # d CE / d logits = softmax - onehot
                g = probs.to(dtype)
                if need_h:
                    grad_h[start:start + chunk] = g @ w_c
                if need_w:
                    grad_w += g.T @ hc
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = max(n, 1)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / ctx.n

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        gh = (grad_h * scale).to(ctx.dtypes[0]) if grad_h is not None else None
        gw = (grad_w * scale).to(ctx.dtypes[1]) if grad_w is not None else None
        return gh, gw, None, None, None


def softmax_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int = 128,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `targets` under softmax(hidden @ weight.T), column 0 excluded.

    Args:
        hidden: (N, H) hidden states.
        weight: (V, H) tied item embedding, row 0 = padding.
        targets: (N,) item ids in 1..V-1.
        chunk: rows per chunk (bounds memory at chunk x V).
        dtype: matmul dtype; None = bf16 on CPUs that support it natively, else fp32.
    Returns:
        () the mean loss (fp32, or fp64 when dtype is fp64).
    """
    dtype = dtype or _default_head_dtype(hidden.device)
    return _ChunkedSoftmaxCE.apply(hidden, weight, targets, chunk, dtype)


def next_item_loss(
    model: SASRec,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    num_negatives: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-item cross-entropy over the positions that have a target.

    Logits are computed only at those positions: (B*L, V) logits for every
    position would be about 128 * 50 * 12k floats per batch, mostly pads.

    Args:
        model: the SASRec.
        input_ids: (B, L) left-padded input items.
        targets: (B, L) the item that follows each input position, 0 where none.
        num_negatives: 0 = full softmax over items 1..num_items; k > 0 = sampled
            softmax against k uniform negatives shared by the batch (a negative
            equal to the row's target is masked out).
    Returns:
        loss: () mean over target positions; count: () number of target positions.
    """
    hidden = model(input_ids)  # (B, L, H)
    sel = targets != 0
    h = hidden[sel]  # (N, H)
    y = targets[sel]  # (N,)
    emb = model.item_emb.weight
    if num_negatives <= 0:
        loss = softmax_cross_entropy(h, emb, y)
    else:
        neg = torch.randint(1, model.num_items + 1, (num_negatives,), device=h.device)
        pos_logit = (h * emb[y]).sum(-1, keepdim=True)  # (N, 1)
        neg_logits = h @ emb[neg].T  # (N, k)
        neg_logits = neg_logits.masked_fill(neg[None, :] == y[:, None], float("-inf"))
        logits = torch.cat([pos_logit, neg_logits], dim=1)
        loss = F.cross_entropy(logits, torch.zeros_like(y))
    return loss, sel.sum()


class _LossModule(nn.Module):
    """Puts the loss inside forward() so that DDP/FSDP wrapping and autocast see all of it."""

    def __init__(self, model: SASRec, num_negatives: int) -> None:
        super().__init__()
        self.model = model
        self.num_negatives = num_negatives

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return next_item_loss(self.model, input_ids, targets, self.num_negatives)


# --------------------------------------------------------------------------- data


def left_pad(sequences: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Last `length` items of each sequence, left-padded with 0.

    Returns:
        (n, length) int64.
    """
    out = np.zeros((len(sequences), length), dtype=np.int64)
    for i, s in enumerate(sequences):
        tail = list(s)[-length:] if length else []
        if tail:
            out[i, length - len(tail):] = tail
    return out


def training_windows(sequences: Sequence[Sequence[int]], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-item training pairs: the last max_len + 1 items of each sequence.

    Sequences with fewer than 2 items have no target and are dropped.

    Returns:
        inputs: (n, max_len) window[:-1], left-padded; targets: (n, max_len) window[1:].
    """
    windows = [list(s)[-(max_len + 1):] for s in sequences if len(s) >= 2]
    inputs = left_pad([w[:-1] for w in windows], max_len)
    targets = left_pad([w[1:] for w in windows], max_len)
    return inputs, targets


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Shuffled batches of similar length, so that a batch is padded only to its own longest row.

    Beauty sequences are short (median 6) with a long tail, so a random batch of
    128 almost always contains a row of length 50 and is mostly padding. Here each
    epoch shuffles all rows, cuts them into pools of `pool_batches` batches, sorts
    each pool by length, cuts it into batches and shuffles the batches: batches
    stay random in content and order, but are 3-4x cheaper. Deterministic given
    the seed, and identical on every process (each draws the same sequence), which
    accelerate's batch sharding relies on.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, seed: int, pool_batches: int = 50) -> None:
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.pool = batch_size * pool_batches
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return (len(self.lengths) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        perm = self.rng.permutation(len(self.lengths))
        batches: list[list[int]] = []
        for start in range(0, len(perm), self.pool):
            pool = perm[start:start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches.extend(pool[i:i + self.batch_size].tolist() for i in range(0, len(pool), self.batch_size))
        for i in self.rng.permutation(len(batches)):
            yield batches[i]


# --------------------------------------------------------------------------- scoring


class SASRecScorer:
    """`gr2model.retrieval.scoring.Scorer` for a SASRec: log-softmax over the catalogue of the next item.

    The model is moved to `device` and put in eval mode.
    """

    def __init__(self, model: SASRec, *, batch_size: int = 512, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.batch_size = batch_size
        self.num_items = model.num_items

    @torch.no_grad()
    def score(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """Scores of every item as the next one after each history.

        Only the last max_len items of a history are used; an empty history gets
        the scores of an all-padding input (finite, not meaningful).

        Returns:
            (n, num_items + 1) float32 log-probabilities; column 0 (padding) is -inf.
        """
        n = len(histories)
        out = np.empty((n, self.num_items + 1), dtype=np.float32)
        max_len = self.model.cfg.max_len
        for start in range(0, n, self.batch_size):
            part = histories[start:start + self.batch_size]
            # Pad only to the longest history in the chunk: positions are counted
            # from the first real item, so the padding amount does not matter.
            length = max(1, min(max_len, max(len(h) for h in part)))
            ids = torch.from_numpy(left_pad(part, length)).to(self.device)
            logits = self.model.item_logits(self.model(ids)[:, -1]).float()
            logits[:, 0] = float("-inf")
            out[start:start + len(part)] = torch.log_softmax(logits, dim=-1).cpu().numpy()
        return out


# --------------------------------------------------------------------------- training


@dataclass
class SASRecTrainResult:
    """What `train_sasrec` returns."""

    model: SASRec  # best-on-validation weights (last epoch when no validation), unwrapped, on CPU, eval mode
    best_epoch: int  # 1-based
    best_valid: dict[str, float]  # {"recall@5", "ndcg@5", "recall@10", "ndcg@10", "n"}; {} without validation
    history: list[dict[str, float]] = field(default_factory=list)  # per epoch: epoch, loss, seconds[, valid_recall@10, valid_ndcg@10, ...]


def _evaluate_sharded(
    model: SASRec,
    histories: Sequence[Sequence[int]],
    targets: np.ndarray,
    accelerator: Accelerator,
    batch_size: int,
) -> dict[str, float]:
    """Full-ranking metrics over the validation users, each process scoring its own shard.

    Ranks are gathered so that every process gets the same metrics (and so takes
    the same early-stopping decision).
    """
    shards = np.array_split(np.arange(len(targets)), accelerator.num_processes)
    idx = shards[accelerator.process_index]
    scorer = SASRecScorer(model, batch_size=batch_size, device=accelerator.device)
    ranks = np.empty(len(idx), dtype=np.int64)
    for start in range(0, len(idx), 2048):  # chunks bound the (n, V) score matrix
        sub = idx[start:start + 2048]
        hist = [histories[i] for i in sub]
        ranks[start:start + len(sub)] = target_rank_full(scorer.score(hist), targets[sub], hist)
    if accelerator.num_processes > 1:
        # Shards differ in size by at most one: pad with -2 and drop it after the gather.
        longest = max(len(s) for s in shards)
        padded = np.full(longest, -2, dtype=np.int64)
        padded[: len(ranks)] = ranks
        gathered = accelerator.gather(torch.from_numpy(padded).to(accelerator.device)).cpu().numpy()
        ranks = gathered[gathered != -2]
    return ranking_metrics(ranks, (5, 10), (5, 10))


class _TrainState:
    """`train_sasrec`'s own resumable state (`gr2model.training.resume.Stateful`): everything the
    loop carries from one step to the next besides the model, the optimizer and the
    global RNG states (which accelerate saves).

    Position: step (optimizer steps done), epoch (1-based, the one in progress), batch
    (its batches done) and epoch_start, the batch sampler's numpy generator state when
    the epoch's order was drawn, from which that order is drawn again on resume.
    The epoch's running loss sums, so that its logged loss covers all its batches.
    Early stopping: best_ndcg, best_epoch, best_valid and best_state (the best epoch's
    weights, on CPU); the patience counter is `epoch - best_epoch`, so it needs no
    field of its own. history: the per-epoch rows (the list `train_sasrec` returns,
    updated in place). finished: training is over (stopped early or out of epochs),
    so a restored finished state trains nothing.
    """

    def __init__(self, sampler: LengthBucketBatchSampler, history: list[dict[str, float]], device: torch.device) -> None:
        self._sampler = sampler
        self._device = device
        self.history = history
        self.step, self.epoch, self.batch = 0, 1, 0
        self.epoch_start: dict[str, Any] | None = None
        self.epoch_t0 = time.perf_counter()
        self.loss_sum = torch.zeros((), device=device)
        self.count_sum = torch.zeros((), device=device)
        self.best_ndcg, self.best_epoch = -1.0, 0
        self.best_valid: dict[str, float] = {}
        self.best_state: dict[str, torch.Tensor] | None = None
        self.finished = False

    def begin_epoch(self) -> None:
        """Mark the start of a fresh epoch (before its order is drawn)."""
        self.batch = 0
        self.epoch_start = copy.deepcopy(self._sampler.rng.bit_generator.state)
        self.epoch_t0 = time.perf_counter()
        self.loss_sum = torch.zeros((), device=self._device)
        self.count_sum = torch.zeros((), device=self._device)

    def rewind_epoch(self) -> None:
        """Put the sampler back to where the interrupted epoch drew its order."""
        self._sampler.rng.bit_generator.state = copy.deepcopy(self.epoch_start)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch": self.batch, "epoch_start": self.epoch_start,
            # The interrupted epoch's time so far: its logged `seconds` then still covers all of it.
            "epoch_seconds": time.perf_counter() - self.epoch_t0,
            "loss_sum": self.loss_sum.detach().cpu(), "count_sum": self.count_sum.detach().cpu(),
            "best_ndcg": self.best_ndcg, "best_epoch": self.best_epoch, "best_valid": dict(self.best_valid),
            "best_state": self.best_state, "history": list(self.history), "finished": self.finished,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.batch = state["step"], state["epoch"], state["batch"]
        self.epoch_start = state["epoch_start"]
        self.epoch_t0 = time.perf_counter() - state["epoch_seconds"]
        self.loss_sum = state["loss_sum"].to(self._device)
        self.count_sum = state["count_sum"].to(self._device)
        self.best_ndcg, self.best_epoch = state["best_ndcg"], state["best_epoch"]
        self.best_valid = dict(state["best_valid"])
        self.best_state = state["best_state"]
        self.history[:] = state["history"]
        self.finished = state["finished"]


def train_sasrec(
    train_sequences: Sequence[Sequence[int]],
    cfg: SASRecConfig,
    tcfg: SASRecTrainConfig,
    *,
    valid: tuple[Sequence[Sequence[int]], np.ndarray] | None = None,
    on_epoch: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    checkpointer: Checkpointer | None = None,
) -> SASRecTrainResult:
    """Train a SASRec on next-item prediction, with early stopping on validation NDCG@10.

    Args:
        train_sequences: each user's training items, oldest first; every item
            after the first is a target (only the last max_len + 1 items are used).
        cfg: architecture.
        tcfg: optimisation; with `valid`, training stops after `patience` epochs
            without a better NDCG@10 and the best epoch's weights are returned;
            without it exactly `tcfg.epochs` epochs are trained.
        valid: (histories, targets (n,) int) scored by full ranking with the
            history items excluded.
        on_epoch: called on the main process only with each epoch's history dict;
            on a resume it first receives the restored rows.
        accelerator: the Accelerator to run under; by default a new one (CPU-only
            when no GPU is present, so that a torchrun launch on CPUs gives DDP).
        checkpointer: when given, training starts from its newest saved state
            (`_TrainState` plus model, optimizer and RNG states; see
            `gr2model.training.resume`), saves after the optimizer steps it says are due and
            once more when training is over. A resumed run draws the interrupted
            epoch's order again and skips the batches already done, so it ends with
            the weights, history and early-stopping decision of a run that was never
            stopped (on a CPU); a finished state trains nothing.
    Returns:
        SASRecTrainResult; identical on every process.
    """
    if accelerator is None:
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(tcfg.seed)
    main = accelerator.is_main_process

    inputs, targets = training_windows(train_sequences, cfg.max_len)
    if len(inputs) == 0:
        raise ValueError("no training sequence has 2 or more items")
    # Length-bucketed, seeded shuffling: see LengthBucketBatchSampler.
    sampler = LengthBucketBatchSampler((inputs != 0).sum(axis=1), tcfg.batch_size, tcfg.seed)
    loader = DataLoader(TensorDataset(torch.from_numpy(inputs), torch.from_numpy(targets)), batch_sampler=sampler)
    model = SASRec(cfg)
    # The fused AdamW kernel is ~5x faster than the per-parameter loop on a CPU,
    # where the optimizer step is a visible share of a small model's step.
    fused = accelerator.device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay, fused=fused)
    wrapped, optimizer, loader = accelerator.prepare(_LossModule(model, tcfg.num_negatives), optimizer, loader)
    inner: SASRec = accelerator.unwrap_model(wrapped).model

    if valid is not None:
        v_hist, v_targets = valid
        v_targets = np.asarray(v_targets, dtype=np.int64)
        if 0 < tcfg.max_valid_users < len(v_targets):
            # A fixed subset (same every epoch) so that epochs are comparable.
            keep = np.sort(np.random.default_rng(tcfg.seed).choice(len(v_targets), tcfg.max_valid_users, replace=False))
            v_hist = [v_hist[i] for i in keep]
            v_targets = v_targets[keep]

    history: list[dict[str, float]] = []
    # The sampler object is shared with the prepared loader (accelerate wraps it, it
    # does not copy it), so its generator is the one that draws the batches.
    state = _TrainState(sampler, history, accelerator.device)
    restored_finished = False
    if checkpointer is not None:
        checkpointer.attach(accelerator, state)
        if checkpointer.restore() > 0:
            restored_finished = state.finished
            checkpointer.replay(history, on_epoch)
    if tcfg.epochs < 1:
        state.finished = True

    while not state.finished:
        epoch = state.epoch
        wrapped.train()
        if state.batch:  # resumed inside this epoch: its order again, minus what was done
            state.rewind_epoch()
            batches = skip_batches(loader, state.batch)
        else:
            state.begin_epoch()
            batches = iter(loader)
        bar = tqdm(batches, total=len(loader), initial=state.batch, desc=f"sasrec epoch {epoch}", disable=not main,
                   leave=False)
        for inp, tgt in bar:
            # Trim leading columns that are padding in every row: most users are short.
            first = int((inp != 0).any(dim=0).long().argmax())
            inp, tgt = inp[:, first:], tgt[:, first:]
            loss, count = wrapped(inp, tgt)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            state.loss_sum += loss.detach() * count
            state.count_sum += count
            state.step, state.batch = state.step + 1, state.batch + 1
            if main and state.batch % 20 == 1:  # .item() syncs an accelerator; do it rarely
                bar.set_postfix(loss=f"{loss.item():.4f}")
            if checkpointer is not None:
                checkpointer.step_done(state.step)
        loss_sum = accelerator.reduce(state.loss_sum, "sum")
        count_sum = accelerator.reduce(state.count_sum, "sum")
        row: dict[str, float] = {"epoch": epoch, "loss": float(loss_sum / count_sum.clamp(min=1))}

        improved = False
        if valid is not None and (epoch % tcfg.eval_every == 0 or epoch == tcfg.epochs):
            metrics = _evaluate_sharded(inner, v_hist, v_targets, accelerator, batch_size=512)
            row.update({f"valid_{k}": v for k, v in metrics.items() if k != "n"})
            if metrics["ndcg@10"] > state.best_ndcg:
                improved = True
                state.best_ndcg, state.best_epoch, state.best_valid = metrics["ndcg@10"], epoch, metrics
                state.best_state = {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}
        row["seconds"] = time.perf_counter() - state.epoch_t0
        history.append(row)
        if main:
            valid_txt = "".join(f" {k}={v:.4f}" for k, v in row.items() if k.startswith("valid_"))
            logger.info(
                "epoch %d loss=%.4f%s %.1fs%s", epoch, row["loss"], valid_txt, row["seconds"], " *" if improved else ""
            )
            if on_epoch is not None:
                on_epoch(row)
        state.epoch, state.batch = epoch + 1, 0
        if valid is not None and state.best_epoch and epoch - state.best_epoch >= tcfg.patience:
            if main:
                logger.info("early stop at epoch %d; best epoch %d ndcg@10=%.4f", epoch, state.best_epoch, state.best_ndcg)
            state.finished = True
        state.finished = state.finished or epoch >= tcfg.epochs
    if checkpointer is not None and not restored_finished and state.step > 0:
        # The state after training (history, best weights): a stage killed before
        # writing its outputs then skips this training on rerun. (No step, no state:
        # `restore` takes step 0 for a fresh start.)
        checkpointer.step_done(state.step, final=True)

    result_model = copy.deepcopy(inner).cpu()
    best_epoch = state.best_epoch
    if state.best_state is not None:
        result_model.load_state_dict(state.best_state)
    else:
        best_epoch = len(history)
    accelerator.free_memory()
    return SASRecTrainResult(
        model=result_model.eval(), best_epoch=best_epoch, best_valid=state.best_valid, history=history
    )


# --------------------------------------------------------------------------- persistence


def save_sasrec(model: SASRec, out_dir: Path) -> None:
    """Write `config.json` and `model.safetensors` into out_dir (created if needed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_NAME).write_text(json.dumps(asdict(model.cfg), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_NAME))


def load_sasrec(out_dir: Path) -> SASRec:
    """Inverse of `save_sasrec`: the model on CPU, in eval mode."""
    out_dir = Path(out_dir)
    cfg = SASRecConfig(**json.loads((out_dir / CONFIG_NAME).read_text()))
    model = SASRec(cfg)
    model.load_state_dict(load_file(str(out_dir / WEIGHTS_NAME)))
    return model.eval()
