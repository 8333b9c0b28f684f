"""Format-constrained greedy decoding: every answer is a valid JSON ranking.

GR2's answers (answer-first, index format, `gr2model.task.rerank_format`) are the
token sequence

    { "recommendations" : [ " <pos_a> " , ... , " <pos_k> " ] , "explanation" : " w1 ... wn " } <|eos|>

with K position slots: the first L0 = 4K + 8 response positions are
position-determined (a fixed token, or a slot); then come n >= 0 words and the
tail `" } eos` (anything after the eos is cut). An invalid answer falls back to
the incoming order, so one lost quote hides a whole ranking. The block-diffusion
models lose them mostly at the explanation's end, where a parallel step commits
the closing quote, `}` or eos at places that do not fit the words around them
(every invalid dgr2 answer of 512 test examples was "not json" there).

A decoder that commits tokens out of order (block diffusion) can keep an answer
valid only if every token it commits leaves some valid completion of the
still-masked positions. `ResponseGrammar` gives the tokens that do, per
position, from the committed ones (`state`, then `allowed`):
- a fixed position allows its token only;
- a slot allows the row's K position tokens not committed in another slot;
- after the template come words (any token but the specials, `}` and tokens
  holding a quote, backslash or control character) and then the tail, the
  triple `" } eos` at some anchor e (its quote's position). An anchor is
  feasible while no tail token is committed before it and each of e, e + 1,
  e + 2 is uncommitted or holds its tail token (`_feasible`; tokens after the
  first eos are cut, so whatever lies there does not matter). A word may go
  where a feasible anchor does not cover it; a tail token where its own anchor
  is feasible, or where an earlier feasible anchor would cut it. A decode
  therefore always keeps some feasible anchor, and the last three positions
  take `" } eos` when everything before them is words: no answer runs out.
One step may pick several positions at once, each allowed on its own but not
together (two slots, one candidate; a word at or after a new tail's anchor; two
anchors). `consistent` keeps the row's most confident pick and what agrees
with it: the kept commits are always valid together.

The constraint only chooses among tokens: how sure the decoder is of its
choice is still the model's raw probability of it (`constrained_proposals`),
so a block-diffusion step commits a forced token no sooner than the model would
have. Whether the constraint changed an answer is counted per row, so the
model's own command of the format stays measurable beside the constrained
answers. Greedy only: sampled rollouts (RL, OPD) decode unconstrained, so their
replayed log-probabilities stay those of the model. For AR decoding (one
position per step, in order) the same rules are ordinary grammar-constrained
decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property, lru_cache

import torch
from transformers import PreTrainedTokenizerBase

from gr2model.task.rerank_format import EOS, EXPLANATION_KEY, MAX_POSITIONS, RECOMMENDATIONS_KEY, SPECIAL_TOKENS, FormatConfig, pos_token
from gr2model.task.tokenizer import single_token_id

__all__ = [
    "GrammarState", "ResponseGrammar", "answer_template", "check_covered", "check_grammar", "constrained_proposals", "covers",
]  # fmt: skip

# Position codes of `ResponseGrammar.codes` (a code >= 0 is the fixed token's id).
SLOT, WORD = -1, -2


def covers(fmt: FormatConfig) -> bool:
    """Whether the grammar describes this format's answers (answer "index", written first)."""
    return fmt.answer == "index" and fmt.answer_first


def check_covered(fmt: FormatConfig, what: str) -> None:
    """Raise ValueError naming `what` unless the grammar covers `fmt` (`covers`)."""
    if not covers(fmt):
        raise ValueError(f"{what} needs the answer-first index format, not answer={fmt.answer!r} answer_first={fmt.answer_first}")


def answer_template(k: int) -> list[str]:
    """The tokens of the fixed part of a K-candidate answer, "<slot>" for each position slot.

    Its length is L0 = 4K + 8; the explanation's words start at response position L0.
    """
    if not 1 <= k <= MAX_POSITIONS:
        raise ValueError(f"candidates per list must be 1..{MAX_POSITIONS}, got {k}")
    out = ["{", RECOMMENDATIONS_KEY, ":", "["]
    for i in range(k):
        out += ([","] if i else []) + ['"', "<slot>", '"']
    return out + ["]", ",", EXPLANATION_KEY, ":", '"']


