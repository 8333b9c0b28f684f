"""Batched block-diffusion decoding with a block KV cache (threshold-parallel commits).

`diffusion_generate` writes each row's response one block of B tokens at a
time (the conventions of `gr2model.models.block_diffusion`). A block starts as B mask
tokens; every model forward proposes a token for each masked position and
commits every position whose confidence reaches `threshold`, plus the single
most confident one, so each forward commits at least one token per row.

One forward per step, and only the active block is recomputed:
- the prompt and every finished block live in a KV cache;
- the first forward is the prefill: the prompt followed by block 0's B mask
  tokens. Only the prompt's keys/values are kept; its last position's logits
  predict block 0's position 0 (token shift) and are kept for the whole block;
  the mask tokens' logits are the block's first denoising step;
- while a block is unfinished, a forward runs over its B tokens alone (they
  attend the cache and each other), and its keys/values are dropped after;
- the forward after a row finishes its block carries that block (attending the
  cache and itself) followed by the next block's B mask tokens (attending the
  cache, the finished block and themselves): the finished block's keys/values
  are kept, its last logits predict the next block's position 0, and the mask
  tokens' logits are the next block's first step. So no forward is spent on
  writing a finished block, and with B = 1 the loop is exactly AR decoding.
Every row moves at its own pace: a row that finishes a block starts the next
one while the others keep denoising. The cache is therefore ragged: each row
writes its finished blocks after its own last column, and the attention mask
is built from each slot's position id and validity rather than its column.
Rows that commit eos (with every position before it committed) or reach
`max_new_tokens` leave the batch, cache included.

Sub-blocks (`sub_block_size` S, a divisor of B; Fast-dLLM v2): a block is
decoded S positions at a time, left to right. Each step, a row may only commit
inside its current sub-block (the leftmost one with a position still open:
masked, within `max_new_tokens`, not after a committed eos), by the same
threshold rule restricted to it, at least one token per step. The forward
itself is unchanged: it covers the whole active block (finished sub-blocks,
the current one and the later, all-mask ones) with the block's bidirectional
attention, as the model was trained, so a step sees exactly the canvas the
replay of `gr2model.training.diffusion_replay` rebuilds. Only the logits of the current
sub-block are computed (the LM head and `propose` over S positions instead of
B, per row at its own offset). By default the rest of the block is not
cached: inside the block attention is bidirectional, so its keys/values above
the first layer depend on the current sub-block's tokens, which change every
step; caching them would change the outputs and break the exact replay.
`sub_block_cache=True` takes that approximation (Fast-dLLM v2's sub-block
cache, `CachedForward._window_forward`): the first step of a sub-block
forwards the whole block, and its later steps forward only the sub-block (and
the position before it, whose query predicts the sub-block's first position),
reading the rest of the block from the keys/values of that whole forward. The
later all-mask sub-blocks stay in the canvas either way (dropping them would
show the model canvases it was not trained on). With S = B the window is the
whole block: the same tokens as S = None, and the cache never applies.
Measured with the setup of the whole-block table below (B = 32, 200 new tokens;
the machine was busier: AR ran at 116 tok/s at batch 1, 243 at batch 8;
batch 1 medians of 3 interleaved runs, batch 8 one run, so +-20% or worse),
tokens per forward per row and x AR:

    threshold  S     tok/fwd   x AR, batch 1   x AR, batch 8
    0.9        None    1.00      0.46            0.22
    0.9        32      1.00      0.51            0.32
    0.9        16      1.00      0.47            0.46
    0.9        8       1.00      0.49            0.47
    0.9        4       1.00      0.54            0.59
    0          None   28.57      9.3             7.6
    0          32     28.57     10.1             6.7
    0          16     15.38      5.9             4.7
    0          8       8.00      3.5             2.9
    0          4       4.00      1.9             2.1

Random weights never reach 0.9, so there every S commits one token per
forward; a smaller S is then somewhat faster (logits and `propose` over S
positions, not B). At threshold 0 a forward commits a whole window, so S caps
tokens per forward at S: sub-blocks trade parallelism for committing left to
right (whether that buys accuracy has to be measured on trained models).

How many tokens a forward commits depends on the model's confidence, so speed
is measured at the two ends: threshold 0 (a whole block per forward) and > 1
(one token per forward). CPU, 1 thread, on the 2-core machine shared with a
training job (noisy: single runs spread by +-20%), ARModelConfig defaults with
random weights, vocab 2,000, prompts of 180-220 tokens, 200 new tokens, no eos;
medians of 5 interleaved runs, ratio = paired median vs `ar_generate`
(the bench script is in the commit message that added this table):

    batch  setting            tok/s   NFE   x AR
    1      ar_generate          323   200   1.00
    1      B=1                  289   200   0.86
    1      B=4, thr 0           755    50   2.42
    1      B=4, thr > 1         223   200   0.73
    1      B=8, thr 0         1,210    25   3.94
    1      B=8, thr > 1         195   200   0.61
    16     ar_generate        1,765   200   1.00
    16     B=1                1,518   200   0.91
    16     B=4, thr 0         1,995    50   1.13
    16     B=8, thr 0         2,362    25   1.18
    16     B=4 / B=8, thr > 1   670 / 565  0.38 / 0.29

Reading it: a forward over B (or 2B) tokens per row costs 1.4-2.0x an AR step
at batch 1 (per-op overhead dominates), so the gain there is about tokens per
forward / 1.6-2; at batch 16, where a CPU is compute-bound, it costs 2.6x
(B=4, B tokens) to 6.8x (B=8, 2B tokens), and the gain is small. On a GPU,
where decoding is memory-bound, extra tokens per forward should cost little
(not measured: no GPU in this session). B = 1 (exactly AR) costs 9-14% more
than `ar_generate`: the explicit mask and the commit bookkeeping.
Known costs not removed:
- with a mask and several queries, HF's SDPA path copies the keys/values to
  every query head (repeat_kv) on each layer and step; the process-wide
  TRANSFORMERS_SDPA_FORCE_GQA=1 avoids it (~20% faster at batch 16, nothing
  measurable at batch 1) but is left to the caller;
- per-row progress means that when some rows finish a block and others do
  not, the others carry B dead slots in that forward (2B tokens instead of B);
  lockstep blocks would avoid that but make every row wait for the slowest;
- the finished block is recomputed once (B tokens) so that its cached
  keys/values are those of its final tokens: the price of being exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from gr2model.decoding.ar_decode import DecodeOutput, RowGenerators, left_pad_positions, left_pad, sample_rows, select_rows
from gr2model.models.block_diffusion import block_diffusion_mask
from gr2model.decoding.constrained import GrammarState, ResponseGrammar, check_grammar, constrained_proposals

__all__ = ["DiffusionDecodeOutput", "check_sub_block_size", "commit_mask", "propose", "diffusion_generate"]


@dataclass
class DiffusionDecodeOutput(DecodeOutput):
    """What `diffusion_generate` produced (the fields of `DecodeOutput`, plus the trace).

    Attributes:
        steps: with `return_trace`, per row and aligned with `sequences`, the
            index of the forward (0 = the prefill) whose logits committed each
            token. The token was committed given exactly the tokens of its row
            committed at smaller step indices (the others were mask tokens), so
            the RL stage can replay every step.
        logprobs: with `return_logprobs`, per row and aligned with `sequences`,
            log p(token) under the raw distribution of the forward that
            committed it: log_softmax of its unscaled logits over the full
            vocabulary (the mask token included, temperature 1), as
            `ar_generate` returns them, whatever temperature sampled it.
        tail_tokens, tail_steps, tail_logprobs: with `return_trace` (the
            log-probs also need `return_logprobs`), per row, the positions of
            its last block after the end of `sequences` (up to the block end):
            the decoder may commit a position after the eos before the eos
            itself, and such a token is cut from the sequence but was part of
            the canvas of every later step of that block, so an exact replay
            needs it. mask_id / -1 / 0.0 where the position was never committed.
    """

    steps: list[list[int]] | None = None
    tail_tokens: list[list[int]] | None = None
    tail_steps: list[list[int]] | None = None
    tail_logprobs: list[list[float]] | None = None

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens (all rows) per model forward."""
        return self.generated_tokens / self.nfe if self.nfe > 0 else 0.0


