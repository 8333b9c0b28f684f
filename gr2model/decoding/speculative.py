"""Speculative decoding: a block-diffusion model drafts, the AR model (GR2) verifies.

`speculative_generate` returns exactly what the AR model would decode: under
greedy decoding the same tokens as `ar_generate`, under sampling the same
distribution (the speculative-sampling rule of Leviathan et al. 2023 / Chen et
al. 2023). The speed comes from verifying several drafted tokens in one AR
forward. Each round, per active row:

1. draft: the drafter proposes up to k tokens after the row's accepted
   prefix (`Drafter.draft`; `DiffusionDrafter` denoises them in a few steps
   of the block-diffusion model);
2. verify: one AR forward over [last accepted token, d_1 .. d_k] with the AR
   KV cache holding everything before: its k + 1 logits score every draft
   token and give the token after the last one;
3. accept: greedy, the longest draft prefix equal to the AR argmax, then the
   AR argmax after it (a correction, or a bonus token when every draft
   token was accepted); sampling, d_i is accepted with probability
   min(1, p_i(d_i) / q_i(d_i)) in order, the first rejected position is
   resampled from normalize(max(p_i - q_i, 0)), and when all are accepted a
   bonus token is drawn from p_{k+1}. So every round adds >= 1 token;
4. roll back: the AR cache keeps [last, d_1 .. d_n] (n accepted) and drops
   the rest; the drafter drops its rejected drafts.

Why the AR cache is ragged: rows accept different numbers of tokens, and HF's
`Cache.crop` removes the same number of columns from every row. So the AR
cache reuses the block decoder's ragged cache (`RaggedLayer`, `WritePlan`):
each row writes its verify chunk after its own kept columns, every slot has a
position id and a validity flag, and the mask is the causal mask of the
position ids (`block_diffusion_mask` with block size 1). Rolling a row back is
lowering its kept length and marking the dropped slots invalid; they are
overwritten by its next chunk. The AR cache never holds the last accepted
token: it is the first query of the next verify forward (whose logits predict
d_1), so the prefill covers the prompt minus its last token and no AR forward
is spent on a token nobody drafted.

Why the diffusion drafter needs no rollback: it reuses the block decoder's
cache (`diffusion_decode.CachedForward`), which only ever holds the prompt
and finished blocks, i.e. blocks whose B tokens are all accepted. The active
block (accepted tokens of it, then mask tokens) is recomputed by every draft
forward anyway, as in block-diffusion decoding, so a rejected draft just turns
back into mask tokens. Drafting stays aligned to the model's blocks (the
drafted positions are the next ones of the row's active block, after its
accepted ones, at most up to the block end), which is the canvas the model
was trained and decodes on; a draft therefore holds min(k, B - j) tokens
where j is the number of accepted tokens in the active block.

`WindowDrafter` trades that canvas for a cheaper forward: its cache holds
every accepted token as it was fed (computed once, in the round after it was
accepted, next to that round's mask window), so each round forwards only the
last verification's tokens and k mask tokens; the window's slots are rolled
back after the draft, like the verifier's rejected ones.

Exactness of the sampling rule needs q_i = the law of d_i given the context
and d_1 .. d_{i-1}. The diffusion drafter samples each committed position
from softmax(logits / T) of the step that commits it, so under sampling it
commits left to right on a fixed schedule (which positions a step commits does
not depend on what was sampled, and d_i never sees a later d_j): then that
softmax is exactly the conditional law, and it is the q returned. Under greedy
decoding q is not used, and the drafter commits the most confident positions
first, as the block decoder does.

Counts (`SpeculativeDecodeOutput`): forwards of each model, draft rounds,
verify forwards, and per row the number of draft tokens accepted at each of
its verifications.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from transformers import Cache, PreTrainedModel

from gr2model.decoding.ar_decode import DecodeOutput, left_pad_positions, ar_generate, left_pad
from gr2model.models.block_diffusion import block_diffusion_mask, block_diffusion_settings

# The block decoder's cache pieces, reused rather than copied: the drafter's
# forward is exactly its cached forward, and the AR verifier needs the same
# per-row write columns.
from gr2model.decoding.diffusion_decode import CachedForward, RaggedLayer, WritePlan, attention_mask_or_none, no_mask_mapping

__all__ = [
    "Draft",
    "Drafter",
    "DiffusionDrafter",
    "WindowDrafter",
    "DRAFT_MODES",
    "diffusion_drafter",
    "SpeculativeDecodeOutput",
    "sampling_probs",
    "accept_greedy",
    "accept_sampling",
    "speculative_generate",
    "SpeculativeBenchmark",
    "speculative_benchmark",
]


# ---------------------------------------------------------------- output


@dataclass
class SpeculativeDecodeOutput(DecodeOutput):
    """What `speculative_generate` produced: the fields of `DecodeOutput`, plus the counts.

    `nfe` is the forwards of both models together (ar_nfe + draft_nfe).

    Attributes:
        ar_nfe: AR forwards: the prefill (when a prompt has > 1 token) and one
            per verification round.
        draft_nfe: drafter forwards.
        drafts: draft rounds (batch calls of the drafter).
        verifications: verify forwards of the AR model (batch-level).
        accepted_lengths: per row, for each verification of that row, how many
            draft tokens it accepted and kept (0 .. drafted; an eos among them
            cuts the ones after it, which are not counted).
        drafted_tokens: draft tokens proposed, all rows and rounds.
        batch_size: rows of the call (for the per-token ratios).
    """

    ar_nfe: int = 0
    draft_nfe: int = 0
    drafts: int = 0
    verifications: int = 0
    accepted_lengths: list[list[int]] = field(default_factory=list)
    drafted_tokens: int = 0
    batch_size: int = 1

    @property
    def row_verifications(self) -> int:
        """Verifications summed over rows (a batch verify forward counts once per active row)."""
        return sum(len(a) for a in self.accepted_lengths)

    @property
    def accepted_tokens(self) -> int:
        """Accepted draft tokens, all rows (the tokens the AR model wrote itself are not counted)."""
        return sum(sum(a) for a in self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per row verification."""
        n = self.row_verifications
        return self.accepted_tokens / n if n else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def ar_forwards_per_token(self) -> float:
        """AR forwards per generated token of one row: ar_nfe * batch_size / generated_tokens (as `gr2model.eval.bench`)."""
        return self.ar_nfe * self.batch_size / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def draft_forwards_per_token(self) -> float:
        """Drafter forwards per generated token of one row: draft_nfe * batch_size / generated_tokens."""
        return self.draft_nfe * self.batch_size / self.generated_tokens if self.generated_tokens else 0.0


