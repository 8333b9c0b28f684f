"""Conversion fine-tuning (CFT): train an AR re-ranker to decode as a block-diffusion model.

The converted model keeps the AR weights and the token shift (the logits at
position t predict token t+1); what changes is the attention mask and the input
of the positions being generated. The response is cut into blocks of
`block_size` (B) tokens, counted from the response start, and decoded block by
block: at inference (`gr2model.decoding.diffusion_decode`) a query q may attend a key k
iff k <= q, or both are response positions of the same block. The prompt stays
causal; inside a block the model sees every position, decided or still
`<|mask|>`.

Response blocks
---------------
A response is its text ids plus `<|eos|>`, padded with more `<|eos|>` up to a
multiple of B: the decoder writes whole blocks, so the positions after the end
of the answer must also be predicted, and they are trained to predict eos with
weight `CFTConfig.pad_weight` (they are easy, so after a few steps they mostly
add to the loss normaliser, by at most B-1 tokens per example). A response cut
by `max_length` has no eos: it is cut further, to a whole number of blocks, and
not padded (padding it with eos would teach the model to stop early).

Training layout (BD3-LM style)
------------------------------
One training row of an example with a prompt of p tokens and a response of L
tokens (L a multiple of B, n = L / B blocks) has T = p + 2L columns::

    columns   [0, p)           [p, p+L)                 [p+L, p+2L)
    content   prompt           noisy response x_t       clean response x_0
    position  0 .. p-1         p .. p+L-1               p .. p+L-1

Both copies of the response carry the same position ids, the ones the response
has at inference. Attention (True = may attend), for a query in

- the prompt: the prompt keys at or before it (causal);
- noisy block k: the whole prompt, clean blocks < k, and noisy block k
  (bidirectional inside the block);
- clean block k: the whole prompt and clean blocks <= k (bidirectional inside
  its block: block-causal).

So noisy block k sees exactly what the decoder sees when it fills block k
(prompt, the finished blocks before it, the block itself), and clean block k
sees what the decoder sees once block k is final. Rows of a batch are right
padded to the widest; a pad column attends itself only (an all-False row would
give NaN attention outputs, and a NaN value is not zeroed by a 0 weight) and is
attended by nothing, so it never changes a real column; it is never trained.

Token shift
-----------
Response token s = kB + i (block k, offset i) is predicted by the logits of

- noisy column p + s - 1 when i >= 1 (the previous position of the same noisy
  block, which sees the whole noisy block);
- clean column p + L + kB - 1 when i = 0 and k >= 1 (the last token of the
  clean block k-1: at inference the first token of block k is read from the
  last position of the finished block k-1);
- prompt column p - 1 when s = 0 (the last prompt token).

`prediction_sources` gives these columns. The first token of a block is thus
predicted without seeing the block's noisy tokens, as at inference.

Noise and loss
--------------
Per example and block, a noise level t ~ U(t_min, 1); each response token of the
block is replaced by `<|mask|>` with probability t in the noisy copy (only the
noisy copy: never the prompt, never the clean copy). Masks come in
complementary pairs: an example gives two rows, with masks m and ~m, so every
response token is masked, hence trained, exactly once per pair (the second row
of a block sees mask rate 1 - t). The loss is the weighted cross-entropy of the
masked tokens, each read at its prediction source, normalised by the total
weight of the global batch as in `gr2model.training.sft`:

    loss = sum over masked tokens of w * nll / sum of their weights w

with the weights of `gr2model.training.sft.encode_example` (reasoning vs answer; 0 on the
prompt, which is never predicted). Thanks to the pairs the normaliser is the
same as SFT's (each response token's weight once). There is no 1/t (ELBO)
weighting: it would weight a token by how few of its neighbours were masked,
which gives high-variance gradients near t = 0 and is undefined for the
complement row; the plain masked CE is the usual choice when an AR model is
converted (the aim is good decoding, not a likelihood bound), and it keeps the
loss on the scale of the AR loss. With B = 1 the layout reduces to the AR model
(each noisy token sees the clean tokens before it and itself, and is predicted
from the clean previous token), so the loss of a pair equals the SFT loss
(tested).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gr2model.bounds import FieldRangeError, check
from gr2model.training.kl import token_kl
from gr2model.training.resume import Checkpointer
from gr2model.training.sft import IGNORE_INDEX, SFTConfig, encode_example, loss_stats, run_train_loop, target_nll

__all__ = [
    "KIND_ANSWER",
    "KIND_REASONING",
    "KIND_PAD",
    "CFTConfig",
    "CFTResult",
    "encode_cft_example",
    "training_attention_mask",
    "training_position_ids",
    "prediction_sources",
    "complementary_masks",
    "example_masks",
    "build_cft_batch",
    "block_diffusion_loss",
    "train_cft",
    "CFTAnchor",
]

log = logging.getLogger(__name__)

# What a response token is, for the loss split reported by train_cft.
KIND_ANSWER = 0  # the ranking part, the JSON scaffolding and the real eos
KIND_REASONING = 1  # the explanation's words
KIND_PAD = 2  # the eos tokens that pad the response to whole blocks


@dataclass(frozen=True)
class CFTConfig:
    """Knobs of conversion fine-tuning.

    epochs: passes over the training examples.
    batch_size: examples per optimizer step over all processes (the global batch,
        `gr2model.training.sft.GlobalBatchShards`); each example gives
        two rows (a complementary mask pair), each of prompt + 2 x response tokens.
    lr, weight_decay: AdamW; linear warmup over `warmup_steps` optimizer steps,
        then a cosine decay to 0 (`gr2model.training.sft.warmup_cosine_factor`). The lr is
        lower than SFT's default: CFT starts from a trained AR model.
    reasoning_weight, answer_weight: loss weights of the explanation tokens and
        of the rest of the response (as in SFTConfig).
    pad_weight: loss weight of the eos tokens that pad the response to whole blocks.
    max_length: prompt + response + eos are cut to this many tokens (before the
        block padding, which adds up to block_size - 1), as in SFT; the training
        row is then p + 2L long.
    block_size: response tokens per block (must match the decoder's).
    t_min: noise levels are drawn from U(t_min, 1) per block (0 <= t_min <= 1).
    seed: the shuffle order and every noise draw; training is deterministic given
        it on a CPU, whatever the number of processes.
    grad_clip: max global gradient norm (<= 0 disables clipping).
    valid_every: also compute the validation loss every this many optimizer steps
        (0: only after each epoch).
    kd_weight: weight of a token-level distillation term added to each masked
        token's NLL: KL(teacher || student), the teacher being the AR model
        (`train_cft(teacher=...)`) reading the clean trajectory (its distribution
        of that token given the prompt and the response before it). 0: plain
        CFT, no teacher needed. Why: the trajectories are GR2's greedy answers,
        so a hard label says only which item GR2 put first; its distribution
        also says how close the call was, which is what the student must learn
        to depart from the incoming order where GR2 does.
    suffix_prob: share of blocks whose noise is a clean prefix then masks
        (`complementary_masks`) rather than i.i.d. positions: the context in
        which a sub-block decoder commits the first item of the ranking.
    """

    epochs: int = 3
    batch_size: int = 16
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    reasoning_weight: float = 1.0
    answer_weight: float = 2.0
    pad_weight: float = 1.0
    max_length: int = 1024
    block_size: int = 4
    t_min: float = 0.0
    seed: int = 0
    grad_clip: float = 1.0
    valid_every: int = 0
    kd_weight: float = 0.0
    suffix_prob: float = 0.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "block_size"):
            check(self, name, ge=1)
        check(self, "lr", gt=0)
        for name in ("weight_decay", "warmup_steps", "reasoning_weight", "answer_weight", "pad_weight", "seed",
                     "valid_every", "kd_weight"):
            check(self, name, ge=0)
        # max_length need not be a multiple of block_size: examples are cut to whole blocks.
        check(self, "max_length", ge=2)
        check(self, "t_min", ge=0, le=1)  # t_min = 1 masks every block fully
        check(self, "suffix_prob", ge=0, le=1)
        check(self, "grad_clip")  # any finite value: <= 0 disables clipping
        if self.reasoning_weight + self.answer_weight <= 0:
            # As SFTConfig (sft_config() builds one): only pad tokens would be trained.
            raise FieldRangeError("answer_weight", "and reasoning_weight are both 0: nothing but padding would be trained")

    def sft_config(self) -> SFTConfig:
        """The SFTConfig whose `encode_example` gives this config's ids and weights."""
        return SFTConfig(
            reasoning_weight=self.reasoning_weight, answer_weight=self.answer_weight, max_length=self.max_length
        )


@dataclass
class CFTResult:
    """model: the trained model (unwrapped from any distributed wrapper, eval mode).
    history: every dict passed to on_step (per-step metrics, then valid metrics).
    steps: optimizer steps taken."""

    model: PreTrainedModel
    history: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0


# --------------------------------------------------------------------- encoding


def encode_cft_example(
    tok: PreTrainedTokenizerBase, prompt: str, response: str, cfg: CFTConfig
) -> dict[str, list[int] | list[float]]:
    """Prompt ids, block-padded response ids, their loss weights and kinds.

    Built on `gr2model.training.sft.encode_example` (same tokenization, same weights, same
    max_length cut), then split at the prompt and made a whole number of blocks:
    a complete response (ending in eos) is padded with eos, a cut one is cut
    further (see the module docstring).

    Returns:
        prompt_ids: p ints.
        response_ids: L ints, L a multiple of cfg.block_size (0 when nothing of
            the response is left: the caller drops such examples).
        weights: L floats (reasoning, answer or pad weight).
        kind: L ints (KIND_REASONING, KIND_ANSWER, KIND_PAD).
    Raises:
        ValueError: an empty prompt (the first response token is predicted from
            the last prompt token), or what encode_example raises.
    """
    enc = encode_example(tok, prompt, response, cfg.sft_config())
    labels = enc["labels"]
    n_prompt = sum(1 for lab in labels if lab == IGNORE_INDEX)
    if n_prompt == 0:
        raise ValueError("CFT needs a non-empty prompt")
    response_ids = list(enc["input_ids"][n_prompt:])
    weights = list(enc["weights"][n_prompt:])
    kind = [KIND_REASONING if r else KIND_ANSWER for r in enc["reasoning"][n_prompt:]]
    bs = cfg.block_size
    complete = bool(response_ids) and response_ids[-1] == tok.eos_token_id
    if complete:
        n_pad = -len(response_ids) % bs
        response_ids += [tok.eos_token_id] * n_pad
        weights += [cfg.pad_weight] * n_pad
        kind += [KIND_PAD] * n_pad
    else:
        keep = len(response_ids) - len(response_ids) % bs
        response_ids, weights, kind = response_ids[:keep], weights[:keep], kind[:keep]
    prompt_ids = list(enc["input_ids"][:n_prompt])
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "weights": weights, "kind": kind}


