"""`gr2 serve-check`: a served version answers exactly what its registry numbers were measured on.

A registered re-ranker carries `eval.*` tags: the accuracy of one `evaluate` row
(`eval.model`), decoded with one decoder setting (`eval.setting`), on one checkpoint
(`eval.checkpoint_md5`). `evaluate` also writes every LM row's parsed ranking of every
example to `reports/rankings.parquet`. This check serves the version with `gr2 serve`
(the same pyfunc and decoder setting a user gets), sends it the first N re-ranking
lists of a split, in `evaluate`'s order and at its `max_new_tokens`, and compares the
served rankings with that row's, list for list. Any difference means the numbers on
the version do not describe what it serves.

It refuses to start (ServeCheckError, exit 2) when there is nothing sound to compare
with: a version without eval numbers, numbers on an unverified checkpoint or of another
setting than the version serves, a rankings file that `dvc.lock`'s evaluate did not
write, or examples that are not the ones evaluate ranked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from flows.decoder_setting import UNVERIFIED, DecoderSetting
from flows.dvc_stages import lock_entry
from tasks.results import file_md5

RANKINGS = Path("reports/rankings.parquet")  # tasks.evaluate.RANKINGS (not imported: it pulls torch and the models)


class ServeCheckError(Exception):
    """The check cannot be made; the message says why (nothing was served)."""


@dataclass
class ServeCheck:
    """The outcome: how many of the `examples` served rankings equal the evaluate row's, and the first that do not."""

    model: str
    version: str
    row: str
    split: str
    setting: str
    examples: int
    equal: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)  # the first few: example, user_id, evaluated, served

    @property
    def passed(self) -> bool:
        return self.equal == self.examples

    def text(self) -> str:
        head = (
            f"{self.model} (version {self.version}, {self.setting}) against evaluate row {self.row!r} on the first "
            f"{self.examples} {self.split} lists: {self.equal} of {self.examples} rankings equal"
        )
        lines = [head + (" - PASSED" if self.passed else " - FAILED")]
        for m in self.mismatches:
            lines.append(f"  example {m['example']} (user {m['user_id']}): evaluated {m['evaluated']}, served {m['served']}")
        return "\n".join(lines)


def version_row(tags: Mapping[str, str]) -> tuple[str, str]:
    """(the evaluate row, the setting label) a version's eval tags were measured on; ServeCheckError
    when the version has no eval numbers, unverified ones, or ones of another setting than it serves."""
    row = tags.get("eval.model")
    if not row:
        why = tags.get("eval.not_attached", "no evaluate numbers were attached to it (`gr2 promote` attaches them)")
        raise ServeCheckError(f"the version carries no eval.* numbers: {why}")
    if tags.get("eval.checkpoint_md5") in (None, UNVERIFIED):
        raise ServeCheckError(f"its eval numbers are {UNVERIFIED}: dvc.lock could not tie them to the version's checkpoint")
    if tags.get("checkpoint_md5") and tags["eval.checkpoint_md5"] != tags["checkpoint_md5"]:
        raise ServeCheckError(f"its eval numbers were measured on checkpoint {tags['eval.checkpoint_md5']}, the version is {tags['checkpoint_md5']}")
    served_setting = DecoderSetting.from_tags(tags)
    label = tags.get("eval.setting", "")
    if served_setting is not None and served_setting.label() != label:
        raise ServeCheckError(f"its eval numbers were decoded with {label or 'an unrecorded setting'}; it serves {served_setting.label()}")
    return row, label


def check_rankings_file(root: Path) -> Path:
    """The rankings file, when it is the one `dvc.lock`'s evaluate stage wrote (or no lock records it)."""
    path = root / RANKINGS
    if not path.exists():
        raise ServeCheckError(f"{path}: no such file; run `gr2 run --stage evaluate` (it writes every row's rankings)")
    recorded = lock_entry(root, "evaluate")["outs"].get(RANKINGS.as_posix())
    if recorded is not None and recorded != file_md5(path):
        raise ServeCheckError(f"{path} is not the file dvc.lock's evaluate wrote (md5 {recorded}): the workspace changed since")
    return path