def commit_mask(confidence: torch.Tensor, still_masked: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Which masked positions to commit this step.

    Every masked position whose confidence is >= threshold, plus the most
    confident masked position of each row (the first one on ties), so that a
    row with a masked position always makes progress. Committed positions are
    never chosen again.

    Args:
        confidence: (N, B) float, the probability of each position's proposal.
        still_masked: (N, B) bool, True where the position is still a mask
            token and may be committed.
        threshold: the confidence needed to commit beyond the forced one; > 1
            commits exactly one position per step, <= 0 every masked position.
            A (N, B) tensor gives each position its own.
    Returns:
        (N, B) bool, a subset of `still_masked`; a row with any masked position
        gets at least one True.
    """
    masked_conf = confidence.masked_fill(~still_masked, float("-inf"))
    best = masked_conf.argmax(dim=-1, keepdim=True)
    forced = torch.zeros_like(still_masked).scatter_(-1, best, True) & still_masked
    return (still_masked & (confidence >= threshold)) | forced


def propose(
    logits: torch.Tensor, temperature: float, generator: RowGenerators, banned_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token and its confidence for every position, from (N, n, V) logits.

    Temperature 0 takes the argmax, with confidence softmax(logits) of it;
    temperature > 0 samples from softmax(logits / temperature), with confidence
    the sampled token's probability under that distribution. `banned_id` (the
    mask token) is never proposed: committing it would leave a "mask" that is
    not one. The logits are modified in place (their `banned_id` column).

    Returns:
        tokens: (N, n) long.
        confidence: (N, n) float32.
    """
    if banned_id is not None:
        logits[..., banned_id] = float("-inf")
    logits = logits.float()
    if temperature <= 0.0:
        best, tokens = logits.max(dim=-1)
        # max softmax probability = exp(max - logsumexp), without the full softmax.
        return tokens, torch.exp(best - torch.logsumexp(logits, dim=-1))
    probs = torch.softmax(logits / temperature, dim=-1)
    tokens = sample_rows(probs, generator)
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def check_sub_block_size(block_size: int, sub_block_size: int | None) -> None:
    """Raise ValueError unless `sub_block_size` is None or a divisor >= 1 of `block_size`.

    Sub-blocks tile the block exactly: a partial last sub-block would be a
    window of another size, which the decoder does not have.
    """
    if sub_block_size is None:
        return
    if sub_block_size < 1 or block_size % sub_block_size != 0:
        raise ValueError(f"sub_block_size must be >= 1 and divide block_size {block_size}, got {sub_block_size}")


class WritePlan:
    """Where the current forward writes its keys/values, shared by all cache layers.

    `start` set: every row writes its q new slots at columns [start, start + q)
    (a slice copy). Otherwise `columns` (N, q) gives each row's columns (a
    scatter). `width`: the layers return columns [0, width) for attention.
    """

    def __init__(self) -> None:
        self.start: int | None = 0
        self.columns: torch.Tensor | None = None
        self.width = 0


class RaggedLayer(CacheLayerMixin):
    """One layer's keys and values in (N, H, max_len, D) buffers, written where the plan says.

    Unlike `ar_decode._PreallocatedLayer` the rows may write at different
    columns (each row's finished blocks go after its own last column), and
    nothing is appended implicitly: what a forward wrote past the kept length
    (the active block) is simply overwritten by the next forward.
    """

    is_sliding = False

    def __init__(self, max_len: int, plan: WritePlan) -> None:
        super().__init__()
        self.max_len = max_len
        self.plan = plan

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        # Zeros, not empty: never-written slots are masked out, but SDPA still
        # multiplies their values by a zero weight, and 0 * NaN garbage is NaN.
        self._k = key_states.new_zeros((batch, heads, self.max_len, key_states.shape[-1]))
        self._v = value_states.new_zeros((batch, heads, self.max_len, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.plan
        if plan.start is not None:
            end = plan.start + key_states.shape[-2]
            self._k[:, :, plan.start : end] = key_states
            self._v[:, :, plan.start : end] = value_states
        else:
            assert plan.columns is not None
            index = plan.columns[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[-1])
            self._k.scatter_(2, index, key_states)
            self._v.scatter_(2, index, value_states)
        self.keys = self._k[:, :, : plan.width]
        self.values = self._v[:, :, : plan.width]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.width, 0

    def get_seq_length(self) -> int:
        return self.plan.width

    def get_max_length(self) -> int:
        return self.max_len

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k = self._k[indices]
            self._v = self._v[indices]


def no_mask_mapping(model: PreTrainedModel) -> dict | None:
    """A per-layer-type mask mapping of None: what HF models take as "no mask".

    (None itself would make them build a causal one.) Only for models that name
    their layer types (Qwen3 and most current HF decoders); None otherwise.
    """
    layer_types = getattr(model.config, "layer_types", None)
    return dict.fromkeys(layer_types) if layer_types else None


def attention_mask_or_none(unmasked: dict | None, mask: torch.Tensor) -> tuple[torch.Tensor | dict, dict]:
    """(attention_mask, extra forward kwargs) for a (N, 1, 1, K) mask whose queries all see the same keys.

    Where every query sees every key (a denoising step without pads or dummy
    slots: always at batch 1) and the model takes `unmasked` (`no_mask_mapping`),
    no mask at all: SDPA then takes its fused path and shares the grouped
    keys/values instead of copying them per head (measured 1.64 -> 1.35 ms for
    an 8-token window), and is_causal=False keeps it bidirectional. Otherwise
    the mask as given.
    """
    if unmasked is not None and mask.shape[2] == 1 and bool(mask.all()):
        return unmasked, {"is_causal": False}
    return mask, {}


class CachedForward:
    """The logits of each step with the ragged block KV cache (see the module docstring).

    Per row it keeps `kept[r]`, the number of cache columns holding its prompt
    (left-padded to the common width) and finished blocks; the slots' position
    ids and validity live in (N, max_len) buffers next to the cache.
    """

    def __init__(
        self, model: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor, block_size: int, span: int, mask_id: int,
        sub_block_cache: bool = False,
    ) -> None:
        self.model = model
        self.ids, self.attn = ids, attn.bool()
        self.prompt_pos = left_pad_positions(attn)
        rows, self.prompt_len = ids.shape
        device = ids.device
        self.block_size, self.mask_id = block_size, mask_id
        # With B = 1 the next block's mask token would only be a key for itself:
        # leave it out, and the loop is exactly AR decoding.
        self.n_act = block_size if block_size > 1 else 0
        # Largest column ever written: kept <= prompt + span - B, plus 2B slots
        # (3B with the sub-block cache: a window row's dummy slots go after its block).
        max_len = self.prompt_len + span + block_size * (2 if sub_block_cache else 1)
        self.plan = WritePlan()
        self.cache = Cache(
            layers=[RaggedLayer(max_len, self.plan) for _ in range(model.config.num_hidden_layers)]
        )
        self.slot_pos = torch.zeros((rows, max_len), dtype=torch.long, device=device)
        self.slot_valid = torch.zeros((rows, max_len), dtype=torch.bool, device=device)
        self.kept = [self.prompt_len] * rows
        self.kept_t = torch.full((rows,), self.prompt_len, dtype=torch.long, device=device)
        self.first: torch.Tensor | None = None  # (N, V) logits predicting each active block's position 0
        self.arange_b = torch.arange(block_size, device=device)
        # Logits are computed for W positions of each active block (the whole
        # block, the current sub-block, or its open positions; W per call): the
        # LM head and `propose` cost W rather than B positions. A just-started
        # block's window (the prefill's, a finished block's forward) starts at
        # its position 0.
        self.keep_prefill = self.prompt_len - 1 + self.arange_b
        self.keep_ctx = block_size - 1 + self.arange_b
        self.keep_denoise = torch.arange(0, block_size - 1, device=device)
        self.unmasked = no_mask_mapping(model)
        # The sub-block cache (`diffusion_generate`'s sub_block_cache): per row, the
        # offset of the sub-block at which its active block was last forwarded whole.
        self.sub_block_cache = sub_block_cache
        self.fresh = torch.zeros(rows, dtype=torch.long, device=device)

    def select(self, alive: torch.Tensor, alive_list: list[int]) -> None:
        self.cache.batch_select_indices(alive)
        self.slot_pos, self.slot_valid = self.slot_pos[alive], self.slot_valid[alive]
        self.kept = [self.kept[i] for i in alive_list]
        self.kept_t = self.kept_t[alive]
        self.fresh = self.fresh[alive]
        self.ids, self.attn, self.prompt_pos = self.ids[alive], self.attn[alive], self.prompt_pos[alive]
        if self.first is not None:
            self.first = self.first[alive]

    def _run(self, input_ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask_arg, kwargs = attention_mask_or_none(self.unmasked, mask)
        out = self.model(
            input_ids=input_ids, attention_mask=mask_arg, position_ids=pos, cache=self.cache, use_cache=True,
            logits_to_keep=keep, **kwargs,
        )
        return out.logits

    def __call__(
        self, resp: torch.Tensor, start: torch.Tensor, plen: torch.Tensor, ctx: torch.Tensor | None,
        ctx_list: list[bool] | None, win: torch.Tensor | None = None,
        sub: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(N, W, V) logits predicting the N active blocks' positions `win` (token shift applied).

        ctx: None for the prefill; else (N,) bool, the rows whose block just
        finished (`start` already points at their next block), or all False.
        win: None, the whole block (W = B); else (N, W) long block positions,
        ascending per row, starting at 0 in a block that starts here (the
        prefill, rows with ctx). Without the sub-block cache the forward covers
        the whole block either way: only which logits are kept depends on it.
        sub: with the sub-block cache, each row's current sub-block, (offset
            (N,), size (N,)) in block positions. A row whose sub-block is
            smaller than the block and is the one its block was last forwarded
            whole at forwards that sub-block alone (`_window_forward`); any other
            row its whole block, as without the cache.
        """
        if not self.sub_block_cache or ctx is None or sub is None:
            return self._exact(resp, start, plen, ctx, ctx_list, win)
        assert ctx_list is not None
        off, size = sub
        is_win = (size < self.block_size) & (off == self.fresh) & ~ctx
        if bool(is_win.any()):
            logits = self._window_forward(resp, start, plen, ctx, ctx_list, win, is_win, off, size)
        else:
            logits = self._exact(resp, start, plen, ctx, ctx_list, win)
        self.fresh = torch.where(is_win, self.fresh, off)
        return logits

    def _window_forward(
        self, resp: torch.Tensor, start: torch.Tensor, plen: torch.Tensor, ctx: torch.Tensor, ctx_list: list[bool],
        win: torch.Tensor | None, is_win: torch.Tensor, off: torch.Tensor, size: torch.Tensor,
    ) -> torch.Tensor:
        """(N, W, V) logits of a step in which some rows (`is_win`, (N,) bool) forward their sub-block alone.

        Such a row's queries are the S + 1 positions [q0, q0 + S + 1) of its
        active block, q0 = max(offset - 1, 0): the sub-block and the position
        before it, whose query predicts the sub-block's first position (token
        shift; at offset 0 the kept `first` does, and the position after the
        sub-block is carried instead). They attend the cache, where the rest of
        the block keeps the keys/values of the forward that last covered it
        whole (Fast-dLLM v2's approximate sub-block cache). Rows with ctx carry
        their finished block and the next one (2B queries), the other rows
        their whole active block (B), as in `_exact`. Rows with fewer queries
        than the widest pad with invalid dummy slots written after their block.
        """
        bsz = self.block_size
        rows = resp.shape[0]
        q0 = (off - 1).clamp(min=0)
        rel0 = torch.where(ctx, -bsz, torch.where(is_win, q0, 0))  # (N,) first query, relative to `start`
        count = torch.where(ctx, 2 * bsz, torch.where(is_win, size + 1, bsz))  # (N,) real queries
        count_list, rel0_list = count.tolist(), rel0.tolist()
        n_q = max(count_list)
        j = torch.arange(n_q, device=resp.device)
        valid = j < count[:, None]  # (N, Q)
        rel = rel0[:, None] + j
        kept = self.kept_t[:, None]
        own_col = kept + torch.where(ctx[:, None], bsz + rel, rel)
        cols = torch.where(valid, own_col, kept + bsz + j - count[:, None])  # dummies right after the block
        width = max(k + (2 * bsz if c else bsz + n_q - n) for k, c, n in zip(self.kept, ctx_list, count_list))
        tokens = resp.gather(1, (start[:, None] + rel).clamp(0, resp.shape[1] - 1))
        pos = plen[:, None] + start[:, None] + torch.where(valid, rel, 0)
        plan = self.plan
        plan.width = width
        aligned = len(set(self.kept)) == 1 and len(set(rel0_list)) == 1 and len(set(count_list)) == 1
        plan.start, plan.columns = (self.kept[0] + rel0_list[0], None) if aligned else (None, cols)
        if any(ctx_list):
            self.slot_pos.scatter_(1, cols, pos)
            self.slot_valid.scatter_(1, cols, valid)
            mask = block_diffusion_mask(
                pos, valid, cols, self.slot_pos[:, :width], self.slot_valid[:, :width], plen, bsz
            )
        else:
            # Every query (a dummy too) may see every valid slot: the cache is all
            # before it and its block is bidirectional; the dummies are invalid.
            mask = self.slot_valid[:, None, None, :width]
        where = self.arange_b.expand(rows, -1) if win is None else win
        # Block position p is predicted at query p - 1 - rel0 (clamped where the
        # row has no such query: position 0 takes `first`, and outside a window
        # row's sub-block nothing is open, so those logits are never used).
        logits = self._run(tokens, mask, pos, (where - 1 - rel0[:, None]).clamp(0, n_q - 1))
        assert self.first is not None
        self.first = torch.where(ctx[:, None], logits[:, 0], self.first)  # a ctx row's window starts at 0
        logits[:, 0] = torch.where((where[:, 0] == 0)[:, None], self.first, logits[:, 0])
        self.kept = [k + bsz if c else k for k, c in zip(self.kept, ctx_list)]
        self.kept_t = self.kept_t + bsz * ctx.long()
        return logits

    def _exact(
        self, resp: torch.Tensor, start: torch.Tensor, plen: torch.Tensor, ctx: torch.Tensor | None,
        ctx_list: list[bool] | None, win: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`__call__` with every row's whole active block in the forward."""
        bsz, n_act = self.block_size, self.n_act
        rows = resp.shape[0]
        plan = self.plan
        ar = self.arange_b
        if ctx is None:
            # Prefill: the prompt, then block 0's mask tokens.
            masks = torch.full((rows, n_act), self.mask_id, dtype=torch.long, device=resp.device)
            input_ids = torch.cat([self.ids, masks], dim=1)
            pos = torch.cat([self.prompt_pos, plen[:, None] + ar[:n_act]], dim=1)
            valid = torch.cat([self.attn, torch.ones_like(masks, dtype=torch.bool)], dim=1)
            width = input_ids.shape[1]
            cols = torch.arange(width, device=resp.device).expand(rows, -1)
            self.slot_pos[:, :width] = pos
            self.slot_valid[:, :width] = valid
            plan.start, plan.columns, plan.width = 0, None, width
            mask = block_diffusion_mask(pos, valid, cols, pos, valid, plen, bsz)
            logits = self._run(input_ids, mask, pos, self.keep_prefill if win is None else self.keep_prefill[win])
            # A copy: `propose` bans the mask column of the returned logits in
            # place, and the raw logits are kept for the block's later steps.
            self.first = logits[:, 0].clone()
            return logits

        assert ctx_list is not None
        kept = self.kept_t[:, None]
        act_cols = start[:, None] + ar
        act_tok = resp.gather(1, act_cols)
        act_pos = plen[:, None] + act_cols
        if not any(ctx_list):
            # Denoising step: the active blocks alone, rewritten at each row's
            # columns [kept, kept + B). Their slots' positions and validity were
            # written when the block started and have not changed; every active
            # query sees every valid slot (the cache is all before it, its block
            # is bidirectional), so the mask is the validity row itself.
            width = max(self.kept) + bsz
            if min(self.kept) == max(self.kept):
                plan.start, plan.columns = self.kept[0], None
            else:
                plan.start, plan.columns = None, kept + ar
            plan.width = width
            mask = self.slot_valid[:, None, None, :width]
            assert self.first is not None
            if win is None:
                logits = self._run(act_tok, mask, act_pos, self.keep_denoise)
                return torch.cat([self.first[:, None], logits], dim=1)
            # Block position p is predicted at active column p - 1; position 0
            # (only ever first in a window) by the kept `first` instead (clamped
            # to column 0 here, then overwritten).
            logits = self._run(act_tok, mask, act_pos, (win - 1).clamp(min=0))
            logits[:, 0] = torch.where((win[:, 0] == 0)[:, None], self.first, logits[:, 0])
            return logits

        # A forward carrying the just-finished blocks (rows with ctx) and the
        # active blocks. A row without a finished block puts an invalid dummy
        # block in the ctx slots, written after its active block.
        ctx_start = (start - bsz).clamp(min=0)[:, None] + ar
        ctx_tok = resp.gather(1, ctx_start)
        ctx_pos = plen[:, None] + ctx_start
        ctx_col = ctx[:, None]
        ctx_cols = kept + torch.where(ctx_col, ar, ar + n_act)
        input_ids = torch.cat([ctx_tok, act_tok[:, :n_act]], dim=1)
        pos = torch.cat([ctx_pos, act_pos[:, :n_act]], dim=1)
        valid = torch.cat([ctx_col.expand(-1, bsz), torch.ones((rows, n_act), dtype=torch.bool, device=resp.device)], 1)
        cols = torch.cat([ctx_cols, (kept + torch.where(ctx_col, ar + bsz, ar))[:, :n_act]], dim=1)
        width = max(self.kept) + bsz + n_act
        plan.width = width
        if all(ctx_list) and min(self.kept) == max(self.kept):
            # Every row finished its block and the rows are aligned (always at
            # batch 1): slice writes, and the mask is the validity row except
            # that the finished block's queries do not see the next block.
            start0 = self.kept[0]
            plan.start, plan.columns = start0, None
            self.slot_pos[:, start0:width] = pos
            self.slot_valid[:, start0:width] = valid
            mask = self.slot_valid[:, None, None, :width].repeat(1, 1, bsz + n_act, 1)
            mask[:, :, :bsz, start0 + bsz :] = False
            # Every row starts a block here, so every window starts at position 0.
            logits = self._run(input_ids, mask, pos, self.keep_ctx if win is None else self.keep_ctx[win])
            self.first = logits[:, 0].clone()  # see the prefill
        else:
            plan.start, plan.columns = None, cols
            self.slot_pos.scatter_(1, cols, pos)
            self.slot_valid.scatter_(1, cols, valid)
            mask = block_diffusion_mask(
                pos, valid, cols, self.slot_pos[:, :width], self.slot_valid[:, :width], plen, bsz
            )
            # Every row reads its active block at input columns [B, 2B): block
            # position p is predicted at column B - 1 + p.
            logits = self._run(input_ids, mask, pos, self.keep_ctx if win is None else self.keep_ctx[win])
            assert self.first is not None
            # Rows without a finished block keep their block's position-0 logits.
            self.first = torch.where(ctx_col, logits[:, 0], self.first)
            if win is None:
                logits[:, 0] = self.first
            else:
                # ... where their window holds position 0 (a row with ctx does).
                logits[:, 0] = torch.where((win[:, 0] == 0)[:, None], self.first, logits[:, 0])
        # The finished blocks stay in the cache; the active ones will be rewritten.
        self.kept = [k + bsz if c else k for k, c in zip(self.kept, ctx_list)]
        self.kept_t = self.kept_t + bsz * ctx.long()
        return logits


class _RecomputeForward:
    """The logits of each step from a full forward over prompt + finished blocks + active block.

    No cache: the reference that the cached path is tested against. Each row is
    its left-padded prompt followed by its response up to the end of its active
    block, right-padded to the longest; the full block-causal mask applies.
    """

    def __init__(self, model: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.ids, self.attn = ids, attn.bool()
        self.prompt_pos = left_pad_positions(attn)
        self.block_size = block_size

    def select(self, alive: torch.Tensor, alive_list: list[int]) -> None:
        self.ids, self.attn, self.prompt_pos = self.ids[alive], self.attn[alive], self.prompt_pos[alive]

    def __call__(
        self, resp: torch.Tensor, start: torch.Tensor, plen: torch.Tensor, ctx: torch.Tensor | None,
        ctx_list: list[bool] | None, win: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(N, W, V) logits, as `CachedForward.__call__` (ctx is not needed without a cache)."""
        bsz = self.block_size
        rows, prompt_len = self.ids.shape
        span = int(start.max()) + bsz
        idx = torch.arange(span, device=resp.device)
        input_ids = torch.cat([self.ids, resp[:, :span]], dim=1)
        valid = torch.cat([self.attn, idx[None, :] < (start[:, None] + bsz)], dim=1)
        pos = torch.cat([self.prompt_pos, plen[:, None] + idx], dim=1)
        cols = torch.arange(input_ids.shape[1], device=resp.device).expand(rows, -1)
        mask = block_diffusion_mask(pos, valid, cols, pos, valid, plen, bsz)
        # Token shift: block position p is predicted at column prompt_len + start + p - 1.
        keep = prompt_len - 1 + start[:, None] + (torch.arange(bsz, device=resp.device) if win is None else win)
        return self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep
        ).logits


@dataclass
class _Blocks:
    """How a decode splits its blocks, fixed for the whole decode.

    block_size: B. sub: the sub-block size S of every block (None: whole blocks).
    split: whether the explanation's blocks (those holding no answer position, from
    `first_expl_block`, (batch,) long response indices) use another size: answer_sub
    in the answer's blocks, expl_sub in the others. cache: `sub_block_cache`.
    ar: (B,) long, 0..B-1.
    """

    block_size: int
    sub: int | None
    split: bool
    answer_sub: int
    expl_sub: int
    first_expl_block: torch.Tensor | None
    cache: bool
    ar: torch.Tensor


@dataclass
class _Rows:
    """The state of the N rows still decoding (N shrinks as rows finish; `keep`).

    resp: (N, span) long, the response so far (mask_id where not committed).
    step_of: (N, span) long, the step that committed each position (-1: not yet).
    logp_of: (N, span) float32, each committed position's log-prob; None without return_logprobs.
    start: (N,) long, the active block's first response index.
    plen: (N,) long, the prompt length.
    rows: (N,) long, each row's index in the batch.
    generator: the rows' random streams (`sample_rows`).
    """

    resp: torch.Tensor
    step_of: torch.Tensor
    logp_of: torch.Tensor | None
    start: torch.Tensor
    plen: torch.Tensor
    rows: torch.Tensor
    generator: RowGenerators

    def keep(self, alive: torch.Tensor, alive_list: list[int]) -> None:
        """Keep only the rows `alive` ((n,) long indices, and the same as a list)."""
        self.resp, self.step_of, self.start = self.resp[alive], self.step_of[alive], self.start[alive]
        self.plen, self.rows = self.plen[alive], self.rows[alive]
        self.generator = select_rows(self.generator, alive_list)
        if self.logp_of is not None:
            self.logp_of = self.logp_of[alive]


@dataclass
class _Done:
    """What the finished rows leave, by batch row (`batch` rows, `span` response slots).

    tokens, steps: (batch, span) long, a finished row's whole response buffer and commit
    steps (pad_id / -1 until it finishes). logp: (batch, span) float32, or None.
    lengths: each row's sequence length. changed: (batch,) bool, the rows the grammar changed.
    """

    tokens: torch.Tensor
    steps: torch.Tensor
    logp: torch.Tensor | None
    lengths: list[int]
    changed: torch.Tensor


@dataclass
class _Window:
    """One step's view of the N active blocks, taken before the forward (which does not change it).

    cols: (N, B) long, the active block's response indices. old_tok, old_step: (N, B) long,
    its tokens and commit steps. committed, in_limit: (N, B) bool. open_: (N, B) bool, the
    positions this step may commit (masked, within max_new_tokens, not after a committed
    eos; in a step mixing sub-block sizes, only inside each row's current sub-block).
    win: (N, W) long ascending block positions whose logits the step computes, or None
    for the whole block (W = B). sub: with the sub-block cache, each row's current
    sub-block as ((N,) offset, (N,) size) in block positions; else None.
    """

    cols: torch.Tensor
    old_tok: torch.Tensor
    old_step: torch.Tensor
    committed: torch.Tensor
    in_limit: torch.Tensor
    open_: torch.Tensor
    win: torch.Tensor | None
    sub: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class _Proposal:
    """One step's proposals at the W window positions of the N active blocks.

    tokens: (N, W) long. conf: (N, W) float32, each proposal's confidence. logp: (N, W)
    float32, its log-prob under the raw logits (None without return_logprobs). With a
    grammar: free, (N, W) bool, whether the proposal is the model's own argmax; where,
    (N, W) long, the positions' response indices (clamped below max_new_tokens); gstate,
    the grammar's state of the committed tokens. All three None without one.
    """

    tokens: torch.Tensor
    conf: torch.Tensor
    logp: torch.Tensor | None
    free: torch.Tensor | None
    where: torch.Tensor | None
    gstate: GrammarState | None


def _check_args(
    block_size: int, sub_block_size: int | None, grammar: ResponseGrammar | None, rows: int, max_new_tokens: int,
    temperature: float, explanation_threshold: float | None, explanation_sub_block_size: int | None,
    sub_block_cache: bool, use_cache: bool,
) -> None:
    """Raise ValueError for arguments `diffusion_generate` cannot decode with, before any work."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    check_sub_block_size(block_size, sub_block_size)
    check_grammar(grammar, rows, max_new_tokens, temperature)
    if (explanation_threshold is not None or explanation_sub_block_size is not None) and grammar is None:
        raise ValueError("explanation_threshold and explanation_sub_block_size need a grammar: it is what knows where the answer ends")
    check_sub_block_size(block_size, explanation_sub_block_size)
    if sub_block_cache and not use_cache:
        raise ValueError("sub_block_cache is a cache: it needs use_cache=True")


def _empty_output(batch: int, start_time: float, return_trace: bool, return_logprobs: bool) -> DiffusionDecodeOutput:
    """The output of a decode of no new tokens: `batch` empty rows, no forward."""
    empty: list[list[int]] = [[] for _ in range(batch)]
    steps0 = [[] for _ in range(batch)] if return_trace else None
    lp0 = [[] for _ in range(batch)] if return_logprobs else None
    lp0_tail = [[] for _ in range(batch)] if return_logprobs and return_trace else None
    return DiffusionDecodeOutput(
        empty, 0, 0, time.perf_counter() - start_time, logprobs=lp0, steps=steps0,
        tail_tokens=[[] for _ in range(batch)] if return_trace else None, tail_steps=steps0, tail_logprobs=lp0_tail,
    )


def _plan_blocks(
    block_size: int, sub_block_size: int | None, explanation_sub_block_size: int | None,
    grammar: ResponseGrammar | None, sub_block_cache: bool, device: torch.device,
) -> _Blocks:
    """The decode's `_Blocks`. Explanation blocks may have their own sub-block size (split):
    a step whose rows are all in blocks of one kind (always at batch 1) uses that kind's
    size; a step mixing them computes the whole block's logits, and each row's window
    (of its block's size) restricts its commits (`_window`)."""
    bsz = block_size
    sub = sub_block_size
    split = explanation_sub_block_size is not None and explanation_sub_block_size != (sub or bsz)
    answer_sub = expl_sub = sub or bsz
    first_expl_block = None
    if split:
        assert grammar is not None and explanation_sub_block_size is not None
        expl_sub = explanation_sub_block_size
        first_expl_block = (grammar.template_len + bsz - 1) // bsz * bsz  # (N,) first block start past the answer
    return _Blocks(bsz, sub, split, answer_sub, expl_sub, first_expl_block, sub_block_cache, torch.arange(bsz, device=device))


def _window(st: _Rows, blocks: _Blocks, eos_id: int, max_new_tokens: int, greedy: bool) -> _Window:
    """Step 1: the active blocks' state, which positions may be committed, and whose logits are needed.

    The (N, B) tensors of `_Window` from `st`; `win` is the current sub-block (N, S) when
    the step decodes sub-blocks smaller than B, and, for a lone greedy row, only its open
    positions of that window (1, W).
    """
    bsz, ar = blocks.block_size, blocks.ar
    cols = st.start[:, None] + ar
    old_tok, old_step = st.resp.gather(1, cols), st.step_of.gather(1, cols)
    committed = old_step >= 0
    # Earlier blocks are complete and eos-free (else the row would be done),
    # so a committed eos can only be in the active block.
    after_eos = (committed & (old_tok == eos_id)).cumsum(1) > 0
    in_limit = cols < max_new_tokens
    open_ = ~committed & in_limit & ~after_eos  # (N, B) positions that may be committed
    step_sub = blocks.sub
    size = None
    if blocks.split:
        assert blocks.first_expl_block is not None
        size = torch.where(st.start >= blocks.first_expl_block[st.rows], blocks.expl_sub, blocks.answer_sub)
        sizes = set(size.tolist())
        if len(sizes) == 1:
            step_sub = sizes.pop()
        else:
            step_sub = None
            lo = open_.long().argmax(1) // size * size
            open_ = open_ & (ar >= lo[:, None]) & (ar < (lo + size)[:, None])
    sub = None
    if blocks.cache:
        # Each row's current sub-block (offset, size), whole blocks included (size B).
        sizes_t = size if step_sub is None and size is not None else torch.full_like(st.start, step_sub or bsz)
        sub = (open_.long().argmax(1) // sizes_t * sizes_t, sizes_t)
    win = None
    if step_sub is not None and step_sub != bsz:
        # Each row's current sub-block: the leftmost with an open position.
        # Every active row has one (else it would be done or in its next
        # block), and a just-started block is at sub-block 0.
        off = open_.long().argmax(1) // step_sub * step_sub
        win = off[:, None] + ar[:step_sub]  # (N, S) block positions of the window
    if open_.shape[0] == 1 and greedy:
        # One row, greedy: only its open positions of the window need logits
        # (a committed one is never proposed again), so the LM head, the
        # grammar and the proposals cost the open positions alone; the
        # choices are the same. (Sampling keeps whole windows: one draw per
        # window position is what makes a row's samples independent of the
        # rows beside it, `sample_rows`.)
        win = (ar if win is None else win[0]).masked_select(open_[0] if win is None else open_[0, win[0]])[None]
    return _Window(cols, old_tok, old_step, committed, in_limit, open_, win, sub)


def _propose_step(
    logits: torch.Tensor, w: _Window, st: _Rows, grammar: ResponseGrammar | None, temperature: float, mask_id: int,
    max_new_tokens: int,
) -> _Proposal:
    """Step 3: a token and its confidence for each of the (N, W, V) `logits`' positions.

    Without a grammar `propose` (argmax or one draw per position); with one the most
    likely allowed token (`constrained_proposals`). `logits` is modified in place (the
    mask column is banned), so the log-partition for the log-probs is taken first.
    """
    # Before `propose`, which bans the mask column in place: the raw log-partition.
    lse = torch.logsumexp(logits.float(), dim=-1) if st.logp_of is not None else None
    free = where = gstate = None
    if grammar is None:
        # One (N, W, V) draw per step on both paths, so sampling draws alike.
        tokens, conf = propose(logits, temperature, st.generator, mask_id)
    else:
        # Response positions of the window (a last block's positions past the
        # limit are never open: any valid index will do).
        where = w.cols if w.win is None else st.start[:, None] + w.win
        where = where.clamp(max=max_new_tokens - 1)
        gstate = grammar.state(st.rows, st.resp, st.step_of >= 0)
        tokens, conf, free = constrained_proposals(logits, grammar.allowed(gstate, where), mask_id)
    logp = None
    if lse is not None:
        logp = logits.gather(-1, tokens[..., None]).squeeze(-1).float() - lse
    return _Proposal(tokens, conf, logp, free, where, gstate)


def _commit(
    w: _Window, p: _Proposal, st: _Rows, step: int, threshold: float, explanation_threshold: float | None,
    grammar: ResponseGrammar | None, changed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: choose the proposals to commit (`commit_mask`, then the grammar's consistency)
    and write them into `st` (resp, step_of = `step`, logp_of). `changed` ((batch,) bool)
    gains the rows whose commits the grammar changed.

    Returns (new_tok, committed), both (N, B): the active blocks' tokens and which
    positions are committed after this step.
    """
    open_w = w.open_ if w.win is None else w.open_.gather(1, w.win)
    thr: float | torch.Tensor = threshold
    if explanation_threshold is not None:
        assert grammar is not None and p.where is not None
        thr = torch.where(grammar.past_template(st.rows, p.where), explanation_threshold, threshold)
    chosen_w = commit_mask(p.conf, open_w, thr)
    if grammar is not None:
        assert p.free is not None and p.gstate is not None and p.where is not None
        kept = grammar.consistent(p.gstate, chosen_w, p.tokens, p.conf, p.where)
        # Changed: a commit that is not the model's own choice, or a pick held back.
        changed[st.rows] |= (kept & ~p.free).any(1) | (chosen_w & ~kept).any(1)
        chosen_w = kept
    tokens, tok_logp = p.tokens, p.logp
    if w.win is None:
        chosen = chosen_w
    else:
        # Back to block positions (outside the window nothing is chosen, so
        # the zeros put in tokens and log-probs there are never read).
        chosen = torch.zeros_like(w.open_).scatter_(1, w.win, chosen_w)
        tokens = torch.zeros_like(w.cols).scatter_(1, w.win, tokens)
        if tok_logp is not None:
            tok_logp = tok_logp.new_zeros(w.cols.shape).scatter_(1, w.win, tok_logp)
    new_tok = torch.where(chosen, tokens, w.old_tok)
    committed = w.committed | chosen
    st.resp.scatter_(1, w.cols, new_tok)
    st.step_of.scatter_(1, w.cols, torch.where(chosen, step, w.old_step))
    if st.logp_of is not None:
        assert tok_logp is not None
        st.logp_of.scatter_(1, w.cols, torch.where(chosen, tok_logp, st.logp_of.gather(1, w.cols)))
    return new_tok, committed


def _retire(
    new_tok: torch.Tensor, committed: torch.Tensor, w: _Window, st: _Rows, done_rows: _Done,
    forward: CachedForward | _RecomputeForward, eos_id: int, block_size: int, max_new_tokens: int,
) -> tuple[torch.Tensor, list[bool]] | None:
    """Step 5: move rows that completed their block to the next one, and rows that are done out of the batch.

    A row is done when it has committed an eos and every position before it, or all of
    its first `max_new_tokens` positions; its buffers go to `done_rows` and it leaves
    `st` and `forward`. Returns the next forward's (ctx (N',) bool, the same as a list):
    the remaining rows that just completed a block; None when no row is left.
    """
    bsz = block_size
    is_eos = committed & (new_tok == eos_id)
    after_eos = is_eos.cumsum(1) > 0
    done_eos = is_eos.any(1) & (committed | after_eos).all(1)
    done_limit = (committed | ~w.in_limit).all(1) & (st.start + bsz >= max_new_tokens)
    done = done_eos | done_limit
    complete = committed.all(1) & ~done
    length = torch.where(done_eos, st.start + is_eos.long().argmax(1) + 1, max_new_tokens)
    # One device -> host transfer per step.
    done_list, complete_list, length_list = torch.stack([done.long(), complete.long(), length]).tolist()

    st.start = st.start + bsz * complete.long()
    if any(done_list):
        fin = done.nonzero().squeeze(-1)
        done_rows.tokens[st.rows[fin]] = st.resp[fin]
        done_rows.steps[st.rows[fin]] = st.step_of[fin]
        if st.logp_of is not None:
            assert done_rows.logp is not None
            done_rows.logp[st.rows[fin]] = st.logp_of[fin]
        for r, d, n in zip(st.rows.tolist(), done_list, length_list):
            if d:
                done_rows.lengths[r] = n
        alive_list = [i for i, d in enumerate(done_list) if not d]
        if not alive_list:
            return None
        alive = torch.tensor(alive_list, dtype=torch.long, device=complete.device)
        st.keep(alive, alive_list)
        complete = complete[alive]
        complete_list = [complete_list[i] for i in alive_list]
        forward.select(alive, alive_list)
    return complete, [bool(c) for c in complete_list]


def _output(
    done_rows: _Done, nfe: int, block_size: int, start_time: float, return_trace: bool, constrained: bool
) -> DiffusionDecodeOutput:
    """The decode's output from what its finished rows left: each row cut at its length, and
    with the trace the rest of its last block (the response buffer of a finished row holds
    mask_id where never committed)."""
    lengths, batch = done_rows.lengths, len(done_rows.lengths)
    tokens_all = done_rows.tokens.tolist()
    sequences = [tokens_all[i][: lengths[i]] for i in range(batch)]
    ends = [math.ceil(n / block_size) * block_size for n in lengths]
    steps = tail_tokens = tail_steps = logprobs = tail_logprobs = None
    if return_trace:
        steps_all = done_rows.steps.tolist()
        steps = [steps_all[i][: lengths[i]] for i in range(batch)]
        tail_tokens = [tokens_all[i][lengths[i] : ends[i]] for i in range(batch)]
        tail_steps = [steps_all[i][lengths[i] : ends[i]] for i in range(batch)]
    if done_rows.logp is not None:
        lp_all = done_rows.logp.tolist()
        logprobs = [lp_all[i][: lengths[i]] for i in range(batch)]
        if return_trace:
            tail_logprobs = [lp_all[i][lengths[i] : ends[i]] for i in range(batch)]
    return DiffusionDecodeOutput(
        sequences=sequences,
        nfe=nfe,
        generated_tokens=sum(lengths),
        seconds=time.perf_counter() - start_time,
        logprobs=logprobs,
        steps=steps,
        tail_tokens=tail_tokens,
        tail_steps=tail_steps,
        tail_logprobs=tail_logprobs,
        constrained=done_rows.changed.tolist() if constrained else None,
    )


@torch.inference_mode()
def diffusion_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int,
    mask_id: int,
    block_size: int,
    threshold: float,
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    generator: RowGenerators = None,
    return_trace: bool = False,
    return_logprobs: bool = False,
    sub_block_size: int | None = None,
    grammar: ResponseGrammar | None = None,
    explanation_threshold: float | None = None,
    explanation_sub_block_size: int | None = None,
    sub_block_cache: bool = False,
) -> DiffusionDecodeOutput:
    """Decode up to `max_new_tokens` tokens after each prompt by block diffusion, batched.

    Each step proposes a token for every masked position of each row's active
    block (`propose`) and commits those chosen by `commit_mask`. Positions after
    a committed eos are no longer proposed (they would be cut). A row finishes
    when it has committed an eos and every position before it (the sequence is
    cut after that first eos), or all of its first `max_new_tokens` positions;
    the last block keeps its B slots (mask tokens past the limit stay masked).

    Args:
        model: a block-diffusion model (`convert_to_block_diffusion`, or any
            causal LM: the mask is passed explicitly), in eval mode; its
            forward takes a 4D boolean attention mask and position ids.
        prompts: N token id lists, any lengths >= 1.
        pad_id, eos_id, mask_id: the tokenizer's ids (mask_id is never committed).
        block_size: B >= 1; B = 1 is AR decoding (one token per forward).
        threshold: commit every masked position whose confidence is >= this,
            besides the most confident one: > 1 commits one token per forward,
            <= 0 a whole block per forward.
        max_new_tokens: the most response tokens per row.
        use_cache: False recomputes prompt + response on every step (slow; the
            reference for the cached path: same tokens, same NFE).
        temperature: 0 proposes the argmax; > 0 samples from
            softmax(logits / temperature), using `generator`: one stream, or
            one per row (`sample_rows`; a row draws once per forward it takes
            part in, so its tokens do not depend on the rows beside it).
        return_trace: also return each token's commit step (`steps`) and the
            cut end of each row's last block (`tail_tokens`, `tail_steps`).
        return_logprobs: also return each committed token's log-probability
            under the raw logits of the forward that committed it (`logprobs`,
            and `tail_logprobs` with return_trace): one logsumexp over the
            (N, W, V) logits per step (W = B, or S with sub-blocks).
        sub_block_size: None decodes the whole block at once. S (a divisor of
            B) decodes it sub-block by sub-block (Fast-dLLM v2): each step may
            only commit masked positions of the row's leftmost sub-block that
            still has one (the threshold rule inside it, at least one per step);
            the forward still covers the whole block (module docstring).
            S = B is the same as None. Raises ValueError if S does not divide B.
        grammar: greedy only; each position proposes the most likely token the
            grammar allows there given the committed ones, with the model's raw
            probability of it as confidence (`gr2model.decoding.constrained`), and two
            slots never commit the same candidate in one step; every answer is
            then valid, and `constrained` says which rows the grammar changed.
        explanation_threshold: with a grammar, the threshold for the positions
            after the answer (the explanation's words and the tail), `threshold`
            staying that of the answer (the template and its ranking). The
            ranking, which all accuracy comes from, is then decoded as carefully
            as before while the longer explanation commits more per forward.
            None: `threshold` everywhere. ValueError without a grammar.
        explanation_sub_block_size: with a grammar, the sub-block size of the
            blocks that hold no answer position (B: whole blocks), the answer's
            blocks keeping `sub_block_size`. Sub-blocks keep the ranking's
            departures from the incoming order (measured: whole blocks copy
            it), while the explanation commits more per forward in whole
            blocks. None: `sub_block_size` everywhere. ValueError without a
            grammar or if it does not divide B.
        sub_block_cache: an approximation (Fast-dLLM v2's sub-block cache)
            that changes the tokens. When a row's current sub-block is smaller
            than the block, the forward that reaches it covers the whole block
            as above, and the row's later steps in that sub-block forward its
            S positions alone (and the one before), attending the other
            positions of the block through the keys/values of that whole
            forward. A step then costs about S + 1 positions instead of B, and
            the sub-block's tokens see stale keys/values of the rest of the
            block until the next sub-block starts. A row's tokens still do not
            depend on the rows beside it. `gr2model.training.diffusion_replay` does not
            rebuild these steps (it replays exact canvases). Needs use_cache.
    Each step of the loop: `_window` (which positions of each row's active
    block may be committed and whose logits are needed), the forward
    (`CachedForward` or `_RecomputeForward`), `_propose_step` (a token and its
    confidence per position, under the grammar if any), `_commit` (the
    threshold rule and the grammar's consistency, written into the rows'
    state), `_retire` (rows that completed a block move to the next, rows that
    are done leave the batch).

    Returns:
        DiffusionDecodeOutput: sequences, nfe (every forward, the prefill
        included), generated_tokens, seconds, steps and tails with
        return_trace, logprobs with return_logprobs.
    """
    start_time = time.perf_counter()
    _check_args(
        block_size, sub_block_size, grammar, len(prompts), max_new_tokens, temperature, explanation_threshold,
        explanation_sub_block_size, sub_block_cache, use_cache,
    )
    device = next(model.parameters()).device
    ids, attn = left_pad(prompts, pad_id, device)
    batch = ids.shape[0]
    if max_new_tokens <= 0:
        return _empty_output(batch, start_time, return_trace, return_logprobs)
    bsz = block_size
    span = math.ceil(max_new_tokens / bsz) * bsz
    blocks = _plan_blocks(bsz, sub_block_size, explanation_sub_block_size, grammar, sub_block_cache, device)
    forward: CachedForward | _RecomputeForward
    if use_cache:
        forward = CachedForward(model, ids, attn, bsz, span, mask_id, sub_block_cache)
    else:
        forward = _RecomputeForward(model, ids, attn, bsz)
    st = _Rows(
        resp=torch.full((batch, span), mask_id, dtype=torch.long, device=device),
        step_of=torch.full((batch, span), -1, dtype=torch.long, device=device),
        logp_of=torch.zeros((batch, span), dtype=torch.float32, device=device) if return_logprobs else None,
        start=torch.zeros(batch, dtype=torch.long, device=device),
        plen=attn.sum(-1),
        rows=torch.arange(batch, device=device),
        generator=generator,
    )
    done_rows = _Done(
        tokens=torch.full((batch, span), pad_id, dtype=torch.long, device=device),
        steps=torch.full((batch, span), -1, dtype=torch.long, device=device),
        logp=torch.zeros((batch, span), dtype=torch.float32, device=device) if return_logprobs else None,
        lengths=[0] * batch,
        changed=torch.zeros(batch, dtype=torch.bool, device=device),
    )

    ctx: torch.Tensor | None = None  # None: the next forward is the prefill
    ctx_list: list[bool] | None = None
    nfe = 0
    while True:
        w = _window(st, blocks, eos_id, max_new_tokens, greedy=temperature == 0.0)
        # Step 2, the forward: (N, W, V) logits of the window positions.
        if w.sub is None:
            logits = forward(st.resp, st.start, st.plen, ctx, ctx_list, w.win)
        else:
            assert isinstance(forward, CachedForward)
            logits = forward(st.resp, st.start, st.plen, ctx, ctx_list, w.win, sub=w.sub)
        step = nfe
        nfe += 1
        proposal = _propose_step(logits, w, st, grammar, temperature, mask_id, max_new_tokens)
        new_tok, committed = _commit(w, proposal, st, step, threshold, explanation_threshold, grammar, done_rows.changed)
        following = _retire(new_tok, committed, w, st, done_rows, forward, eos_id, bsz, max_new_tokens)
        if following is None:
            break
        ctx, ctx_list = following
    return _output(done_rows, nfe, bsz, start_time, return_trace, grammar is not None)
