"""experiments/eval_checkpoint.py keeps each invalid answer with the check it failed."""

import json
from pathlib import Path

from experiments.eval_checkpoint import write_invalid
from gr2model.task.rerank_format import ParsedResponse


def _parsed(error: str) -> ParsedResponse:
    valid = not error
    return ParsedResponse(valid_format=valid or error == "duplicate", valid_permutation=valid, ranking=[1, 2], explanation="", error=error, copies_incoming=False)


def test_only_the_invalid_answers_are_written_with_their_example_and_error(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "ckpt.test.jsonl"
    write_invalid(out, [_parsed(""), _parsed("duplicate"), _parsed("not json")], ["ok", "dup text", "{ broken"], [7, 8, 9])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"example": 1, "user_id": 8, "error": "duplicate", "text": "dup text"},
        {"example": 2, "user_id": 9, "error": "not json", "text": "{ broken"},
    ]
