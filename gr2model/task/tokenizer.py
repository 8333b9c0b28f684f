"""The Hugging Face tokenizer of the re-ranking format.

Two ways to get one:
- `build_tokenizer`: a word-level tokenizer whose vocabulary is exactly the
  format's tokens (specials, JSON tokens, prompt words, one token per semantic-id
  code per level, attribute tokens) plus the words of the traces. Every text of
  the format has its tokens separated by single spaces (`gr2model.task.rerank_format`),
  so a whitespace split is the exact tokenization and `decode` (which joins
  tokens with single spaces) gives the canonical text back.
- `extend_pretrained_tokenizer`: a local pretrained tokenizer (e.g. a Qwen3
  checkpoint's) with the same special, semantic-id and attribute tokens added, so
  a real base model reads and writes the same format.

Both are `save_pretrained` folders that `AutoTokenizer.from_pretrained` loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import polars as pl
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from gr2model.task.rerank_format import (
    ASSISTANT,
    BOS,
    EOS,
    EXPLANATION_KEY,
    EVIDENCE_LEVELS,
    MAX_EVIDENCE,
    MAX_POSITIONS,
    JSON_TOKENS,
    MASK,
    PAD,
    PROMPT_WORDS,
    RECOMMENDATIONS_KEY,
    SID_LEVELS,
    SPECIAL_TOKENS,
    UNK,
    USER,
    attr_token,
    evidence_token,
    pos_token,
    sid_token,
)

__all__ = ["build_tokenizer", "extend_pretrained_tokenizer", "single_token_id", "special_ids", "format_tokens"]

# Named roles of the special tokens, as transformers knows them.
_ROLES = {"pad_token": PAD, "unk_token": UNK, "bos_token": BOS, "eos_token": EOS, "mask_token": MASK}
_EXTRA_SPECIALS = [USER, ASSISTANT]


def _table_codes(items: pl.DataFrame) -> tuple[list[int], int]:
    """(max code of each sid level over the items, max attribute id; 0 when none)."""
    sids = items["sid"].drop_nulls()
    level_max = [0] * len(SID_LEVELS)
    if len(sids):
        lengths = sids.list.len()
        if (lengths != len(SID_LEVELS)).any():
            raise ValueError(f"every semantic id must have {len(SID_LEVELS)} codes")
        for lvl in range(len(SID_LEVELS)):
            codes = sids.list.get(lvl)
            if int(codes.min()) < 0:
                raise ValueError(f"negative code at sid level {SID_LEVELS[lvl]}")
            level_max[lvl] = int(codes.max())
    attrs = items["attributes"].drop_nulls().explode().drop_nulls()
    if len(attrs) and int(attrs.min()) < 1:
        raise ValueError("attribute ids must be >= 1")
    return level_max, int(attrs.max()) if len(attrs) else 0


def format_tokens(
    items: pl.DataFrame, *, max_sid_code: int = 255, max_positions: int = MAX_POSITIONS, max_evidence: int = 0
) -> list[str]:
    """Every non-special token of the format, in vocabulary order: JSON tokens,
    prompt words, `<a_0>`..`<a_{max_sid_code}>` (same for b and c),
    `<d_0>`..`<d_{max_d}>`, `<attr_1>`..`<attr_{max_attr}>`, `<pos_1>`..`<pos_50>`
    (the index answer format's position tokens; always present so both answer
    formats share one vocabulary).

    max_d is the larger of max_sid_code and the table's largest d code (the d
    level is a collision code that may exceed the codebook size); sizing it no
    smaller than the codebook keeps the vocabulary the same for any subset of
    items (smoke runs, cross-fitting). max_attr is the table's largest attribute.
    max_positions: how many position tokens (0 for a vocabulary that only ever
    writes semantic-id answers, e.g. the tests' smallest models).

    Raises:
        ValueError: an a, b or c code above max_sid_code, a malformed sid, an attribute < 1.
    """
    level_max, max_attr = _table_codes(items)
    for lvl, top in zip(SID_LEVELS[:-1], level_max[:-1]):
        if top > max_sid_code:
            raise ValueError(f"sid level {lvl} has code {top} > max_sid_code={max_sid_code}")
    tokens = [*JSON_TOKENS, *PROMPT_WORDS]
    for lvl in SID_LEVELS[:-1]:
        tokens += [sid_token(lvl, c) for c in range(max_sid_code + 1)]
    tokens += [sid_token(SID_LEVELS[-1], c) for c in range(max(max_sid_code, level_max[-1]) + 1)]
    tokens += [attr_token(a) for a in range(1, max_attr + 1)]
    if not 0 <= max_positions <= MAX_POSITIONS:
        raise ValueError(f"max_positions must be in 0..{MAX_POSITIONS}, got {max_positions}")
    tokens += [pos_token(k) for k in range(1, max_positions + 1)]
    if not 0 <= max_evidence <= MAX_EVIDENCE:
        raise ValueError(f"max_evidence must be in 0..{MAX_EVIDENCE}, got {max_evidence}")
    tokens += [evidence_token(f, b) for f in range(1, max_evidence + 1) for b in range(EVIDENCE_LEVELS)]
    return tokens


def build_tokenizer(
    items: pl.DataFrame,
    words: Iterable[str],
    *,
    max_sid_code: int = 255,
    max_positions: int = MAX_POSITIONS,
    max_evidence: int = 0,
) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer for the format.

    Vocabulary: the specials `<|pad|> <|unk|> <|bos|> <|eos|> <|user|>
    <|assistant|> <|mask|>` (ids 0..6, in that order), then `format_tokens`, then
    the trace words not already in it, sorted (so the ids do not depend on the
    order, e.g. a set's, in which words arrive). Unknown words encode to
    `<|unk|>`. Nothing is added around an encoded text (no BOS/EOS): the format
    writes its own end token.

    Args:
        items: the prepared items table (item_id, sid, attributes).
        words: the words of the reasoning traces; each must be free of whitespace.
    Raises:
        ValueError: a word that is empty or contains whitespace (the whitespace
            pre-tokenizer could never produce it), or a bad items table.
    """
    vocab_list = [
        *SPECIAL_TOKENS,
        *format_tokens(items, max_sid_code=max_sid_code, max_positions=max_positions, max_evidence=max_evidence),
    ]
    known = set(vocab_list)
    extra: set[str] = set()
    for word in words:
        if not word or any(ch.isspace() for ch in word):
            raise ValueError(f"word {word!r} is empty or contains whitespace")
        if word not in known:
            extra.add(word)
    vocab_list += sorted(extra)
    vocab = {tok: i for i, tok in enumerate(vocab_list)}

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Registered as special so `skip_special_tokens` drops them and they are
    # matched even when glued to a word ("<|user|>history").
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens=list(_EXTRA_SPECIALS),
        # transformers' clean-up would turn " ," into "," and break the round trip.
        clean_up_tokenization_spaces=False,
        **_ROLES,
    )