# ---------------------------------------------------------------------- layout


def _check_layout(prompt_lens: torch.Tensor, response_lens: torch.Tensor, block_size: int) -> None:
    if prompt_lens.shape != response_lens.shape or prompt_lens.ndim != 1:
        raise ValueError("prompt_lens and response_lens must be 1D tensors of the same length")
    if bool((prompt_lens < 1).any()):
        raise ValueError("every prompt needs at least one token")
    if bool((response_lens % block_size != 0).any()):
        raise ValueError(f"response lengths must be multiples of block_size={block_size}")


def _columns(
    prompt_lens: torch.Tensor, response_lens: torch.Tensor, block_size: int, width: int | None,
    copies: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Region (0 prompt, 1 noisy, 2 clean, 3 pad), block index, column index, noisy copy
    index and response index of every column of every row: five (N, T) long tensors
    (block, copy and response index are 0 where they do not apply).

    copies: (N,) long, the number of noisy copies of each row (default 1); they
    follow each other between the prompt and the clean copy."""
    _check_layout(prompt_lens, response_lens, block_size)
    p = prompt_lens.long()[:, None]
    L = response_lens.long()[:, None]
    c = torch.ones_like(p) if copies is None else copies.long()[:, None]
    if bool((c < 1).any()):
        raise ValueError("every row needs at least one noisy copy")
    needed = int((p + (c + 1) * L).max()) if len(prompt_lens) else 0
    width = needed if width is None else width
    if width < needed:
        raise ValueError(f"width {width} < the longest row ({needed})")
    col = torch.arange(width)[None, :].expand(len(prompt_lens), width)
    region = (col >= p).long() + (col >= p + c * L).long() + (col >= p + (c + 1) * L).long()
    noisy_at = (col - p).clamp(min=0)
    copy = torch.where(region == 1, noisy_at // L.clamp(min=1), torch.zeros_like(col))
    offset = torch.where(region == 1, noisy_at - copy * L, col - p - c * L)  # response index s in any copy
    in_copy = (region == 1) | (region == 2)
    block = torch.where(in_copy, offset // block_size, torch.zeros_like(col))
    return region, block, col, copy, torch.where(in_copy, offset, torch.zeros_like(col))


def training_attention_mask(
    prompt_lens: torch.Tensor, response_lens: torch.Tensor, block_size: int, width: int | None = None,
    copies: torch.Tensor | None = None,
) -> torch.Tensor:
    """The BD3-LM training mask of right-padded rows [prompt, noisy response, clean response, pads].

    Args:
        prompt_lens: (N,) long, p of each row (>= 1).
        response_lens: (N,) long, L of each row (a multiple of block_size).
        block_size: B.
        width: T, the padded row length; default max(p + (copies + 1) L).
        copies: (N,) long, noisy copies per row (default 1): row i is [prompt,
            copies[i] noisy responses, clean response, pads]. Each noisy copy
            sees what the single one does and never another copy, so a row
            holds several independent noisy views (`gr2model.training.diffusion_replay`).
    Returns:
        (N, 1, T, T) bool, True where query (dim 2) may attend key (dim 3): see the
        module docstring (prompt causal; noisy block k -> prompt, clean blocks < k,
        noisy block k; clean block k -> prompt, clean blocks <= k; pad -> itself).
    """
    region, block, col, copy, _ = _columns(prompt_lens, response_lens, block_size, width, copies)
    rq, rk = region[:, :, None], region[:, None, :]
    bq, bk = block[:, :, None], block[:, None, :]
    cq, ck = col[:, :, None], col[:, None, :]
    same_noisy = (rk == 1) & (bk == bq) & (copy[:, :, None] == copy[:, None, :])
    prompt_key = rk == 0
    allowed = (rq == 0) & prompt_key & (ck <= cq)
    allowed |= (rq == 1) & (prompt_key | ((rk == 2) & (bk < bq)) | same_noisy)
    allowed |= (rq == 2) & (prompt_key | ((rk == 2) & (bk <= bq)))
    allowed |= (rq == 3) & (ck == cq)
    return allowed[:, None]


def training_position_ids(
    prompt_lens: torch.Tensor, response_lens: torch.Tensor, width: int | None = None,
    copies: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids (N, T) long of the training layout: 0..p-1 on the prompt,
    p..p+L-1 on every response copy, 0 on pads (never attended, any value works)."""
    region, _, col, _, offset = _columns(prompt_lens, response_lens, 1, width, copies)
    pos = torch.where((region == 1) | (region == 2), prompt_lens.long()[:, None] + offset, col)
    return torch.where(region == 3, torch.zeros_like(pos), pos)


def prediction_sources(
    prompt_len: int, response_len: int, block_size: int, copy: int = 0, copies: int = 1
) -> torch.Tensor:
    """Column of the training row whose logits predict each response token.

    Args:
        copy, copies: the noisy copy read (0-based) and the row's number of
            noisy copies (`training_attention_mask`); default the single one.
    Returns:
        (L,) long: for s = kB + i, p + copy L + s - 1 when i >= 1 (noisy copy),
        p + copies L + s - 1 when i = 0 < k (last token of clean block k-1),
        p - 1 when s = 0.
    """
    if prompt_len < 1 or response_len % block_size != 0:
        raise ValueError("need prompt_len >= 1 and response_len a multiple of block_size")
    if not 0 <= copy < copies:
        raise ValueError(f"copy {copy} out of range for {copies} copies")
    s = torch.arange(response_len)
    src = torch.where(
        s % block_size == 0, prompt_len + copies * response_len + s - 1, prompt_len + copy * response_len + s - 1
    )
    if response_len:
        src[0] = prompt_len - 1
    return src


# ----------------------------------------------------------------------- noise


def complementary_masks(
    length: int, block_size: int, t_min: float, generator: torch.Generator, suffix_prob: float = 0.0
) -> torch.Tensor:
    """A complementary pair of noise masks over a response of `length` tokens.

    Each block draws t ~ U(t_min, 1); each of its tokens is masked with
    probability t in the first mask. With probability `suffix_prob` a block's
    first mask is instead a suffix: its positions >= j masked, j uniform in
    [0, B) (a clean prefix before masks: the view of a block decoded left to
    right or sub-block by sub-block). The second mask is the complement.
    suffix_prob = 0 draws exactly the random numbers it always drew.

    Returns:
        (2, length) bool, True = replaced by the mask token; every column has
        exactly one True.
    """
    if length % block_size != 0:
        raise ValueError(f"length {length} is not a multiple of block_size {block_size}")
    n_blocks = length // block_size
    t = t_min + (1.0 - t_min) * torch.rand(n_blocks, generator=generator)
    u = torch.rand(length, generator=generator)
    first = u < t.repeat_interleave(block_size)  # u in [0, 1): t = 1 masks all
    if suffix_prob > 0:
        suffix = torch.rand(n_blocks, generator=generator) < suffix_prob
        cut = torch.randint(0, block_size, (n_blocks,), generator=generator)
        suffix_mask = (torch.arange(block_size)[None, :] >= cut[:, None]).reshape(-1)  # (length,)
        first = torch.where(suffix.repeat_interleave(block_size), suffix_mask, first)
    return torch.stack([first, ~first])


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from several ints (a fixed polynomial mix: no Python hash salt)."""
    acc = 0x9E3779B97F4A7C15
    for part in parts:
        acc = (acc * 0x100000001B3 + (part & 0xFFFFFFFFFFFFFFFF) + 1) % (1 << 63)
    return acc


def example_masks(length: int, cfg: CFTConfig, *, epoch: int, index: int) -> torch.Tensor:
    """The mask pair (2, length) of example `index` in epoch `epoch`.

    Drawn from a generator seeded by (cfg.seed, epoch, index), so the noise of an
    example does not depend on the batch it lands in or on the number of
    processes: several processes train exactly like one with their batches
    together. Validation uses epoch -1 (the same noise every time)."""
    gen = torch.Generator().manual_seed(_mix_seed(cfg.seed, epoch, index))
    return complementary_masks(length, cfg.block_size, cfg.t_min, gen, cfg.suffix_prob)


# ----------------------------------------------------------------------- batch


def build_cft_batch(
    examples: Sequence[dict[str, list]],
    masks: Sequence[torch.Tensor],
    *,
    block_size: int,
    mask_id: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """The training rows of encoded examples: two rows per example (its mask pair).

    Args:
        examples: N dicts of `encode_cft_example` (non-empty responses).
        masks: N bool tensors (2, L_i) (`complementary_masks`); row 2i uses
            masks[i][0], row 2i+1 masks[i][1].
        block_size, mask_id, pad_id: B, the `<|mask|>` id, the pad id.
    Returns (R = 2N rows, T = max(p + 2L) columns):
        input_ids: (R, T) long, [prompt, response with masked tokens -> mask_id,
            response, pad_id...].
        position_ids: (R, T) long (`training_position_ids`).
        attention_mask: (R, 1, T, T) bool (`training_attention_mask`).
        targets: (R, T) long, the token that the logits of each column must
            predict (already shifted: column c's logits predict targets[c]), i.e.
            the masked response tokens at their `prediction_sources`;
            IGNORE_INDEX elsewhere.
        weights: (R, T) float, the loss weight of each target (0 where none).
        kind: (R, T) long, KIND_* of each target (KIND_ANSWER where none).
        n_tokens: () long, non-pad columns in the batch.
        teacher_ids: (N, P) long, each example's prompt + clean response, right
            padded with pad_id (P = max(p + L)): what an AR teacher reads.
        teacher_attention: (N, P) long, 1 on real tokens.
        teacher_cols: (R, T) long, for each target column the teacher column
            whose logits predict the same response token (p + s - 1 for response
            index s, row r reading example r // 2); -1 where no target.
    """
    if len(examples) != len(masks):
        raise ValueError("one mask pair per example")
    p = torch.tensor([len(e["prompt_ids"]) for e in examples for _ in range(2)], dtype=torch.long)
    L = torch.tensor([len(e["response_ids"]) for e in examples for _ in range(2)], dtype=torch.long)
    width = int((p + 2 * L).max())
    rows = len(p)
    out = {
        "input_ids": torch.full((rows, width), pad_id, dtype=torch.long),
        "targets": torch.full((rows, width), IGNORE_INDEX, dtype=torch.long),
        "weights": torch.zeros((rows, width), dtype=torch.float32),
        "kind": torch.full((rows, width), KIND_ANSWER, dtype=torch.long),
        "teacher_cols": torch.full((rows, width), -1, dtype=torch.long),
    }
    t_width = int((p + L).max())
    out["teacher_ids"] = torch.full((len(examples), t_width), pad_id, dtype=torch.long)
    out["teacher_attention"] = torch.zeros((len(examples), t_width), dtype=torch.long)
    for i, (e, pair) in enumerate(zip(examples, masks)):
        prompt = torch.as_tensor(e["prompt_ids"], dtype=torch.long)
        resp = torch.as_tensor(e["response_ids"], dtype=torch.long)
        if pair.shape != (2, len(resp)):
            raise ValueError(f"example {i}: mask pair of shape {tuple(pair.shape)}, response of {len(resp)} tokens")
        w = torch.as_tensor(e["weights"], dtype=torch.float32)
        kind = torch.as_tensor(e["kind"], dtype=torch.long)
        np_, nl = len(prompt), len(resp)
        src = prediction_sources(np_, nl, block_size)
        out["teacher_ids"][i, : np_ + nl] = torch.cat([prompt, resp])
        out["teacher_attention"][i, : np_ + nl] = 1
        teacher_src = np_ - 1 + torch.arange(nl)  # the AR shift: column p + s - 1 predicts token s
        for j in range(2):
            r, m = 2 * i + j, pair[j]
            out["input_ids"][r, :np_] = prompt
            out["input_ids"][r, np_ : np_ + nl] = torch.where(m, mask_id, resp)
            out["input_ids"][r, np_ + nl : np_ + 2 * nl] = resp
            out["targets"][r, src[m]] = resp[m]
            out["weights"][r, src[m]] = w[m]
            out["kind"][r, src[m]] = kind[m]
            out["teacher_cols"][r, src[m]] = teacher_src[m]
    out["position_ids"] = training_position_ids(p, L, width)
    out["attention_mask"] = training_attention_mask(p, L, block_size, width)
    out["n_tokens"] = (p + 2 * L).sum()
    return out


# ------------------------------------------------------------------------ loss


def block_diffusion_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The CFT loss sum(w * nll) / sum(w) over the masked response tokens.

    The token shift is already in `targets` (`build_cft_batch` puts each masked
    token at its prediction source), so column c's logits are scored against
    targets[c]; unmasked tokens, the prompt, the clean copy's other columns and
    pads have IGNORE_INDEX and contribute nothing, whatever their logits.

    Args:
        logits: (R, T, V), or (K, V) for the K selected columns.
        targets: (R, T) or (K,) long.
        weights: same shape as targets, float.
    Returns:
        scalar float32; 0 (with a zero gradient) when no target has weight.
    """
    nll, valid = target_nll(logits, targets)
    w = weights.float() * valid
    return (w * nll).sum() / w.sum().clamp(min=torch.finfo(torch.float32).tiny)


def _loss_sums(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], teacher: torch.nn.Module | None = None, kd_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum(w * loss) with grad, stats (6,) without grad, non-pad columns) of one batch.

    loss is each masked token's NLL, plus, with a teacher and kd_weight > 0,
    kd_weight * KL(teacher || student) on the tokens that are not block padding
    (the teacher, an AR model, never learnt what follows its eos).
    stats as in `gr2model.training.sft`: [sum w, sum w*nll, reasoning nll sum, reasoning
    count, answer nll sum, answer count] over the masked tokens (NLL only);
    block-padding eos tokens count in the first two only. Logits are computed
    only on the columns that predict a masked token (`logits_to_keep` with a
    boolean (R, T) mask): with a large vocabulary the full (R, T, V) logits
    would dominate memory.
    """
    keep = batch["targets"] != IGNORE_INDEX
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=keep,
    )
    nll, _ = target_nll(out.logits, batch["targets"][keep])  # (K,)
    w = batch["weights"][keep].float()
    kind = batch["kind"][keep]
    per_token = nll
    if teacher is not None and kd_weight > 0:
        with torch.no_grad():
            t_logits = teacher(
                input_ids=batch["teacher_ids"], attention_mask=batch["teacher_attention"], use_cache=False
            ).logits  # (N, P, V)
            rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep] // 2
            t_sel = t_logits[rows, batch["teacher_cols"][keep]].float()  # (K, V_teacher)
            if t_sel.shape[-1] < out.logits.shape[-1]:
                # The conversion appended `<|mask|>` to the vocabulary: the teacher never writes it.
                t_sel = F.pad(t_sel, (0, out.logits.shape[-1] - t_sel.shape[-1]), value=float("-inf"))
        kl = token_kl(out.logits, t_sel, "forward")  # (K,) KL(teacher || student)
        per_token = nll + kd_weight * kl * (kind != KIND_PAD)
    weighted = (w * per_token).sum()
    with torch.no_grad():
        stats = loss_stats(w, (w * nll).sum(), nll, kind == KIND_REASONING, kind == KIND_ANSWER)
    return weighted, stats, batch["n_tokens"]


# ------------------------------------------------------------------------ train


def _encode_all(
    tok: PreTrainedTokenizerBase, examples: Sequence[tuple[str, str]], cfg: CFTConfig, what: str
) -> list[dict[str, list]]:
    encoded = [encode_cft_example(tok, p, r, cfg) for p, r in examples]
    kept = [e for e in encoded if e["response_ids"]]
    n_cut = sum(1 for e in kept if e["kind"][-1] != KIND_PAD and e["response_ids"][-1] != tok.eos_token_id)
    if n_cut:
        log.warning("%s: %d of %d examples are cut by max_length=%d", what, n_cut, len(encoded), cfg.max_length)
    if len(kept) < len(encoded):
        log.warning("%s: %d examples have no response block left and are dropped", what, len(encoded) - len(kept))
    return kept


def _batch_on(
    encoded: list[dict[str, list]], indices: Sequence[int], masks: Sequence[torch.Tensor], cfg: CFTConfig,
    mask_id: int, pad_id: int, device: torch.device,
) -> dict[str, torch.Tensor]:
    batch = build_cft_batch(
        [encoded[i] for i in indices], masks, block_size=cfg.block_size, mask_id=mask_id, pad_id=pad_id
    )
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def _valid_stats(
    model: torch.nn.Module, encoded: list[dict[str, list]], cfg: CFTConfig, mask_id: int, pad_id: int,
    accelerator: Accelerator,
) -> torch.Tensor:
    """Summed loss stats (6,) of the validation set over all processes, each
    example with its fixed noise (epoch -1), each scored once (slices i::world)."""
    stats = torch.zeros(6, device=accelerator.device)
    mine = list(range(accelerator.process_index, len(encoded), accelerator.num_processes))
    for start in range(0, len(mine), cfg.batch_size):
        idx = mine[start : start + cfg.batch_size]
        masks = [example_masks(len(encoded[i]["response_ids"]), cfg, epoch=-1, index=i) for i in idx]
        batch = _batch_on(encoded, idx, masks, cfg, mask_id, pad_id, accelerator.device)
        with accelerator.autocast():
            stats += _loss_sums(model, batch)[1]
    return accelerator.reduce(stats, reduction="sum")


def _index_batch(indices: list[int]) -> torch.Tensor:
    # The loader yields example indices; the batch (and its noise) is built in
    # train_cft's loss_sums, where the epoch is known.
    return torch.tensor(indices, dtype=torch.long)


def train_cft(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    examples: Sequence[tuple[str, str]],
    cfg: CFTConfig,
    *,
    valid: Sequence[tuple[str, str]] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    accelerator: Accelerator | None = None,
    teacher: PreTrainedModel | None = None,
    checkpointer: Checkpointer | None = None,
) -> CFTResult:
    """Conversion fine-tuning of a causal LM on (prompt, response) pairs (module docstring).

    The loop of `gr2model.training.sft.train_sft` (`gr2model.training.sft.run_train_loop`): encode (`encode_cft_example`), a
    shuffled seeded DataLoader, AdamW with warmup then cosine decay, everything
    through `accelerator.prepare`; per step: noise each example
    (`example_masks`), build the rows (`build_cft_batch`), forward with the 4D
    mask and explicit position ids, `accelerator.backward` of the loss normalised
    by the global batch's weight, clip, step.

    Args:
        model: a causal LM (e.g. Qwen3ForCausalLM with sdpa attention) whose
            forward takes input_ids (R, T), a 4D boolean attention_mask
            (R, 1, T, T) used as given, position_ids (R, T), and a boolean
            (R, T) `logits_to_keep`, returning logits (K, V) for the K True columns.
        tok: its tokenizer (fast; pad, eos and mask tokens set).
        examples: (prompt, response) texts; the response without the eos token.
        cfg: see CFTConfig.
        valid: optional held-out pairs; their loss (fixed noise) is computed after
            every epoch and every cfg.valid_every steps.
        on_step: called on the main process with each step's metrics (step, epoch,
            loss, reasoning_loss, answer_loss, lr, grad_norm, tokens_per_s) and
            with valid metrics (step, epoch, valid_loss, valid_reasoning_loss,
            valid_answer_loss). reasoning_loss and answer_loss are mean NLLs
            over the masked tokens of that kind (unweighted, block pads excluded).
        accelerator: the Accelerator to run under (a default one when None).
        teacher: the AR model whose distributions the student matches when
            cfg.kd_weight > 0 (required then; frozen, never updated); it reads
            input_ids (N, P) with a 2D attention_mask and returns logits (N, P, V)
            over the student's vocabulary.
        checkpointer: resume from its newest state and save as it says
            (`gr2model.training.sft.run_train_loop`; the noise is a function of (seed,
            epoch, example), so a resumed run draws the same masks); None: no state.
    Returns:
        CFTResult (model unwrapped, in eval mode).
    """
    accelerator = accelerator or Accelerator()
    pad_id, mask_id = tok.pad_token_id, tok.mask_token_id
    if pad_id is None or mask_id is None or tok.eos_token_id is None:
        raise ValueError("tokenizer needs pad, eos and mask tokens")
    # A converted model (gr2model.models.block_diffusion) records its block size and mask
    # id in its config; training it for another one would silently mismatch the decoder.
    conf_block = getattr(model.config, "block_size", None)
    conf_mask = getattr(model.config, "mask_token_id", None)
    if conf_block is not None and int(conf_block) != cfg.block_size:
        raise ValueError(f"model.config.block_size={conf_block} but cfg.block_size={cfg.block_size}")
    if conf_mask is not None and int(conf_mask) != mask_id:
        raise ValueError(f"model.config.mask_token_id={conf_mask} but the tokenizer's mask id is {mask_id}")
    if cfg.kd_weight > 0 and teacher is None:
        raise ValueError(f"cfg.kd_weight={cfg.kd_weight} needs a teacher model")
    if teacher is not None:
        teacher = teacher.to(accelerator.device).eval().requires_grad_(False)
    kd_teacher = teacher if cfg.kd_weight > 0 else None
    train_enc = _encode_all(tok, examples, cfg, "train")
    if not train_enc:
        raise ValueError("no training example with a response block")
    valid_enc = _encode_all(tok, valid, cfg, "valid") if valid else []

    def loss_sums(m: torch.nn.Module, indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, ...]:
        idx = indices.tolist()
        masks = [example_masks(len(train_enc[i]["response_ids"]), cfg, epoch=epoch, index=i) for i in idx]
        return _loss_sums(m, _batch_on(train_enc, idx, masks, cfg, mask_id, pad_id, accelerator.device), kd_teacher, cfg.kd_weight)

    trained, history, steps = run_train_loop(
        model,
        list(range(len(train_enc))),
        _index_batch,
        loss_sums,
        cfg,
        accelerator=accelerator,
        valid_stats=(lambda m: _valid_stats(m, valid_enc, cfg, mask_id, pad_id, accelerator)) if valid_enc else None,
        valid_every=cfg.valid_every,
        on_step=on_step,
        desc="cft",
        checkpointer=checkpointer,
    )
    return CFTResult(model=trained, history=history, steps=steps)


class CFTAnchor:
    """CFT's loss on GR2's trajectories, for a later stage to keep in its own updates (OPD's `cft_weight`).

    Call number c draws slots c*batch_size .. (c+1)*batch_size - 1 of a stream that walks a seeded
    shuffle of `examples` (a fresh shuffle per pass; this process takes its share, slots
    rank::world of the global batch), noises each example as CFT does (`example_masks`, in epochs
    past CFT's own, so the noise is new) and returns the mean weighted NLL of their masked tokens,
    with grad. The batch is a function of c alone: a resumed run draws what an uninterrupted one
    would, and several processes draw together exactly what one would.
    """

    def __init__(
        self,
        tok: PreTrainedTokenizerBase,
        examples: Sequence[tuple[str, str]],
        cfg: CFTConfig,
        *,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.encoded = _encode_all(tok, examples, cfg, "CFT anchor")
        if not self.encoded:
            raise ValueError("CFT anchor: no example with a response block")
        self.cfg, self.batch_size, self.seed, self.rank, self.world = cfg, batch_size, seed, rank, world
        self.pad_id, self.mask_id = tok.pad_token_id, tok.mask_token_id

    def draws(self, call: int) -> list[tuple[int, int]]:
        """The global batch of call number `call`: (pass over the examples, example index) per slot."""
        n = len(self.encoded)
        out = []
        for k in range(call * self.batch_size, (call + 1) * self.batch_size):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(self.seed, k // n)))
            out.append((k // n, int(order[k % n])))
        return out

    def share(self, call: int) -> list[tuple[int, int]]:
        """This process's part of `draws(call)`: slots rank, rank + world, ..."""
        return self.draws(call)[self.rank :: self.world]

    def __call__(self, model: torch.nn.Module, device: torch.device, call: int) -> torch.Tensor:
        """Scalar: sum(w * nll) / sum(w) over this process's share of batch `call` (0, no grad, with no share)."""
        mine = self.share(call)
        if not mine:
            return torch.zeros((), device=device)
        # Passes past CFT's own epochs: noise CFT never drew for that example.
        masks = [example_masks(len(self.encoded[i]["response_ids"]), self.cfg, epoch=self.cfg.epochs + p, index=i) for p, i in mine]
        batch = _batch_on(self.encoded, [i for _, i in mine], masks, self.cfg, self.mask_id, self.pad_id, device)
        weighted, stats, _ = _loss_sums(model, batch)
        return weighted / stats[0].clamp(min=torch.finfo(torch.float32).tiny)