def evaluated_rankings(rankings: pl.DataFrame, row: str, split: str, n: int, user_ids: Sequence[int]) -> list[list[int]]:
    """Row `row`'s rankings of the first `n` examples of `split`, in order, checked to be the same examples
    (`user_ids`, the lists about to be served)."""
    part = rankings.filter((pl.col("row") == row) & (pl.col("split") == split)).sort("example").head(n)
    if part.height < n:
        have = sorted(set(rankings["row"].to_list())) if rankings.height else []
        raise ServeCheckError(f"{RANKINGS} has {part.height} {split} rankings of row {row!r}, {n} asked for (rows there: {have})")
    if part["user_id"].to_list() != [int(u) for u in user_ids[:n]]:
        raise ServeCheckError(f"the first {n} {split} lists are not the examples evaluate ranked (their users differ): rerun evaluate")
    return [list(r) for r in part["ranking"].to_list()]


def differences(evaluated: Sequence[Sequence[int]], served_rankings: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the lists whose served ranking differs from the evaluated one (a missing answer differs)."""
    return [i for i, want in enumerate(evaluated) if i >= len(served_rankings) or list(served_rankings[i]) != list(want)]


def _predict(url: str, rows: list[dict[str, Any]], max_new_tokens: int, timeout_s: float = 600.0) -> list[list[int]]:
    from flows.bench_serve import send  # imports the registry (MLflow): only once something is served

    body = json.dumps({"dataframe_records": rows, "params": {"max_new_tokens": max_new_tokens}}).encode()
    status, answer, _ = send(f"{url}/invocations", body, timeout_s)
    if status != 200:
        raise ServeCheckError(f"the server answered {status or 'nothing'}: {answer.decode(errors='replace')[:500]}")
    return [[int(i) for i in p["ranking"]] for p in json.loads(answer)["predictions"]]


def serve_check(
    root: Path, model: str, *, split: str = "test", examples: int = 64, batch: int = 16, max_shown: int = 5, log_path: Path | None = None
) -> ServeCheck:
    """Serve `model` (`NAME@ALIAS` or `NAME/VERSION`) from the workspace's registry and compare its rankings of the
    first `examples` lists of `split` with those of the evaluate row its eval tags came from (module docstring).

    Raises ServeCheckError before serving anything when the comparison would not be sound."""
    import mlflow
    from mlflow import MlflowClient

    from flows.bench_serve import served
    from gr2model.eval.rerank_eval import rerank_examples
    from tasks.common import load_stage_config
    from tasks.evaluate import EvaluateConfig
    from tasks.traces import load_lists

    name, sep, ref = model.partition("@")
    if not sep:
        name, sep, ref = model.partition("/")
    if not sep or not name or not ref:
        raise ServeCheckError(f"{model!r}: expected NAME@ALIAS or NAME/VERSION, e.g. gr2@champion")
    client = MlflowClient()
    try:
        mv = client.get_model_version_by_alias(name, ref) if "@" in model else client.get_model_version(name, ref)
    except mlflow.exceptions.MlflowException as exc:
        raise ServeCheckError(f"{model}: {exc.message}") from None
    row, label = version_row(mv.tags)
    max_new_tokens = load_stage_config("evaluate", EvaluateConfig, root / "params.yaml").max_new_tokens
    lists = rerank_examples(load_lists(root, split)).head(examples)
    if lists.height < examples:
        raise ServeCheckError(f"{split} has {lists.height} re-ranking lists, {examples} asked for")
    want = evaluated_rankings(pl.read_parquet(check_rankings_file(root)), row, split, examples, lists["user_id"].to_list())
    keys = ["history", "candidates"] + (["evidence"] if "evidence" in lists.columns else [])
    rows = lists.select(keys).to_dicts()
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}"))
    got: list[list[int]] = []
    with served(local, log_path) as (url, _):
        for start in range(0, len(rows), batch):
            got += _predict(url, rows[start : start + batch], max_new_tokens)
            print(f"served {len(got)}/{len(rows)} lists", flush=True)
    out = ServeCheck(model, str(mv.version), row, split, label, examples)
    bad = differences(want, got)
    out.equal = examples - len(bad)
    user_ids = lists["user_id"].to_list()
    out.mismatches = [{"example": i, "user_id": user_ids[i], "evaluated": want[i], "served": got[i] if i < len(got) else None} for i in bad[:max_shown]]
    return out