# ---------------------------------------------------------------- drafters


class Draft(NamedTuple):
    """A drafter's proposal for the N active rows.

    tokens: (N, K) long, row r's drafted tokens in its first lengths[r] columns
        (the rest is ignored); K = max(lengths), may be 0.
    lengths: (N,) long, how many tokens each row drafted (<= what was asked).
    probs: None under greedy decoding; under sampling (N, K, V) float, q: the
        distribution each drafted token was drawn from, given the context and
        the row's earlier drafted tokens (V = the AR vocabulary).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None


class Drafter(Protocol):
    """Proposes tokens after each row's accepted prefix. Stateful within one `speculative_generate` call.

    `nfe` counts its model forwards (reset by `begin`).
    """

    nfe: int

    def begin(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, vocab_size: int) -> None:
        """Start a call: (N, T) left-padded prompt ids and their 0/1 mask; drafts only use ids < vocab_size."""
        ...

    def draft(
        self,
        response: torch.Tensor,
        length: torch.Tensor,
        count: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None,
    ) -> Draft:
        """Draft up to count[r] tokens after row r's accepted response.

        Args:
            response: (N, L) long, each active row's accepted response tokens
                in its first length[r] columns (the rest is garbage).
            length: (N,) long, accepted tokens per row.
            count: (N,) long >= 0, how many tokens to draft at most.
            temperature: 0 drafts greedily; > 0 samples, and the Draft carries q.
        """
        ...

    def select(self, alive: torch.Tensor) -> None:
        """Keep only the rows `alive` ((n,) long indices into the current rows), in that order."""
        ...


def _empty_draft(rows: int, lengths: torch.Tensor, temperature: float, vocab_size: int) -> Draft:
    """A round in which no row drafts: (N, 0) tokens, and (N, 0, V) q under sampling."""
    device = lengths.device
    probs = torch.zeros((rows, 0, vocab_size), device=device) if temperature > 0 else None
    return Draft(torch.zeros((rows, 0), dtype=torch.long, device=device), lengths, probs)


class _DraftSteps:
    """Which draft positions each denoising step of a drafter commits, and to what.

    Step s of `steps` commits ceil(open / (steps - s)) of a row's open draft
    positions: the most confident first under greedy decoding (confidence = the
    max softmax probability, as the block decoder's `propose`), left to right
    under sampling, whatever was sampled, so that the softmax each token is
    drawn from is its exact law given the context and the earlier drafts (the
    q of the speculative-sampling rule, kept in `probs`). The last step commits
    every open position.

    Args:
        in_draft: (N, k) bool, the positions each row drafts (its first n[r]).
        steps: denoising forwards of the round.
        temperature: 0 greedy, > 0 sampling (with `generator`).
        vocab_size: the verifier's V: ids >= V are never drafted.
    """

    def __init__(
        self, in_draft: torch.Tensor, steps: int, temperature: float, generator: torch.Generator | None, vocab_size: int
    ) -> None:
        rows, k = in_draft.shape
        self.open_ = in_draft.clone()
        self.steps, self.step = steps, 0
        self.temperature, self.generator, self.vocab_size = temperature, generator, vocab_size
        self.tokens = torch.zeros((rows, k), dtype=torch.long, device=in_draft.device)
        self.probs = torch.zeros((rows, k, vocab_size), device=in_draft.device) if temperature > 0 else None

    @property
    def finished(self) -> bool:
        return not bool(self.open_.any())

    def commit(self, logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One step from (N, k, V') logits at the draft positions: (chosen (N, k) bool, proposals (N, k) long)."""
        rows, k = self.open_.shape
        logits = logits.float()
        # Never draft the mask token nor an id the verifier does not have.
        logits[..., mask_id] = float("-inf")
        logits = logits[..., : self.vocab_size]
        left = self.open_.sum(1)
        steps_left = self.steps - self.step
        quota = torch.div(left + steps_left - 1, steps_left, rounding_mode="floor")  # ceil
        if self.probs is not None:
            q = torch.softmax(logits / self.temperature, dim=-1)
            tok = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=self.generator).view(rows, k)
            # Left to right: the first `quota` open positions, whatever was sampled.
            rank = self.open_.long().cumsum(1)
            chosen = self.open_ & (rank <= quota[:, None])
            self.probs = torch.where(chosen[:, :, None], q, self.probs)
        elif steps_left == 1:
            # The last step commits every open position: no ranking needed.
            tok = logits.max(-1).indices
            chosen = self.open_
        else:
            best, tok = logits.max(-1)
            conf = torch.exp(best - torch.logsumexp(logits, dim=-1)).masked_fill(~self.open_, float("-inf"))
            # The `quota` most confident open positions (ties: the first).
            order = conf.argsort(dim=1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=order.device).expand(rows, -1))
            chosen = self.open_ & (rank < quota[:, None])
        self.tokens = torch.where(chosen, tok, self.tokens)
        self.open_ = self.open_ & ~chosen
        self.step += 1
        return chosen, tok


