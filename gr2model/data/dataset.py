"""Interaction data: loading, k-core filtering, leave-one-out split, prepared files.

Two input formats reach the same `Dataset`:
- "sequence": the published Beauty files (`Beauty.txt`, one line per user
  `user_id item item ...`, plus `{"item_id": [ints]}` JSON files for attributes
  and semantic ids), integer ids already assigned;
- "raw": the McAuley Amazon review dump (`reviews_<Category>[_5].json[.gz]`, one
  JSON object per line, and optionally `meta_<Category>.json[.gz]`), from which
  this module builds the k-core, the time order and the integer ids.

Ids are 1-based everywhere; 0 is reserved for padding, so an embedding table for
items has `num_items + 1` rows. Every error about input is a `DataError` whose
message names the file and the line and/or field at fault.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import polars as pl

__all__ = [
    "DataError",
    "Dataset",
    "load_sequence_dataset",
    "load_raw_reviews",
    "kcore_filter",
    "leave_one_out",
    "save_prepared",
    "load_prepared",
    "detect_format",
    "raw_reviews_files",
    "download_raw",
]

_ITEMS_SCHEMA = {"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)}
_SEQUENCES_SCHEMA = {"user_id": pl.Int64, "items": pl.List(pl.Int64)}
_SPLIT_SCHEMA = {"user_id": pl.Int64, "train": pl.List(pl.Int64), "valid": pl.Int64, "test": pl.Int64}


class DataError(ValueError):
    """Bad input; the message names the file and the line number and/or field,
    e.g. "Beauty.txt line 17: token 'x9' is not an integer"."""


@dataclass
class Dataset:
    """Users' item sequences and the items' side information.

    sequences: user_id Int64 (1-based), items List(Int64) oldest first; one row per
        user, sorted by user_id.
    items: item_id Int64, sid List(Int64) (null when no semantic ids were given),
        attributes List(Int64) (possibly empty); one row per item occurring in
        sequences, sorted by item_id.
    user_keys: user_id, user_key (Utf8, the original reviewerID) when known.
    item_keys: item_id, item_key (Utf8, the ASIN) when known.
    """

    sequences: pl.DataFrame
    items: pl.DataFrame
    user_keys: pl.DataFrame | None = None
    item_keys: pl.DataFrame | None = None

    @property
    def num_users(self) -> int:
        """Number of users (rows of `sequences`)."""
        return self.sequences.height

    @property
    def num_items(self) -> int:
        """Largest item id: embedding tables need num_items + 1 rows (row 0 = padding)."""
        return int(self.items["item_id"].max() or 0)

    @property
    def num_interactions(self) -> int:
        """Total length of all sequences."""
        return int(self.sequences["items"].list.len().sum())

    @property
    def avg_seq_len(self) -> float:
        """Mean sequence length (0.0 for no users)."""
        return self.num_interactions / self.num_users if self.num_users else 0.0

    def attribute_map(self) -> dict[int, list[int]]:
        """item_id -> attribute ids, the form `semantic_ids.build_semantic_ids` takes."""
        return dict(zip(self.items["item_id"].to_list(), self.items["attributes"].to_list()))


# --------------------------------------------------------------------------- files


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise DataError(f"{path.name}: file not found ({path})")
    return path.read_bytes()


def _decode(path: Path, raw: bytes) -> str:
    if raw[:2] == b"\x1f\x8b":  # gzip magic: trust the content over the suffix
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path.name} line 1: starts with the gzip signature but is not valid gzip data ({e})") from e
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path.name} line {line}: not valid UTF-8") from e


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for the non-blank lines of a plain or gzip text file.

    Lines end at "\n" only (a trailing "\r" is dropped): str.splitlines would also
    break at form feeds, U+0085 or U+2028, and the numbers in error messages
    would then differ from the lines an editor shows.
    """
    for n, line in enumerate(_decode(path, _read_bytes(path)).split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield n, line


# Within a line of the sequence file: C0/C1 control characters other than tab, and
# Unicode line/paragraph separators. They are whitespace to the tokenizer, so a
# line break corrupted into one would silently merge two users.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
# Ids are stored as Int64.
_MAX_ID = 2**63 - 1


def _json_loads(path: Path, text: str, line: int) -> Any:
    """json.loads with every way it fails as a DataError naming the file and line.

    Besides JSONDecodeError: ValueError for integers of more than 4,300 digits
    (Python's limit on int parsing) and RecursionError for deeply nested arrays.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path.name} line {line + e.lineno - 1}: invalid JSON ({e.msg}, column {e.colno})") from e
    except ValueError as e:
        raise DataError(f"{path.name} line {line}: invalid JSON ({e})") from e
    except RecursionError:
        raise DataError(f"{path.name} line {line}: invalid JSON (nested too deeply)") from None


# ------------------------------------------------------------------ sequence format


def _load_id_map(path: Path) -> dict[int, list[int]]:
    """`{"item_id": [int, ...]}` JSON -> {item_id: [ints]}, validated."""
    text = _decode(path, _read_bytes(path))
    if not text.strip():
        raise DataError(f"{path.name}: file is empty")
    obj = _json_loads(path, text, 1)
    if not isinstance(obj, dict):
        raise DataError(f"{path.name} line 1: expected a JSON object {{\"item_id\": [ints]}}")
    out: dict[int, list[int]] = {}
    for key, value in obj.items():
        try:
            item = int(key)
        except ValueError:
            raise DataError(f"{path.name}: key {key!r} is not an integer item id") from None
        # bool is an int subclass; true/false in an id list is a corrupt file, not 1/0.
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _MAX_ID for v in value):
            raise DataError(f"{path.name} item {item}: value must be a list of integers (64-bit), got {str(value)[:200]}")
        out[item] = value
    return out


def _first_use(exploded: pl.DataFrame, item: int) -> int:
    return int(exploded.filter(pl.col("v") == item)["lineno"].min())


def load_sequence_dataset(
    data_dir: Path,
    *,
    sequence_file: str = "Beauty.txt",
    attributes_file: str | None = "Beauty_item2attributes.json",
    sid_file: str | None = "Beauty_item2sid_rqvae.json",
    sid_length: int = 4,
    min_seq_len: int = 3,
    max_users: int | None = None,
) -> Dataset:
    """Load the published sequence format.

    `sequence_file` has one line per user, `user_id item item ...`, oldest first;
    blank lines are skipped. `max_users` keeps the first N user lines (smoke runs;
    lines after them are not validated). Attribute and semantic-id files map
    `"item_id"` to a list of ints; every item in the kept sequences must have an entry.
    attributes_file=None gives empty attribute lists, sid_file=None a null sid column.

    Returns a Dataset without user/item keys. Raises DataError on: a missing or empty
    file, a non-integer or non-positive token, a user on two lines, a user with fewer
    than `min_seq_len` items, an item missing from the attribute or sid file, a
    semantic id of the wrong length or with a negative code, two items with one sid.
    """
    data_dir = Path(data_dir)
    seq_path = data_dir / sequence_file
    name = seq_path.name
    lines = list(_lines(seq_path))
    if not lines:
        raise DataError(f"{name}: file is empty")
    for n, line in lines:
        if m := _CONTROL_RE.search(line):
            raise DataError(f"{name} line {n}: control character U+{ord(m.group(0)):04X} (a corrupted file?)")
    if max_users is not None:
        lines = lines[:max_users]

    # Polars does the splitting and integer parsing; the Python side only reports.
    df = pl.DataFrame(
        {"lineno": [n for n, _ in lines], "line": [s for _, s in lines]},
        schema={"lineno": pl.Int64, "line": pl.String},
    )
    exploded = (
        df.select("lineno", tok=pl.col("line").str.extract_all(r"\S+"))
        .explode("tok")
        .with_columns(v=pl.col("tok").str.to_integer(strict=False))
    )
    bad = exploded.filter(pl.col("v").is_null()).head(1)
    if bad.height:
        raise DataError(f"{name} line {bad['lineno'][0]}: token {bad['tok'][0][:40]!r} is not an integer (ids are 1..{_MAX_ID})")
    bad = exploded.filter(pl.col("v") < 1).head(1)
    if bad.height:
        raise DataError(f"{name} line {bad['lineno'][0]}: id {bad['v'][0]} must be >= 1 (0 is padding)")

    per_line = exploded.group_by("lineno", maintain_order=True).agg(pl.col("v"))
    per_line = per_line.select(
        "lineno",
        user_id=pl.col("v").list.first(),
        items=pl.col("v").list.slice(1),
    )
    dup = (
        per_line.group_by("user_id")
        .agg(pl.col("lineno").sort())
        .filter(pl.col("lineno").list.len() > 1)
        .sort(pl.col("lineno").list.first())
        .head(1)
    )
    if dup.height:
        first, second = dup["lineno"][0].to_list()[:2]
        raise DataError(f"{name} lines {first} and {second}: user {dup['user_id'][0]} appears on both lines")
    short = per_line.filter(pl.col("items").list.len() < min_seq_len).head(1)
    if short.height:
        raise DataError(
            f"{name} line {short['lineno'][0]}: user {short['user_id'][0]} has "
            f"{short['items'][0].len()} items, fewer than min_seq_len={min_seq_len}"
        )
    sequences = per_line.select("user_id", "items").sort("user_id")

    # Item tokens only (the user id is the first token of each line).
    item_tokens = exploded.with_columns(pos=pl.int_range(pl.len()).over("lineno")).filter(pl.col("pos") > 0)
    item_ids: list[int] = item_tokens["v"].unique().sort().to_list()

    attributes: list[list[int]] = [[] for _ in item_ids]
    if attributes_file is not None:
        path = data_dir / attributes_file
        amap = _load_id_map(path)
        for idx, item in enumerate(item_ids):
            if item not in amap:
                raise DataError(
                    f"{path.name}: item {item} has no entry (used in {name} line {_first_use(item_tokens, item)})"
                )
            attributes[idx] = amap[item]

    sids: list[list[int] | None] = [None for _ in item_ids]
    if sid_file is not None:
        path = data_dir / sid_file
        smap = _load_id_map(path)
        seen: dict[tuple[int, ...], int] = {}
        for idx, item in enumerate(item_ids):
            if item not in smap:
                raise DataError(
                    f"{path.name}: item {item} has no entry (used in {name} line {_first_use(item_tokens, item)})"
                )
            sid = smap[item]
            if len(sid) != sid_length:
                raise DataError(f"{path.name} item {item}: semantic id has length {len(sid)}, expected {sid_length}")
            if min(sid) < 0:
                raise DataError(f"{path.name} item {item}: semantic id {sid} has a negative code")
            # A shared id would make a generated id ambiguous: refuse it here, where
            # the cause is visible, rather than as a wrong item at decoding time.
            other = seen.setdefault(tuple(sid), item)
            if other != item:
                raise DataError(f"{path.name} items {other} and {item}: both have semantic id {sid}")
            sids[idx] = sid

    items = pl.DataFrame({"item_id": item_ids, "sid": sids, "attributes": attributes}, schema=_ITEMS_SCHEMA)
    return Dataset(sequences=sequences.cast(_SEQUENCES_SCHEMA), items=items)


# ----------------------------------------------------------------------- raw format


def kcore_filter(interactions: pl.DataFrame, k: int) -> pl.DataFrame:
    """Keep the k-core: the largest subset of rows in which every user_key and every
    item_key has at least k rows.

    Removing one side's rare keys can push the other side below k, so this repeats
    until nothing changes (a fixed point). Rows keep their order and all columns.

    interactions: columns user_key, item_key (+ any others, kept).
    """
    df = interactions
    if k <= 1:
        return df
    while True:
        n = df.height
        df = df.filter((pl.len().over("user_key") >= k) & (pl.len().over("item_key") >= k))
        if df.height == n:
            return df


_REVIEW_FIELDS: dict[str, type] = {"reviewerID": str, "asin": str, "unixReviewTime": int}


def _read_reviews(path: Path) -> pl.DataFrame:
    """user_key, item_key, time, row (0-based file order) from a review dump."""
    users: list[str] = []
    items: list[str] = []
    times: list[int] = []
    for n, line in _lines(path):
        rec = _json_loads(path, line, n)
        if not isinstance(rec, dict):
            raise DataError(f"{path.name} line {n}: expected a JSON object")
        for field, typ in _REVIEW_FIELDS.items():
            if field not in rec:
                raise DataError(f"{path.name} line {n}: field {field!r} is missing")
            value = rec[field]
            if not isinstance(value, typ) or isinstance(value, bool):
                raise DataError(f"{path.name} line {n}: field {field!r} should be {typ.__name__}, got {str(value)[:80]}")
            if typ is int and abs(value) > _MAX_ID:
                raise DataError(f"{path.name} line {n}: field {field!r} is out of the 64-bit range, got {str(value)[:40]}...")
        users.append(rec["reviewerID"])
        items.append(rec["asin"])
        times.append(rec["unixReviewTime"])
    if not users:
        raise DataError(f"{path.name}: file is empty")
    return pl.DataFrame(
        {"user_key": users, "item_key": items, "time": times},
        schema={"user_key": pl.String, "item_key": pl.String, "time": pl.Int64},
    ).with_row_index("row")


_ASIN_RE = re.compile(r"""['"]asin['"]\s*:\s*['"]([^'"]+)['"]""")


def _read_meta(path: Path, wanted: set[str]) -> dict[str, list[str]]:
    """asin -> attribute strings (category names and "brand:<brand>") for `wanted` asins.

    The 2014 meta files hold one Python dict literal per line (single quotes), so
    json.loads is tried first and ast.literal_eval second. literal_eval is slow and
    the files are large, so lines whose asin is visibly not wanted are skipped
    unparsed (a regex finds the asin); only the others are validated.
    """
    out: dict[str, list[str]] = {}
    for n, line in _lines(path):
        m = _ASIN_RE.search(line)
        if m is not None and m.group(1) not in wanted:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, or an int over 4,300 digits, or nesting
            try:
                rec = ast.literal_eval(line)
            # TypeError: a literal that builds nothing hashable, such as {[1]: 2}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
                raise DataError(f"{path.name} line {n}: neither JSON nor a Python dict literal ({e})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path.name} line {n}: expected an object/dict")
        asin = rec.get("asin")
        if not isinstance(asin, str):
            raise DataError(f"{path.name} line {n}: field 'asin' is missing or not a string")
        if asin not in wanted:
            continue
        cats = rec.get("categories", [])
        if not isinstance(cats, list) or not all(
            isinstance(c, list) and all(isinstance(s, str) for s in c) for c in cats
        ):
            raise DataError(f"{path.name} line {n}: field 'categories' should be a list of lists of strings")
        brand = rec.get("brand")
        if brand is not None and not isinstance(brand, str):
            raise DataError(f"{path.name} line {n}: field 'brand' should be a string, got {brand!r}")
        attrs = [s for c in cats for s in c]
        if brand and brand.strip():
            attrs.append(f"brand:{brand.strip()}")
        out[asin] = attrs
    return out


def load_raw_reviews(
    reviews_path: Path,
    *,
    meta_path: Path | None = None,
    k: int = 5,
    min_seq_len: int = 3,
    max_users: int | None = None,
) -> Dataset:
    """Build a Dataset from an Amazon review dump (plain or gzip, one JSON object per
    line with reviewerID, asin, unixReviewTime).

    Steps: k-core filter (`kcore_filter`); users with fewer than `min_seq_len`
    reviews dropped (only possible when k < min_seq_len); each user's reviews sorted
    by time, ties kept in file order; ids assigned deterministically:
    - user ids 1.. in order of the user's first review in the file,
    - item ids 1.. in order of first appearance reading the sequences in user-id
      order (the convention of the published Beauty.txt);
    `max_users` keeps users 1..N before items are numbered, so item ids stay
    contiguous in a smoke run.

    Attributes (when `meta_path` is given): the distinct category strings and
    "brand:<brand>" of the kept items, numbered 1.. in sorted string order; each
    item's list is its sorted distinct ids; items absent from the meta get [].
    sid is null (the prepare stage builds ids with `semantic_ids`).
    """
    reviews_path = Path(reviews_path)
    df = kcore_filter(_read_reviews(reviews_path), k)
    df = df.filter(pl.len().over("user_key") >= min_seq_len)
    if df.height == 0:
        raise DataError(f"{reviews_path.name}: no user keeps {max(k, min_seq_len)} reviews after the {k}-core filter")

    users = (
        df.group_by("user_key")
        .agg(first_row=pl.col("row").min())
        .sort("first_row")
        .with_row_index("user_id", offset=1)
        .select(pl.col("user_id").cast(pl.Int64), "user_key")
    )
    if max_users is not None:
        users = users.head(max_users)
    # Sorting by row after time makes ties follow file order without relying on sort stability.
    df = df.join(users, on="user_key", how="inner").sort("user_id", "time", "row")
    item_keys = (
        df.with_row_index("pos")
        .group_by("item_key")
        .agg(first_pos=pl.col("pos").min())
        .sort("first_pos")
        .with_row_index("item_id", offset=1)
        .select(pl.col("item_id").cast(pl.Int64), "item_key")
    )
    df = df.join(item_keys, on="item_key", how="left", maintain_order="left")
    sequences = df.group_by("user_id", maintain_order=True).agg(items=pl.col("item_id")).sort("user_id")

    keys = item_keys["item_key"].to_list()
    attributes: list[list[int]] = [[] for _ in keys]
    if meta_path is not None:
        meta = _read_meta(Path(meta_path), set(keys))
        vocab = {s: i for i, s in enumerate(sorted({s for attrs in meta.values() for s in attrs}), start=1)}
        attributes = [sorted({vocab[s] for s in meta.get(key, [])}) for key in keys]
    items = pl.DataFrame(
        {"item_id": item_keys["item_id"], "sid": [None] * len(keys), "attributes": attributes},
        schema=_ITEMS_SCHEMA,
    )
    return Dataset(
        sequences=sequences.cast(_SEQUENCES_SCHEMA),
        items=items,
        user_keys=users,
        item_keys=item_keys,
    )


# ------------------------------------------------------------------------ the split


def leave_one_out(sequences: pl.DataFrame) -> pl.DataFrame:
    """Last item = test, second to last = validation, the rest = training.

    sequences: user_id, items List(Int64) oldest first, every list >= 3 long.
    Returns user_id Int64, train List(Int64), valid Int64, test Int64, same row order.
    """
    short = sequences.filter(pl.col("items").list.len() < 3).head(1)
    if short.height:
        raise DataError(
            f"sequences user {short['user_id'][0]}: {short['items'][0].len()} items; leave-one-out needs at least 3"
        )
    n = pl.col("items").list.len()
    return sequences.select(
        "user_id",
        train=pl.col("items").list.head(n - 2),
        valid=pl.col("items").list.get(-2),
        test=pl.col("items").list.last(),
    ).cast(_SPLIT_SCHEMA)


# -------------------------------------------------------------------- prepared files

_PREPARED_FILES = {
    "sequences": "sequences.parquet",
    "items": "items.parquet",
    "split": "split.parquet",
    "user_keys": "user_keys.parquet",
    "item_keys": "item_keys.parquet",
}


def save_prepared(dataset: Dataset, split: pl.DataFrame, out_dir: Path) -> None:
    """Write the dataset and its split as parquet files into `out_dir`
    (sequences, items, split, and user_keys/item_keys when known).

    Everything is written into a temporary sibling folder that is renamed to
    `out_dir` at the end, so readers (and DVC) never see a half-written out_dir; an
    existing out_dir is replaced only once the new one is complete, and on failure
    the temporary folder is removed and any old out_dir is left as it was.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{tag}")
    old = out_dir.with_name(f".{out_dir.name}.old-{tag}")
    frames = {
        "sequences": dataset.sequences,
        "items": dataset.items,
        "split": split,
        "user_keys": dataset.user_keys,
        "item_keys": dataset.item_keys,
    }
    try:
        tmp.mkdir()
        for key, frame in frames.items():
            if frame is not None:
                frame.write_parquet(tmp / _PREPARED_FILES[key])
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            old.rename(out_dir)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_prepared(out_dir: Path) -> tuple[Dataset, pl.DataFrame]:
    """Read what `save_prepared` wrote: (Dataset, split)."""
    out_dir = Path(out_dir)
    frames: dict[str, pl.DataFrame | None] = {}
    for key, fname in _PREPARED_FILES.items():
        path = out_dir / fname
        if path.is_file():
            frames[key] = pl.read_parquet(path)
        elif key in ("user_keys", "item_keys"):
            frames[key] = None
        else:
            raise DataError(f"{fname}: missing from {out_dir} (was the prepare stage run?)")
    dataset = Dataset(
        sequences=frames["sequences"],
        items=frames["items"],
        user_keys=frames["user_keys"],
        item_keys=frames["item_keys"],
    )
    return dataset, frames["split"]


# ------------------------------------------------------------------ finding the data

_REVIEWS_GLOBS = ("reviews_*.json", "reviews_*.json.gz")


def detect_format(data_dir: Path, sequence_file: str) -> Literal["sequence", "raw"]:
    """"sequence" if data_dir/sequence_file exists, "raw" if a reviews_*.json(.gz)
    file does, else DataError saying what was looked for."""
    data_dir = Path(data_dir)
    if (data_dir / sequence_file).is_file():
        return "sequence"
    if any(p.is_file() for g in _REVIEWS_GLOBS for p in data_dir.glob(g)):
        return "raw"
    raise DataError(
        f"{data_dir}: no input data; looked for {sequence_file} (sequence format) and "
        f"{' or '.join(_REVIEWS_GLOBS)} (raw Amazon reviews)"
    )


def raw_reviews_files(data_dir: Path) -> tuple[Path, Path | None]:
    """The single reviews_<Category>[_5].json[.gz] file in data_dir and the matching
    meta_<Category>.json[.gz] (plain preferred) or None."""
    data_dir = Path(data_dir)
    found = sorted(p for g in _REVIEWS_GLOBS for p in data_dir.glob(g) if p.is_file())
    if not found:
        raise DataError(f"{data_dir}: no {' or '.join(_REVIEWS_GLOBS)} file")
    if len(found) > 1:
        raise DataError(f"{data_dir}: several review files, keep one: {', '.join(p.name for p in found)}")
    reviews = found[0]
    m = re.fullmatch(r"reviews_(.+?)(?:_5)?\.json(?:\.gz)?", reviews.name)
    category = m.group(1) if m else ""
    for name in (f"meta_{category}.json", f"meta_{category}.json.gz"):
        if (data_dir / name).is_file():
            return reviews, data_dir / name
    return reviews, None


def download_raw(
    category: str,
    dest_dir: Path,
    *,
    base_url: str = "https://snap.stanford.edu/data/amazon/productGraph/categoryFiles",
) -> Path:
    """Download reviews_{category}_5.json.gz and meta_{category}.json.gz into dest_dir
    (files already there are kept). Each goes to a temporary name and is renamed
    when complete; progress is written to stderr. Returns the reviews file's path."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", category):
        raise DataError(f"category {category!r}: expected letters, digits and underscores, e.g. 'Beauty'")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    names = [f"reviews_{category}_5.json.gz", f"meta_{category}.json.gz"]
    for name in names:
        target = dest_dir / name
        if target.is_file():
            continue
        url = f"{base_url.rstrip('/')}/{name}"
        part = dest_dir / f".{name}.part-{uuid.uuid4().hex[:8]}"
        try:
            with urllib.request.urlopen(url, timeout=60) as resp, open(part, "wb") as f:
                total = int(resp.headers.get("Content-Length") or 0)
                done = 0
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    done += len(chunk)
                    of = f" / {total / 2**20:.1f}" if total else ""
                    sys.stderr.write(f"\rdownloading {name}: {done / 2**20:.1f}{of} MiB")
                    sys.stderr.flush()
            sys.stderr.write("\n")
            os.replace(part, target)
        except (urllib.error.URLError, OSError) as e:
            part.unlink(missing_ok=True)
            raise DataError(f"{name}: download from {url} failed ({e})") from e
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    return dest_dir / names[0]