@lru_cache(maxsize=8)
def _word_mask(tokenizer: PreTrainedTokenizerBase, tokenizer_len: int, vocab: int) -> torch.Tensor:
    """(vocab,) bool: the tokens a word of the explanation may be.

    Any token that cannot end or break the JSON string: no special token, none
    holding a quote, a backslash or a control character (the key tokens
    `"explanation"` and `"recommendations"` hold quotes), and not `}`, which
    after the template is always the tail's. Cached per tokenizer (and its
    length, should tokens be added): the scan over the vocabulary cost ~8 ms,
    once per decode call, which at batch 1 was ~5% of a constrained decode.
    Read-only: callers must not write into it.
    """
    words = torch.zeros(vocab, dtype=torch.bool)
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab and token not in SPECIAL_TOKENS and not any(c in '"\\' or ord(c) < 32 for c in token):
            words[idx] = True
    words[single_token_id(tokenizer, "}")] = False
    return words


class ResponseGrammar:
    """The answer grammar of one batch: one row per prompt, K candidates each.

    codes: (N, max_new_tokens) long, per response position a fixed token id, or
    SLOT, or WORD (the last three positions are the forced `" } eos`).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, ks: Sequence[int], max_new_tokens: int, *, vocab_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """ks: each row's number of candidates; vocab_size: the model's logits width
        (default the tokenizer's length; tokens beyond the tokenizer are never allowed)."""
        vocab = len(tokenizer) if vocab_size is None else vocab_size
        if vocab < len(tokenizer):
            raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")

        def tid(token: str) -> int:
            return single_token_id(tokenizer, token)

        self.quote, self.close, self.eos = tid('"'), tid("}"), tid(EOS)
        if not ks:
            raise ValueError("a grammar needs at least one row")
        self.pos_ids = torch.tensor([tid(pos_token(p)) for p in range(1, max(ks) + 1)], device=device)
        rows, template_len = [], []
        for k in ks:
            template = answer_template(k)
            template_len.append(len(template))
            if len(template) + 3 > max_new_tokens:
                raise ValueError(f"max_new_tokens {max_new_tokens} is too short for an answer to {k} candidates ({len(template) + 3} tokens without words)")
            fixed = [SLOT if t == "<slot>" else tid(t) for t in template]
            rows.append(fixed + [WORD] * (max_new_tokens - len(fixed) - 3) + [self.quote, self.close, self.eos])
        self.codes = torch.tensor(rows, dtype=torch.long, device=device)
        self.template_len = torch.tensor(template_len, dtype=torch.long, device=device)
        # (N, V): the position tokens a row's slots may hold (its first K).
        self.row_slots = torch.zeros((len(ks), vocab), dtype=torch.bool, device=device)
        for r, k in enumerate(ks):
            self.row_slots[r, self.pos_ids[:k]] = True
        self.words = _word_mask(tokenizer, len(tokenizer), vocab).to(device)
        # Lookups that every step would otherwise rebuild (a step is ~100 small
        # tensor ops, which is what the grammar costs on a CPU).
        self.tail_ids = torch.tensor([self.quote, self.close, self.eos], device=device)
        self._tail_code = torch.full((vocab,), -1, dtype=torch.long, device=device)
        self._tail_code[self.tail_ids] = torch.arange(3, device=device)
        cols = torch.arange(max_new_tokens, device=device)
        self._region = cols[None, :] >= self.template_len[:, None]  # (N, M): past the template
        self._anchor_ok = self._region & (cols <= max_new_tokens - 3)  # (N, M): where a tail fits
        self._is_slot = self.codes == SLOT

    @property
    def vocab_size(self) -> int:
        return self.words.shape[0]

    def past_template(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(n, W) bool: which of the rows' response `positions` (< max_new_tokens) lie past the answer template."""
        return self._region[rows].gather(1, positions)

    def _tail_offset(self, tok: torch.Tensor) -> torch.Tensor:
        """Per token: 0 for the quote, 1 for `}`, 2 for eos, -1 for any other."""
        return self._tail_code[tok]

    def _feasible(self, rows: torch.Tensor, tok: torch.Tensor, com: torch.Tensor) -> torch.Tensor:
        """(n, M) bool: the anchors e where the tail `" } eos` can still go.

        e (after the template, e + 2 < M) is feasible when no tail token is
        committed before it (all before it are words) and each of e, e + 1,
        e + 2 is uncommitted or already holds its tail token.
        """
        offset = self._tail_offset(tok)
        nonword = (com & self._region[rows] & (offset >= 0)).long()
        clean_before = nonword.cumsum(1) == nonword
        free = ~com
        fits = free | (offset == 0)
        for k in (1, 2):
            fits[:, :-k] &= free[:, k:] | (offset[:, k:] == k)
        # (The last two columns are never anchors: `_anchor_ok`.)
        return fits & clean_before & self._anchor_ok[rows]

    def state(self, rows: torch.Tensor, resp: torch.Tensor, committed: torch.Tensor) -> GrammarState:
        """What the committed tokens fix, for `allowed` and `consistent` (one step's rows).

        Args:
            rows: (n,) long, each active row's index into this grammar's rows.
            resp: (n, span) long, the rows' responses so far (anything where not committed).
            committed: (n, span) bool, the committed positions (span >= max_new_tokens).
        """
        m = self.codes.shape[1]
        tok, com = resp[:, :m], committed[:, :m]

        def used() -> torch.Tensor:
            slot_tok = torch.where(com & self._is_slot[rows], tok, self.vocab_size)
            out = torch.zeros((rows.shape[0], self.vocab_size + 1), dtype=torch.bool, device=resp.device)
            return out.scatter_(1, slot_tok, True)[:, : self.vocab_size]

        return GrammarState(rows, tok, com, used, lambda: self._feasible(rows, tok, com))

    def allowed(self, st: GrammarState, positions: torch.Tensor) -> torch.Tensor:
        """(n, W, V) bool: the tokens each of `positions` (n, W) response positions (< max_new_tokens) may take.

        After the template a word at p needs a feasible anchor whose tail does not
        cover p (one before p - 2 cuts p off, one after p leaves it a word); a tail
        token at p needs its own anchor feasible, or one at or before p - 3 (p is then cut).
        """
        m = self.codes.shape[1]
        n, w = positions.shape
        region = self.past_template(st.rows, positions)
        allowed = torch.zeros((n, w, self.vocab_size), dtype=torch.bool, device=positions.device)
        # Steps inside the template (block 0 mostly) need no anchors, steps in the
        # explanation no template: each half is skipped where it has no position.
        if not bool(region.all()):
            code = torch.where(region, WORD, self.codes[st.rows].gather(1, positions))
            allowed.scatter_(2, code.clamp(min=0)[..., None], (code >= 0)[..., None])
            allowed |= (code == SLOT)[..., None] & (self.row_slots[st.rows] & ~st.used)[:, None, :]
        if not bool(region.any()):
            return allowed
        # count[:, i]: feasible anchors < i (i = 0..M).
        count = torch.zeros((n, m + 1), dtype=torch.long, device=positions.device)
        count[:, 1:] = st.feasible.long().cumsum(1)
        before = count.gather(1, (positions - 2).clamp(min=0))
        covering = count.gather(1, positions + 1) - before
        allowed |= (region & (count[:, -1:] - covering > 0))[..., None] & self.words
        # The tail's token at offset o (quote, `}`, eos) at p: its anchor p - o is
        # feasible, or an earlier anchor (before p - 2) cuts p off.
        anchor = positions[..., None] - torch.arange(3, device=positions.device)  # (n, W, 3)
        own = st.feasible.gather(1, anchor.clamp(min=0).flatten(1)).view(n, w, 3) & (anchor >= 0)
        allowed[..., self.tail_ids] |= region[..., None] & (own | (before > 0)[..., None])
        return allowed

    def consistent(
        self, st: GrammarState, chosen: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """`chosen` (n, W) bool less the picks that do not fit the row's most confident one.

        Each pick was allowed on its own (`allowed`); together they may clash:
        two slots with one candidate (the more confident keeps it, the earlier on
        a tie), or picks of the tail and words that leave no feasible anchor. The
        tail's anchor is the first one a picked tail token names that is feasible,
        free of picked words and keeps the row's most confident pick (a
        block-diffusion model pads the rest of its last block with eos: those
        are after the end, cut); the most confident pick's own anchor counts
        even with picked words inside (they are dropped). Tail tokens before its
        eos that do not fit that anchor are dropped, and so are words inside its
        tail (picks after its eos are kept: cut). Without such an anchor, tail
        tokens are kept where an earlier anchor would cut them. If what is left is empty or leaves no feasible anchor,
        only the row's most confident pick is kept (it is allowed on its own).
        So what is kept is valid together, and a row always commits.
        """
        n, w = chosen.shape
        # A single pick per row is allowed, hence valid, on its own (the fast
        # path of most steps at a high threshold: the rules below keep it).
        if int(chosen.sum(1).max()) <= 1:
            return chosen
        c = chosen & self._is_slot[st.rows].gather(1, positions)
        same = (tokens[:, :, None] == tokens[:, None, :]) & c[:, :, None] & c[:, None, :]
        earlier = torch.ones((w, w), dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j < i
        beats = (confidence[:, None, :] > confidence[:, :, None]) | ((confidence[:, None, :] == confidence[:, :, None]) & earlier)
        chosen = chosen & ~(same & beats).any(-1)

        region = self.past_template(st.rows, positions)
        if not bool((chosen & region).any()):
            # Picks in the template only: no tail nor word among them, and the
            # anchors (which only the explanation's tokens move) stay feasible.
            return chosen
        offset = self._tail_offset(tokens)
        tail = chosen & region & (offset >= 0)
        word = chosen & region & (offset < 0)
        anchor = positions - offset
        best = confidence.masked_fill(~chosen, float("-inf")).argmax(1, keepdim=True)
        best_tail, best_pos, best_anchor = tail.gather(1, best), positions.gather(1, best), anchor.gather(1, best)
        # A picked word inside the tail of anchor a: a <= p <= a + 2.
        hit = (positions[:, None, :] >= anchor[:, :, None]) & (positions[:, None, :] <= anchor[:, :, None] + 2) & word[:, None, :]
        # Anchors that keep the best pick: its own, or one whose eos comes before it (cut).
        keeps_best = ~best_tail | (anchor == best_anchor) | (anchor <= best_pos - 3)
        m = self.codes.shape[1]
        feasible = st.feasible.gather(1, anchor.clamp(0, m - 1))  # read where `tail` says only
        candidate = tail & feasible & ~hit.any(-1) & keeps_best
        own = best_tail & feasible.gather(1, best)
        # The first end the picks write is the answer's end (as the parser reads
        # the first eos): what they put after its eos is cut, eos padding included.
        e = torch.minimum(torch.where(candidate, anchor, m).min(1, keepdim=True).values, torch.where(own, best_anchor, m))
        has_tail = candidate.any(1, keepdim=True) | own
        fits = (anchor == e) | (positions > e + 2)
        drop_tail = tail & has_tail & ~fits
        drop_word = word & has_tail & (positions >= e) & (positions <= e + 2)
        chosen = chosen & ~drop_tail & ~drop_word

        # Safety net: the kept picks must leave a feasible anchor.
        # (Unchosen picks write to a spare column M: a window past the limit repeats positions.)
        to = torch.where(chosen, positions, m)
        tok = torch.cat([st.tokens, st.tokens[:, :1]], 1).scatter_(1, to, tokens)[:, :m]
        com = torch.cat([st.committed, st.committed[:, :1]], 1).scatter_(1, to, True)[:, :m]
        ok = self._feasible(st.rows, tok, com).any(1, keepdim=True) & chosen.any(1, keepdim=True)
        only_best = torch.zeros_like(chosen).scatter_(1, best, True) & chosen
        return torch.where(ok, chosen, only_best)


class GrammarState:
    """What one step's committed tokens fix (`ResponseGrammar.state`), per active row.

    rows: (n,) long, the grammar rows; tokens, committed: (n, M) the responses
    and their committed positions; used: (n, V) bool, the position tokens in the
    row's slots; feasible: (n, M) bool, the anchors where the tail can still go
    (both computed on first use: a step inside the template needs no anchors, one
    past it no slots).
    """

    def __init__(
        self, rows: torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor, used: Callable[[], torch.Tensor],
        feasible: Callable[[], torch.Tensor],
    ) -> None:
        self.rows, self.tokens, self.committed = rows, tokens, committed
        self._make_used, self._make_feasible = used, feasible

    @cached_property
    def used(self) -> torch.Tensor:
        return self._make_used()

    @cached_property
    def feasible(self) -> torch.Tensor:
        return self._make_feasible()


def check_grammar(grammar: ResponseGrammar | None, rows: int, max_new_tokens: int, temperature: float) -> None:
    """Raise ValueError unless `grammar` is None or fits a greedy decode of `rows` prompts."""
    if grammar is None:
        return
    if temperature > 0.0:
        raise ValueError("constrained decoding is greedy only (temperature 0): sampled rollouts decode unconstrained")
    if tuple(grammar.codes.shape) != (rows, max_new_tokens):
        raise ValueError(f"grammar built for {tuple(grammar.codes.shape)} (rows, max_new_tokens), decoding ({rows}, {max_new_tokens})")


def constrained_proposals(logits: torch.Tensor, allowed: torch.Tensor, banned_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The most likely allowed token of each position, its raw probability, and whether it is the raw argmax.

    Args:
        logits: (N, W, V) raw logits (not modified).
        allowed: (N, W, V) bool, at least one True per position.
        banned_id: a token never proposed, constrained or not (the mask token).
    Returns:
        tokens: (N, W) long; confidence: (N, W) float32, softmax(logits) of the
        token (over the vocabulary less `banned_id`: the model's own certainty);
        free: (N, W) bool, True where the token is also the unconstrained argmax.
    """
    raw = logits.float()
    if banned_id is not None:
        raw = raw.clone()
        raw[..., banned_id] = float("-inf")
    # The choice in logit space (a forced token's probability may underflow to 0);
    # max, not argmax, and one softmax, not logsumexp: each is several times faster
    # on a CPU at these sizes.
    free_tok = raw.max(-1).indices
    tokens = torch.where(allowed, raw, float("-inf")).max(-1).indices
    confidence = torch.softmax(raw, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, confidence, tokens == free_tok
