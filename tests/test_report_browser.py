"""reports/index.html as a browser shows it: headless Chromium, network off, from disk.

Chromium is Debian's `chromium` package, which ./setup.sh installs. Without it
these tests skip and say why, except under CI (CI=true), where a missing browser
is a failure: the set-up is meant to have installed it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Chromium, PageCheck, find_chromium
from test_report import EVALUATE, PREPARE, RETRIEVE, RL, SFT, SPEED, _workspace

from tasks.report import REPORT_HTML, load_inputs, write_report

SCREENSHOT = Path("reports/screenshot.png")


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    binary = find_chromium()
    if binary is None:
        why = "no Chromium on PATH (Debian package `chromium`; ./setup.sh installs it, or set GR2_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run the browser check")
        pytest.skip(why)
    browser = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield browser
    finally:
        browser.close()


def _assert_renders(check: PageCheck, n_images: int) -> None:
    assert check.title == "Diffusion-GR2 report"
    assert check.failed == []
    # Nothing is fetched but the page itself and its data: URI figures.
    assert all(url.startswith(("file:", "data:")) for url in check.requests), check.requests
    assert len(check.images) == n_images
    for img in check.images:
        assert img["complete"] and img["width"] > 100 and img["height"] > 100, img
    assert check.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(check.screenshot) > 20_000


def test_report_opens_offline_with_every_figure(tmp_path: Path, chromium: Chromium) -> None:
    root = _workspace(tmp_path, evaluate=EVALUATE, speed=SPEED, retrieve=RETRIEVE, prepare=PREPARE, sft=SFT, rl=RL)
    page = write_report(load_inputs(root, with_mlflow=False, with_registry=False))
    check = chromium.check(page)
    (root / SCREENSHOT).write_bytes(check.screenshot)
    _assert_renders(check, 5)  # ablation, speed at batch 1, curves of sft and rl, the pre-ranker's bars


def test_the_check_sees_broken_and_outside_loads(tmp_path: Path, chromium: Chromium) -> None:
    """The same check on a page that is not self-contained: it must notice (else the test above proves nothing)."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><head><title>bad</title></head><body>'
        '<img alt="missing" src="missing.png"><img alt="remote" src="http://example.invalid/x.png"></body></html>'
    )
    check = chromium.check(page)
    assert any("missing.png" in f for f in check.failed) and any("example.invalid" in f for f in check.failed)
    assert [i["width"] for i in check.images] == [0, 0]


@pytest.mark.integration
def test_smoke_run_report_opens_offline(smoke_run: dict, chromium: Chromium) -> None:
    ws = smoke_run["ws"]
    check = chromium.check(ws / REPORT_HTML)
    (ws / SCREENSHOT).write_bytes(check.screenshot)
    # ablation (valid, test), speed (one batch size at least), curves of every training stage, the pre-ranker
    assert len(check.images) >= 8
    _assert_renders(check, len(check.images))