class DiffusionDrafter:
    """Drafts with a block-diffusion model, using the block decoder's cache (module docstring).

    Each draft round fills the next positions of each row's active block
    (after its accepted tokens, up to min(count, block end)) in at most `steps`
    forwards: step s commits ceil(open / (steps - s)) of a row's open draft
    positions, the most confident first under greedy decoding, left to right
    under sampling (needed for an exact q). The first forward of a round also
    caches the block that the last verification finished, if any.

    Args:
        model: a block-diffusion model (`convert_to_block_diffusion`, or any
            causal LM whose forward takes 4D boolean masks), in eval mode.
        steps: denoising forwards per draft round, >= 1 (1: all draft tokens
            of a round from one forward, in parallel).
        block_size, mask_id: the model's; None reads them from its config
            (`block_diffusion_settings`).
    """

    def __init__(
        self, model: PreTrainedModel, steps: int, block_size: int | None = None, mask_id: int | None = None
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if block_size is None or mask_id is None:
            cfg_block, cfg_mask = block_diffusion_settings(model)
            block_size = cfg_block if block_size is None else block_size
            mask_id = cfg_mask if mask_id is None else mask_id
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model, self.steps, self.block_size, self.mask_id = model, steps, block_size, mask_id
        self.nfe = 0

    def begin(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, vocab_size: int) -> None:
        bsz = self.block_size
        # One extra block: a row may accept up to max_new_tokens tokens and the
        # canvas of its active block must still fit.
        self.span = (math.ceil(max_new_tokens / bsz) + 1) * bsz
        self.forward = CachedForward(self.model, ids, attention_mask, bsz, self.span, self.mask_id)
        self.plen = attention_mask.sum(-1)
        self.start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)  # active block's first position
        self.prefilled = False
        self.vocab_size = vocab_size
        self.nfe = 0

    def select(self, alive: torch.Tensor) -> None:
        self.forward.select(alive, alive.tolist())
        self.plen, self.start = self.plen[alive], self.start[alive]

    def _run(self, canvas: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One forward; first moves `start` one block towards `target` where a block was finished. (N, B, V) logits."""
        self.nfe += 1
        if not self.prefilled:
            self.prefilled = True
            return self.forward(canvas, self.start, self.plen, None, None)
        ctx = self.start < target
        self.start = self.start + self.block_size * ctx.long()
        return self.forward(canvas, self.start, self.plen, ctx, ctx.tolist())

    @torch.inference_mode()
    def draft(
        self,
        response: torch.Tensor,
        length: torch.Tensor,
        count: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None,
    ) -> Draft:
        bsz, device = self.block_size, response.device
        rows = response.shape[0]
        cols = torch.arange(self.span, device=device)
        # The canvas: accepted tokens, mask everywhere else (this is the rollback
        # of rejected drafts).
        width = min(response.shape[1], self.span)
        canvas = torch.full((rows, self.span), self.mask_id, dtype=torch.long, device=device)
        canvas[:, :width] = torch.where(cols[None, :width] < length[:, None], response[:, :width], self.mask_id)
        target = torch.div(length, bsz, rounding_mode="floor") * bsz  # the active block's start after this round
        j = length - target  # accepted tokens inside it
        n = torch.minimum(count.clamp(min=0), bsz - j)  # drafted tokens: up to the block end
        k = int(n.max()) if rows else 0
        if k == 0:
            return _empty_draft(rows, n, temperature, self.vocab_size)
        # Bring the drafter's cache up to date. Invariant: after the first
        # forward of the drafting loop below, every row's active block is the
        # block holding its next position (start == target) and the cache holds
        # all blocks before it. A forward advances a row by at most one block
        # (the one it caches); a round finishes at most one block when B >= 2
        # (it accepts <= B - j + 1 tokens), so the catch-up forwards only run
        # for B = 1 or a drafter that starts after tokens were accepted.
        ready: torch.Tensor | None = None  # logits of a setup forward that the first step may use
        if not self.prefilled:
            logits0 = self._run(canvas, target)  # prompt + block 0 as mask tokens
            # Usable as the first step only if block 0's canvas really is all masks.
            ready = logits0 if not bool((length > 0).any()) else None
        while bool((self.start + bsz < target).any()):
            self._run(canvas, target - bsz)  # caches one block of every row lagging two or more
            ready = None

        win = j[:, None] + torch.arange(k, device=device)  # (N, k) block positions of the draft
        in_draft = torch.arange(k, device=device)[None, :] < n[:, None]  # (N, k)
        win = win.clamp(max=bsz - 1)
        denoise = _DraftSteps(in_draft, self.steps, temperature, generator, self.vocab_size)
        for step in range(self.steps):
            if denoise.finished:
                break
            if step == 0 and ready is not None:
                logits = ready
            else:
                logits = self._run(canvas, target)  # (N, B, V); the first one caches a just-finished block
            chosen, tok = denoise.commit(logits.gather(1, win[:, :, None].expand(-1, -1, logits.shape[-1])), self.mask_id)
            if step == self.steps - 1:
                break  # the canvas is not read again
            # Write only the chosen positions (the clamped columns past a row's
            # draft repeat a block position, so a scatter of all could collide).
            r_idx, c_idx = chosen.nonzero(as_tuple=True)
            canvas[r_idx, self.start[r_idx] + win[r_idx, c_idx]] = tok[r_idx, c_idx]
        return Draft(denoise.tokens, n, denoise.probs)


class WindowDrafter:
    """Drafts with a block-diffusion model over a window of mask tokens right after each row's accepted prefix.

    `DiffusionDrafter` decodes on the model's own canvas: every round's forward
    covers the whole active block (its accepted tokens recomputed, mask tokens
    up to the block end), plus the block that finished, if any. On a CPU, where
    a forward's cost grows with its positions, that is a wide forward per round
    for about five accepted tokens. This drafter keeps a KV cache of every
    accepted token instead, as computed in the round that fed it, and each
    round's forward holds only the tokens the cache lacks (those of the last
    verification) and then k mask tokens, all seeing each other and the cache:
    the block decoder's view of an active block (accepted tokens, then masks,
    bidirectional), except that the earlier tokens' keys and values are not
    recomputed as the block fills and the window ignores the model's block
    boundaries. It may draft worse than `DiffusionDrafter` for that; what the
    speculative decoder returns is the verifier's either way.

    Steps, commit order and q under sampling are `DiffusionDrafter`'s: each
    step is a forward over the same chunk with the window's committed tokens
    written in, and only the last forward's keys and values of the fed tokens
    are kept.

    Args:
        model: a block-diffusion model, in eval mode.
        steps: forwards per draft round, >= 1.
        mask_id: the model's; None reads it from its config.
    """

    def __init__(self, model: PreTrainedModel, steps: int, mask_id: int | None = None) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if mask_id is None:
            _, mask_id = block_diffusion_settings(model)
        self.model, self.steps, self.mask_id = model, steps, mask_id
        self.nfe = 0

    def begin(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, vocab_size: int) -> None:
        rows, prompt_len = ids.shape
        # Columns: the prompt, the accepted tokens, then a round's chunk (its fed
        # tokens <= the last round's draft + 1, its window <= max_new_tokens).
        self.cache = _AcceptedKVCache(self.model, rows, prompt_len + 3 * max_new_tokens + 1, ids.device)
        self.vocab_size = vocab_size
        # The prompt but its last token, causal as in every block-diffusion prefill;
        # the last one is fed with the first window (its logits predict the first draft).
        self.nfe = self.cache.prefill(ids, attention_mask)
        self.plen = attention_mask.sum(-1)
        self.last_prompt = ids[:, -1]
        self.fed = self.plen - 1  # real tokens (prompt, then response) in the cache

    def select(self, alive: torch.Tensor) -> None:
        self.cache.select(alive, alive.tolist())
        self.plen, self.last_prompt, self.fed = self.plen[alive], self.last_prompt[alive], self.fed[alive]

    @torch.inference_mode()
    def draft(
        self,
        response: torch.Tensor,
        length: torch.Tensor,
        count: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None,
    ) -> Draft:
        rows, device = response.shape[0], response.device
        n = count.clamp(min=0)
        k = int(n.max()) if rows else 0
        if k == 0:
            return _empty_draft(rows, n, temperature, self.vocab_size)
        # The chunk of row r: its m[r] >= 1 tokens the cache lacks (the last
        # accepted one always), then n[r] mask tokens (a row's window does not
        # depend on its neighbours), then invalid filler up to the widest row.
        m = self.plen + length - self.fed
        width = int(m.max()) + k
        ar = torch.arange(width, device=device)
        seq = torch.cat([self.last_prompt[:, None], response], dim=1)  # seq[:, e]: position plen - 1 + e
        src = (self.fed - self.plen + 1)[:, None] + ar
        is_fed = ar[None, :] < m[:, None]
        chunk = torch.where(is_fed, seq.gather(1, src.clamp(max=seq.shape[1] - 1)), self.mask_id)
        valid = ar[None, :] < (m + n)[:, None]
        pos = self.fed[:, None] + ar
        # Draft position i is predicted at column m - 1 + i (the token shift).
        keep = (m - 1)[:, None] + ar[:k]
        kept0 = self.cache.kept
        denoise = _DraftSteps(ar[None, :k] < n[:, None], self.steps, temperature, generator, self.vocab_size)
        for step in range(self.steps):
            if step:
                self.cache.keep(kept0)  # the next forward rewrites the same columns
            logits = self.cache.forward(chunk, pos, valid, keep, bidirectional=True)  # (N, k, V)
            self.nfe += 1
            chosen, tok = denoise.commit(logits, self.mask_id)
            if step == self.steps - 1 or denoise.finished:
                break
            r_idx, c_idx = chosen.nonzero(as_tuple=True)
            chunk[r_idx, m[r_idx] + c_idx] = tok[r_idx, c_idx]
        # Keep the fed tokens; the window's slots roll back.
        self.cache.keep(kept0 + m)
        self.fed = self.fed + m
        return Draft(denoise.tokens, n, denoise.probs)


DRAFT_MODES = ("block", "window")  # `DiffusionDrafter`, `WindowDrafter`


def diffusion_drafter(model: PreTrainedModel, steps: int, mode: str = "block") -> Drafter:
    """The drafter of a block-diffusion model: "block" (`DiffusionDrafter`, the model's own canvas) or
    "window" (`WindowDrafter`, a window after the accepted tokens, which are cached as fed). ValueError otherwise."""
    if mode == "block":
        return DiffusionDrafter(model, steps)
    if mode == "window":
        return WindowDrafter(model, steps)
    raise ValueError(f"draft mode must be one of {DRAFT_MODES}, got {mode!r}")


# ---------------------------------------------------------------- acceptance rules


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """The distribution `ar_generate` samples from: softmax(logits / T), within the top_k logits if top_k > 0.

    Ties at the k-th value are kept (as `ar_decode._pick` and HF). (..., V) -> (..., V) float32.
    """
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def accept_greedy(
    draft: torch.Tensor, lengths: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the longest draft prefix equal to the verifier's argmax, then its next argmax.

    Args:
        draft: (N, K) long drafted tokens (row r's first lengths[r] count).
        lengths: (N,) long drafted tokens per row.
        target_logits: (N, K + 1, V) the verifier's logits at [last, d_1 .. d_K]:
            column i predicts draft position i (token shift).
    Returns:
        accepted: (N,) long, accepted draft tokens n (0 .. lengths).
        next_token: (N,) long, the verifier's argmax after d_1 .. d_n.
    """
    best = target_logits.argmax(-1)  # (N, K + 1)
    k = draft.shape[1]
    valid = torch.arange(k, device=draft.device)[None, :] < lengths[:, None]
    match = (draft == best[:, :k]) & valid
    accepted = match.long().cumprod(1).sum(1)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def accept_sampling(
    draft: torch.Tensor,
    lengths: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule: the emitted tokens are distributed as the verifier's p exactly.

    d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order; the
    first rejected position is resampled from normalize(max(p_i - q_i, 0));
    when every draft token is accepted, a bonus token comes from p_{n+1}.

    Args:
        draft: (N, K) long, d_i drawn from draft_probs[:, i] (first lengths[r] count).
        lengths: (N,) long drafted tokens per row.
        draft_probs: (N, K, V) q_i.
        target_probs: (N, K + 1, V) p_i: column i is the verifier's
            distribution for draft position i given the prefix and d_<i.
        generator: the random stream (uniforms and the resample).
    Returns:
        accepted: (N,) long, accepted draft tokens n.
        next_token: (N,) long, the resampled token (n < length) or the bonus (n = length).
    """
    rows, k = draft.shape
    device = draft.device
    if k:
        p_d = target_probs[:, :k].gather(-1, draft[..., None]).squeeze(-1)
        q_d = draft_probs.gather(-1, draft[..., None]).squeeze(-1)
        u = torch.rand((rows, k), generator=generator, device=device)
        # u * q < p  <=>  u < p / q, without dividing (q > 0 for a drawn token).
        ok = (u * q_d < p_d) & (torch.arange(k, device=device)[None, :] < lengths[:, None])
        accepted = ok.long().cumprod(1).sum(1)
    else:
        accepted = torch.zeros(rows, dtype=torch.long, device=device)
    p_next = target_probs.gather(1, accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    dist = p_next
    rejected = accepted < lengths
    if k and bool(rejected.any()):
        q_at = draft_probs.gather(1, accepted.clamp(max=k - 1)[:, None, None].expand(-1, 1, draft_probs.shape[-1]))
        residual = (p_next - q_at.squeeze(1)).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection has probability sum(max(q - p, 0)) = sum(max(p - q, 0)),
        # so an all-zero residual cannot be reached; fall back to p for safety.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        dist = torch.where(rejected[:, None], residual, p_next)
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------- the cache of accepted tokens (verifier and window drafter)


class _AcceptedKVCache:
    """A ragged KV cache of accepted tokens: per row, `kept` valid columns; each chunk goes after them.

    The AR verifier's (causal chunks) and the window drafter's (bidirectional
    chunks). Slots carry position ids and validity, and rolling back is
    lowering `kept` and invalidating the dropped slots.
    """

    def __init__(self, model: PreTrainedModel, rows: int, max_len: int, device: torch.device) -> None:
        self.model = model
        self.plan = WritePlan()
        self.cache = Cache(layers=[RaggedLayer(max_len, self.plan) for _ in range(model.config.num_hidden_layers)])
        self.slot_pos = torch.zeros((rows, max_len), dtype=torch.long, device=device)
        self.slot_valid = torch.zeros((rows, max_len), dtype=torch.bool, device=device)
        self.kept = torch.zeros(rows, dtype=torch.long, device=device)
        self.kept_list = [0] * rows
        self.unmasked = no_mask_mapping(model)

    def select(self, alive: torch.Tensor, alive_list: list[int]) -> None:
        self.cache.batch_select_indices(alive)
        self.slot_pos, self.slot_valid, self.kept = self.slot_pos[alive], self.slot_valid[alive], self.kept[alive]
        self.kept_list = [self.kept_list[i] for i in alive_list]

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, logits_to_keep: int | torch.Tensor = 0,
        bidirectional: bool = False,
    ) -> torch.Tensor:
        """Logits (N, t or logits_to_keep, V) of t new tokens per row, written after each row's kept columns.

        ids, pos, valid: (N, t); invalid slots are computed but never attended.
        logits_to_keep: as HF's (an int keeps the last ones; a (N, w) long tensor
            these columns of each row).
        bidirectional: False, causal by position id (the verifier); True, every
            valid query sees every valid slot, the chunk's own included (the
            window drafter: its chunk is an active block, all before it cached).
        """
        rows, t = ids.shape
        ar = torch.arange(t, device=ids.device)
        width = max(self.kept_list) + t
        if min(self.kept_list) == max(self.kept_list):
            self.plan.start, self.plan.columns = self.kept_list[0], None
        else:
            self.plan.start, self.plan.columns = None, self.kept[:, None] + ar
        self.plan.width = width
        cols = self.kept[:, None] + ar
        self.slot_pos.scatter_(1, cols, pos)
        self.slot_valid.scatter_(1, cols, valid)
        kwargs: dict = {}
        if bidirectional:
            mask, kwargs = attention_mask_or_none(self.unmasked, self.slot_valid[:, None, None, :width])
        else:
            # Block size 1: causal by position id, pads and dropped slots excluded.
            plen = torch.zeros(rows, dtype=torch.long, device=ids.device)
            mask = block_diffusion_mask(
                pos, valid, cols, self.slot_pos[:, :width], self.slot_valid[:, :width], plen, 1
            )
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True,
            logits_to_keep=logits_to_keep, **kwargs,
        )
        return out.logits

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
        """Cache the (N, T) left-padded prompts but their last token, causally; returns the forwards run (0 or 1).

        The last token is left out: it is the first query of the next chunk,
        whose logits predict the first new token.
        """
        rows, prompt_len = ids.shape
        if prompt_len > 1:
            pos = left_pad_positions(attention_mask)
            self.forward(ids[:, :-1], pos[:, :-1], attention_mask[:, :-1].bool(), logits_to_keep=1)
        self.keep(torch.full((rows,), prompt_len - 1, dtype=torch.long, device=ids.device))
        return int(prompt_len > 1)

    def keep(self, new_kept: torch.Tensor) -> None:
        """Each row keeps its first new_kept[r] columns; later slots become invalid (the rollback).

        What rolls back is `kept`: the next chunk overwrites the dropped slots.
        Invalidating them matters to the bidirectional chunks (the window
        drafter's), where a dropped slot the next chunk does not reach would
        otherwise be seen; to causal ones it is belt and braces (such a slot sits
        at a later position than every query of that chunk).
        """
        width = self.slot_valid.shape[1]
        self.slot_valid &= torch.arange(width, device=new_kept.device)[None, :] < new_kept[:, None]
        self.kept = new_kept
        self.kept_list = new_kept.tolist()


# ---------------------------------------------------------------- the decoder


@torch.inference_mode()
def speculative_generate(
    model: PreTrainedModel,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    draft_len: int,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> SpeculativeDecodeOutput:
    """Decode like `ar_generate(model, ...)`, with `drafter` proposing `draft_len` tokens per AR forward.

    Greedy (temperature 0): the same tokens as `ar_generate` (up to floating
    point: the verifier scores k + 1 tokens per forward where `ar_generate`
    scores one, so a near-tie of two logits could in principle break apart).
    Sampling: the tokens are distributed as `ar_generate`'s at the same
    temperature and top_k (not the same samples: the random stream is used
    differently).

    Each row stops at its first eos (kept) or after max_new_tokens tokens, and
    leaves the batch, caches included.

    Args:
        model: the AR verifier (a causal LM taking 4D boolean masks, as every
            HF model with SDPA), in eval mode.
        drafter: e.g. `DiffusionDrafter(diffusion_model, steps)`; it may draft
            fewer tokens than asked (the diffusion drafter stops at its block end).
        prompts: N token id lists, any lengths >= 1.
        pad_id, eos_id: the tokenizer's ids.
        max_new_tokens: the most response tokens per row.
        draft_len: k >= 1, tokens drafted per round (capped so that a round
            never passes max_new_tokens: at most max_new_tokens - accepted - 1).
        temperature, top_k: as `ar_generate`; the drafter samples at the same
            temperature (no top_k: q only has to be the law it drew from).
        generator: the random stream of both the drafter and the acceptance.
    Returns:
        SpeculativeDecodeOutput: sequences (cut after eos), nfe = ar_nfe +
        draft_nfe, generated_tokens, seconds, and the counts.
    """
    start_time = time.perf_counter()
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    device = next(model.parameters()).device
    ids, attn = left_pad(prompts, pad_id, device)
    batch, prompt_len = ids.shape
    if max_new_tokens <= 0:
        return SpeculativeDecodeOutput(
            [[] for _ in range(batch)], 0, 0, time.perf_counter() - start_time,
            accepted_lengths=[[] for _ in range(batch)], batch_size=batch,
        )
    vocab = int(model.config.vocab_size)
    drafter.begin(ids, attn, max_new_tokens, vocab)
    plen = attn.sum(-1)

    # The AR cache: prompt minus its last token (which is the first query of
    # the first verify forward), then per row the accepted tokens but the last.
    verifier = _AcceptedKVCache(model, batch, prompt_len + max_new_tokens + draft_len, device)
    ar_nfe = verifier.prefill(ids, attn)

    # Per active row: accepted response (+ room for a round's overshoot), its
    # length, its last token, its original index.
    resp = torch.full((batch, max_new_tokens + draft_len + 1), pad_id, dtype=torch.long, device=device)
    length = torch.zeros(batch, dtype=torch.long, device=device)
    last = ids[:, -1].clone()
    rows = torch.arange(batch, device=device)
    sequences: list[list[int]] = [[] for _ in range(batch)]
    accepted_lengths: list[list[int]] = [[] for _ in range(batch)]
    drafts = verifications = drafted_tokens = 0
    sample = temperature > 0.0

    while True:
        # Draft: never more than fits before max_new_tokens with the AR token after.
        count = (max_new_tokens - length - 1).clamp(min=0, max=draft_len)
        if bool((count > 0).any()):
            d = drafter.draft(resp, length, count, temperature, generator)
            drafts += 1
            tokens, n_draft, q = d.tokens, d.lengths.minimum(count), d.probs
        else:
            tokens = torch.zeros((length.shape[0], 0), dtype=torch.long, device=device)
            n_draft, q = torch.zeros_like(length), None
        k = tokens.shape[1]
        drafted_tokens += int(n_draft.sum())

        # Verify: [last, d_1 .. d_k] at positions plen + length - 1 + i; slots
        # past a row's own draft are invalid (computed, never attended).
        chunk = torch.cat([last[:, None], tokens], dim=1)
        ar_k = torch.arange(k + 1, device=device)
        pos = (plen + length - 1)[:, None] + ar_k
        valid = ar_k[None, :] <= n_draft[:, None]
        logits = verifier.forward(chunk, pos, valid)  # (N, k + 1, V)
        ar_nfe += 1
        verifications += 1

        if sample:
            p = sampling_probs(logits, temperature, top_k)
            q_ = q if q is not None else torch.zeros((length.shape[0], 0, vocab), device=device)
            n_acc, nxt = accept_sampling(tokens, n_draft, q_[:, :k], p, generator)
        else:
            n_acc, nxt = accept_greedy(tokens, n_draft, logits)

        # The round's new tokens: d_1 .. d_n, then the AR token; cut after eos.
        new = torch.cat([tokens, nxt[:, None]], dim=1)
        new = new.scatter(1, n_acc[:, None], nxt[:, None])  # column n is the AR token
        n_new = n_acc + 1
        is_eos = (new == eos_id) & (ar_k[None, :] < n_new[:, None])
        has_eos = is_eos.any(1)
        n_new = torch.where(has_eos, is_eos.long().argmax(1) + 1, n_new)
        write = length[:, None] + ar_k
        keep_new = ar_k[None, :] < n_new[:, None]
        resp.scatter_(1, write, torch.where(keep_new, new, resp.gather(1, write)))
        # Roll back: the AR cache keeps [last, d_1 .. d_n]; the next round's
        # first query is the AR token.
        verifier.keep(verifier.kept + 1 + n_acc)
        last = new.gather(1, (n_new - 1)[:, None]).squeeze(1)
        length = length + n_new
        done = has_eos | (length >= max_new_tokens)

        # Accepted drafts that made it into the output (an eos among them cuts the rest).
        for r, a in zip(rows.tolist(), torch.minimum(n_acc, n_new).tolist()):
            accepted_lengths[r].append(a)
        done_list = done.tolist()
        if any(done_list):
            fin = done.nonzero().squeeze(-1)
            for i, r, n in zip(fin.tolist(), rows[fin].tolist(), length[fin].tolist()):
                sequences[r] = resp[i, :n].tolist()
            alive_list = [i for i, dn in enumerate(done_list) if not dn]
            if not alive_list:
                break
            alive = torch.tensor(alive_list, dtype=torch.long, device=device)
            resp, length, last, rows, plen = resp[alive], length[alive], last[alive], rows[alive], plen[alive]
            verifier.select(alive, alive_list)
            drafter.select(alive)

    generated = sum(len(s) for s in sequences)
    return SpeculativeDecodeOutput(
        sequences=sequences,
        nfe=ar_nfe + drafter.nfe,
        generated_tokens=generated,
        seconds=time.perf_counter() - start_time,
        ar_nfe=ar_nfe,
        draft_nfe=drafter.nfe,
        drafts=drafts,
        verifications=verifications,
        accepted_lengths=accepted_lengths,
        drafted_tokens=drafted_tokens,
        batch_size=batch,
    )


# ---------------------------------------------------------------- benchmark


@dataclass
class SpeculativeBenchmark:
    """Speculative vs `ar_generate` on the same prompts, measured in one run (greedy).

    Attributes:
        ar_tokens_per_s, spec_tokens_per_s: medians over the repeats.
        speedup: median of the paired ratios spec / AR tokens per second (each
            pair measured back to back, so a load change hits both).
        mean_accepted_length: draft tokens accepted per row verification.
        acceptance_rate: accepted / drafted tokens.
        ar_forwards_per_token, draft_forwards_per_token: forwards of each model
            per generated token of one row (`SpeculativeDecodeOutput`); AR
            decoding alone spends 1.0 AR forward per token.
        tokens_equal: the speculative tokens equal `ar_generate`'s (they must,
            up to floating-point near-ties).
        batch_size, generated_tokens, repeats: what was measured.
    """

    ar_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    mean_accepted_length: float
    acceptance_rate: float
    ar_forwards_per_token: float
    draft_forwards_per_token: float
    tokens_equal: bool
    batch_size: int
    generated_tokens: int
    repeats: int


def speculative_benchmark(
    model: PreTrainedModel,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    draft_len: int,
    repeats: int = 3,
) -> SpeculativeBenchmark:
    """Tokens/s of `speculative_generate` against `ar_generate` (greedy, same weights, same prompts, same run).

    One untimed warm-up of each, then `repeats` interleaved pairs (AR, then
    speculative). Only a ratio measured in one run means anything: machine
    load and hardware cancel out as far as they can. The project's speed rows
    compare with the best AR decoder (`gr2model.eval.bench`, which also times HF
    `generate`); this helper times our loop only. Set the thread count before
    calling (1 on a shared CPU: see `gr2model.decoding.ar_decode`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ar_kw = dict(pad_id=pad_id, eos_id=eos_id, max_new_tokens=max_new_tokens)

    def ar() -> DecodeOutput:
        return ar_generate(model, prompts, **ar_kw)

    def spec() -> SpeculativeDecodeOutput:
        return speculative_generate(model, drafter, prompts, draft_len=draft_len, **ar_kw)

    ar(), spec()  # warm-up (allocator, lazy initialisation)
    ar_rates, spec_rates, ratios = [], [], []
    ar_out = spec_out = None
    for _ in range(repeats):
        ar_out, spec_out = ar(), spec()
        ar_rates.append(ar_out.tokens_per_s)
        spec_rates.append(spec_out.tokens_per_s)
        ratios.append(spec_out.tokens_per_s / ar_out.tokens_per_s if ar_out.tokens_per_s > 0 else 0.0)
    assert ar_out is not None and spec_out is not None
    return SpeculativeBenchmark(
        ar_tokens_per_s=statistics.median(ar_rates),
        spec_tokens_per_s=statistics.median(spec_rates),
        speedup=statistics.median(ratios),
        mean_accepted_length=spec_out.mean_accepted_length,
        acceptance_rate=spec_out.acceptance_rate,
        ar_forwards_per_token=spec_out.ar_forwards_per_token,
        draft_forwards_per_token=spec_out.draft_forwards_per_token,
        tokens_equal=spec_out.sequences == ar_out.sequences,
        batch_size=len(prompts),
        generated_tokens=spec_out.generated_tokens,
        repeats=repeats,
    )