def extend_pretrained_tokenizer(
    path: str | Path, items: pl.DataFrame, words: Iterable[str] = (), *, max_sid_code: int = 255, max_evidence: int = 0
) -> PreTrainedTokenizerBase:
    """A local pretrained tokenizer with the format's tokens added.

    Added: the 7 specials as special tokens (pad, bos, eos, mask take those roles,
    so `generate` stops at `<|eos|>`), the two JSON keys and every semantic-id and
    attribute token of `format_tokens` as normal added tokens, each a single id.
    The other JSON tokens and the prompt words stay with the base tokenizer,
    which already encodes them. `words` (usually empty with a pretrained model)
    are added as whole-word tokens. The caller resizes the model's embeddings
    to `len(tok)`.

    Added tokens strip the space on their left (`lstrip`): a byte-level BPE would
    otherwise spend one token per space before every id token, doubling the
    length of each written item. The price is that `decode` writes
    "likes<a_1><b_2>" without those spaces; `parse_response` does not care.

    Args:
        path: a local folder with a tokenizer (no download is attempted).
    """
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def added(content: str, *, special: bool, single_word: bool = False) -> AddedToken:
        return AddedToken(content, lstrip=not single_word, rstrip=False, single_word=single_word,
                          normalized=False, special=special)

    specials: dict[str, object] = {role: added(s, special=True) for role, s in _ROLES.items() if role != "unk_token"}
    # Byte-level BPEs never produce an unknown token and keep no unk role; <|unk|>
    # is added as a plain special so the vocabulary matches `build_tokenizer`'s.
    specials["extra_special_tokens"] = [added(s, special=True) for s in [*_EXTRA_SPECIALS, UNK]]
    tok.add_special_tokens(specials, replace_extra_special_tokens=False)
    # The sid and attribute tokens are the format tokens written "<...>".
    id_tokens = [t for t in format_tokens(items, max_sid_code=max_sid_code, max_evidence=max_evidence) if t.startswith("<")]
    tok.add_tokens([added(t, special=False) for t in [EXPLANATION_KEY, RECOMMENDATIONS_KEY, *id_tokens]])
    new_words = sorted({w for w in words if w and not any(ch.isspace() for ch in w)} - set(tok.get_vocab()))
    if new_words:
        tok.add_tokens([added(w, special=False, single_word=True) for w in new_words])
    tok.clean_up_tokenization_spaces = False
    return tok


def single_token_id(tok: PreTrainedTokenizerBase, token: str) -> int:
    """The id of `token`, which must be one token of `tok`.

    Raises:
        KeyError: the tokenizer lacks it as a single token.
    """
    idx = tok.convert_tokens_to_ids(token)
    # An unknown token maps to the unk id (or None): check it maps back.
    if not isinstance(idx, int) or tok.convert_ids_to_tokens(idx) != token:
        raise KeyError(f"tokenizer has no single token {token!r}")
    return idx


def special_ids(tok: PreTrainedTokenizerBase) -> dict[str, int]:
    """Ids of the format's special tokens: keys pad, eos, bos, user, assistant, mask.

    Raises:
        KeyError: the tokenizer lacks one of them as a single token.
    """
    tokens = {"pad": PAD, "eos": EOS, "bos": BOS, "user": USER, "assistant": ASSISTANT, "mask": MASK}
    return {name: single_token_id(tok, token) for name, token in tokens.items()}
