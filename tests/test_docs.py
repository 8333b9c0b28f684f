"""The documentation holds together: log links resolve, the README stays a short manual whose
commands exist, and the experiment log keeps its order.

Fast on purpose: no Prefect API, no MLflow import, no pipeline run. The README's commands are
checked against the real argument parser, and only the cheap ones (`--help`) are executed.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LOG = ROOT / "docs" / "LOG.md"
README_MAX_LINES = 300

# README commands that are not run here, each with the reason. A new README command must
# either be cheap (`--help`, run below) or be named here: nothing is skipped by accident.
EXPENSIVE: dict[tuple[str, ...], str] = {
    ("./setup.sh",): "creates the venv and installs the stack",
    (".venv/bin/python", "-m", "pytest"): "the test suite itself",
    ("gr2", "run"): "runs the pipeline",
    ("gr2", "workspace"): "copies the project",
    ("gr2", "data", "download"): "needs the network",
    ("gr2", "status"): "reads a workspace made by the commands before it",
    ("gr2", "results"): "reads a workspace made by the commands before it",
    ("gr2", "report"): "reads a workspace made by the commands before it",
    (".venv/bin/python", "experiments/seeds.py"): "trains sft and ar_rl per seed on a workspace",
    (".venv/bin/python", "experiments/eval_checkpoint.py"): "decodes every example of a workspace",
    ("gr2", "serve-check"): "serves a registered version of a workspace made by the commands before it",
}


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lowercase, punctuation dropped (letters, digits,
    `_`, `-` and spaces kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The `#` headings of a markdown file, outside fenced code blocks."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.append(m.group(1))
    return out


def anchors(path: Path) -> set[str]:
    """Every anchor a file offers, duplicates numbered as GitHub does (`x`, `x-1`, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for h in headings(path):
        a = github_anchor(h)
        found.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return found


def doc_files() -> list[Path]:
    return [README, ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_anchor_rule() -> None:
    assert github_anchor("2026-12-06 OPD rollouts at temperature 0.7") == "2026-12-06-opd-rollouts-at-temperature-07"
    assert github_anchor("2026-12-06 Each model's own validity without the grammar") == "2026-12-06-each-models-own-validity-without-the-grammar"
    assert github_anchor("The `evaluate` stage: a, b") == "the-evaluate-stage-a-b"


def test_every_log_link_resolves() -> None:
    """Each `docs/LOG.md#anchor` (or `LOG.md#`, `#` inside the log) names a heading of the log."""
    log_anchors = anchors(LOG)
    missing = []
    for path in [ROOT / "params.yaml", *doc_files()]:
        text = path.read_text()
        links = re.findall(r"LOG\.md#([\w-]+)", text)
        if path == LOG:
            links += re.findall(r"\]\(#([\w-]+)\)", text)
        missing += [f"{path.relative_to(ROOT)}: #{a}" for a in links if a not in log_anchors]
    assert not missing, "links to docs/LOG.md headings that do not exist:\n" + "\n".join(missing)


def test_relative_markdown_links_resolve() -> None:
    """Links between the project's documents point at files (and headings) that exist."""
    broken = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve()
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_params_comments_name_documents_that_exist() -> None:
    text = (ROOT / "params.yaml").read_text()
    readme_sections = set(headings(README))
    for section in re.findall(r'README "([^"]+)"', text):
        assert section in readme_sections, f'params.yaml cites README "{section}", which is not a README heading'
    for doc in re.findall(r"(docs/[\w.-]+\.md)", text):
        assert (ROOT / doc).is_file(), f"params.yaml cites {doc}, which does not exist"
    # `docs/x.md "A heading" and "Another"`: each quoted section is a heading of that document.
    for doc, quoted in re.findall(r'(docs/[\w.-]+\.md)((?: "[^"]+"(?: \([^)]*\))?(?: and)?)+)', text):
        for section in re.findall(r'"([^"]+)"', quoted):
            assert section in headings(ROOT / doc), f'params.yaml cites {doc} "{section}", which is not a heading there'


def test_log_is_newest_first_with_dated_unique_entries() -> None:
    entries = [line[3:] for line in LOG.read_text().splitlines() if line.startswith("## ")]
    assert entries, "docs/LOG.md has entries"
    undated = [e for e in entries if not re.match(r"\d{4}-\d{2}-\d{2} \S", e)]
    assert not undated, f"every entry heading starts with its date and a title: {undated}"
    dates = [e[:10] for e in entries]
    assert dates == sorted(dates, reverse=True), "docs/LOG.md is newest first"
    assert len(set(entries)) == len(entries), "entry titles are unique (stable anchors)"


def test_readme_is_a_short_manual() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (details belong in docs/)"


def readme_commands() -> list[list[str]]:
    """The commands of the README's ```bash blocks, as argv lists (continuations joined,
    `&&` chains split, comments dropped)."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1 :]
    return [c for c in commands if c]


def _gr2_args(argv: list[str]) -> list[str] | None:
    """The arguments after the `gr2` program, or None for another program."""
    return argv[1:] if Path(argv[0]).name == "gr2" else None


def _key(argv: list[str]) -> tuple[str, ...]:
    """The command with its global options dropped: (`gr2`, subcommand words...) or the argv itself."""
    args = _gr2_args(argv)
    if args is None:
        return tuple(argv)
    words, i = [], 0
    while i < len(args):
        if args[i] == "--root":
            i += 2
            continue
        if args[i].startswith("-"):
            break
        words.append(args[i])
        i += 1
    return ("gr2", *words)


def _expensive(argv: list[str]) -> str | None:
    key = _key(argv)
    return next((why for prefix, why in EXPENSIVE.items() if key[: len(prefix)] == prefix), None)


def test_readme_shows_the_main_commands() -> None:
    keys = {_key(c)[:2] for c in readme_commands()}
    assert {("./setup.sh",), ("gr2", "run"), ("gr2", "results")} <= keys


def test_every_readme_gr2_command_parses() -> None:
    """Each `gr2 ...` of the README is accepted by the real parser (the subcommand and its flags exist)."""
    parser = build_parser()
    for argv in readme_commands():
        args = _gr2_args(argv)
        if args is None or "--help" in args:
            continue
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"README command does not parse: {shlex.join(argv)} (exit {exc.code})")


def test_every_readme_command_is_cheap_or_named_expensive() -> None:
    unclassified = [shlex.join(c) for c in readme_commands() if "--help" not in c and _expensive(c) is None]
    assert not unclassified, "README commands neither cheap (--help) nor in EXPENSIVE:\n" + "\n".join(unclassified)


@pytest.mark.integration  # runs every cheap README command, each a gr2 process
def test_cheap_readme_commands_run() -> None:
    """The `--help` commands run as written and exit 0 (from the venv's gr2 when it is there)."""
    cheap = [c for c in readme_commands() if "--help" in c]
    assert cheap, "the README shows how to get help"
    for argv in cheap:
        args = _gr2_args(argv)
        assert args is not None, f"only gr2 commands are run here: {shlex.join(argv)}"
        exe = [str(ROOT / argv[0])] if (ROOT / argv[0]).is_file() else [sys.executable, "-m", "flows.cli"]
        done = subprocess.run([*exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "usage: gr2" in done.stdout, f"{shlex.join(argv)}: exit {done.returncode}\n{done.stderr[-2000:]}"
