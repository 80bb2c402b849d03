"""The viewer in a real browser: headless Chromium, offline, from ``file://``, driven by Playwright.

Chromium is Debian's package (``apt-get install -y chromium``; ``.ci/run``
installs it), started by Playwright with ``executable_path`` (Playwright's
own browser download is never used) and the flags that work on a machine
without internet; Playwright gives every launch a new, empty profile
directory.  The page runs in an offline context and may load nothing but
its own file.  Each test steps through the page with the keys, the buttons
and the slider, compares what the DOM shows (page owners, the radix tree,
page tables, the text so far) with the recorded snapshots, and keeps a
screenshot under ``artifacts/viz/``.

These tests never skip in CI (``CI`` set): a missing Chromium or Playwright
fails them.  Elsewhere ``MECHSERVE_SKIP_BROWSER=1`` skips them, explicitly;
without it they fail and say how to install Chromium.
``MECHSERVE_CHROMIUM`` names another Chromium binary.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mechserve.viz.snapshot import CACHE, Snapshot
from mechserve.viz.trace import Trace, read_trace

from .conftest import Cli

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "viz"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SKIP_ENV = "MECHSERVE_SKIP_BROWSER"
INSTALL = "install it with 'apt-get install -y chromium' (Debian), or name a binary in MECHSERVE_CHROMIUM"


def chromium_path() -> str | None:
    """The Chromium binary to drive: ``MECHSERVE_CHROMIUM``, else ``chromium`` on the PATH, else None."""
    named = os.environ.get("MECHSERVE_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module; fails (never skips) when it cannot start, unless opted out."""
    if os.environ.get(SKIP_ENV) == "1" and not os.environ.get("CI"):
        pytest.skip(f"{SKIP_ENV}=1: the viewer's browser tests were asked to skip")
    path = chromium_path()
    if path is None:
        pytest.fail(f"Chromium is not installed: {INSTALL} (outside CI, {SKIP_ENV}=1 skips these tests)")
    try:
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        pytest.fail("the playwright package is missing: pip install -e '.[dev]'")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A page in a new offline context; the test fails on any script error or any request off ``file://``."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000}, offline=True)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    tab.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    tab.on("request", lambda req: None if req.url.startswith("file://") else errors.append(f"request: {req.url}"))
    yield tab
    context.close()
    assert not errors, errors


def load(tab: Any, path: Path) -> None:
    tab.goto(path.as_uri())
    tab.wait_for_selector("body[data-ready='1']")


def shown_step(tab: Any) -> int:
    return int(tab.get_attribute("body", "data-step"))


def screenshot(tab: Any, name: str) -> Path:
    """Save a full-page screenshot as ``artifacts/viz/<name>`` (kept after the test) and return its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    tab.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def expected_owners(snap: Snapshot) -> list[list[str]]:
    return [
        ["free", "free"] if o is None else ["cache", "cache"] if o is CACHE else ["request", o]
        for o in snap.owners or ()
    ]


def check_step(tab: Any, trace: Trace, index: int) -> None:
    """The page shows step ``index`` of ``trace``: its label, fields, sentences, pool, tree and page tables."""
    record, snap = trace.records[index], trace.snapshots[index]
    assert shown_step(tab) == record["step"]
    assert tab.text_content("#step-label").startswith(f"step {record['step']} ")
    assert tab.eval_on_selector_all("#explain li", "els => els.map(e => e.textContent)") == record["explain"]
    fields = tab.eval_on_selector_all("#fields dt", "els => els.map(e => e.textContent)")
    assert fields == [k for k, v in record.items() if k not in ("step", "explain") and v]
    owners = tab.eval_on_selector_all("#pool .page", "els => els.map(e => [e.dataset.kind, e.dataset.owner])")
    assert owners == expected_owners(snap)
    nodes = tab.eval_on_selector_all(
        "#tree li.tree-node",
        "els => els.map(e => [Number(e.dataset.page), e.parentElement.closest('li.tree-node')?.dataset.page ?? null])",
    )
    assert nodes == [[n.page, None if n.parent < 0 else str(snap.tree[n.parent].page)] for n in snap.tree]
    tables = tab.eval_on_selector_all(
        "#tables .ptable",
        "els => els.map(e => [e.dataset.request, [...e.querySelectorAll('.chip')].map(c => Number(c.dataset.page))])",
    )
    assert tables == [[rid, list(view.page_table)] for rid, view in snap.requests.items()]


def test_the_demo_viewer_steps_forward_and_back(cli: Cli, page: Any, tmp_path: Path) -> None:
    doc, html = tmp_path / "demo.json", tmp_path / "demo.html"
    assert cli("demo", "--viz", str(doc)).code == 0
    assert cli("demo", "--viz", str(html)).code == 0
    trace = read_trace(str(doc))
    load(page, html)
    check_step(page, trace, 0)
    assert page.get_attribute("#pool .page[data-page='0']", "data-kind") == "cache", "r0 published its first block"
    for index in range(1, len(trace.records)):
        page.keyboard.press("ArrowRight")
        check_step(page, trace, index)
    page.keyboard.press("ArrowRight")
    check_step(page, trace, len(trace.records) - 1)  # the last step stays
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    check_step(page, trace, 3)
    page.eval_on_selector("#slider", "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", "2")
    check_step(page, trace, 2)
    assert page.get_attribute("#pool .page[data-page='6']", "data-owner") == "r2"
    page.click("#next")
    check_step(page, trace, 3)
    assert page.eval_on_selector_all("#tree li.tree-node", "els => els.length") == 4
    assert "new-node" in page.get_attribute("#tree li.tree-node[data-page='6']", "class"), "published in step 3"
    page.keyboard.press("Home")
    check_step(page, trace, 0)
    page.keyboard.press("End")
    check_step(page, trace, 5)
    page.keyboard.press("h")
    check_step(page, trace, 4)
    assert "rolled_back" in page.eval_on_selector_all("#fields dt", "els => els.map(e => e.textContent)")
    path = screenshot(page, "viewer-demo.png")
    assert path.is_file()


def test_a_json_trace_says_which_panels_it_cannot_fill(cli: Cli, page: Any, tmp_path: Path) -> None:
    html = tmp_path / "plain.html"
    lines = cli("demo", "--json").out
    assert cli("viz", "-", "--html", str(html), stdin=lines).code == 0
    load(page, html)
    for panel in ("#pool", "#tree", "#tables"):
        assert "Not in this trace: a --json trace holds the steps, not the page pool" in page.text_content(panel)
    page.keyboard.press("ArrowRight")
    assert shown_step(page) == 1
    assert page.eval_on_selector_all("#fields dt", "els => els.map(e => e.textContent)")[:2] == [
        "admitted",
        "scheduled",
    ]
    assert "run with --explain" in page.text_content("#explain")
    assert "4 token id(s): 2413 55285 50870 47087" in page.text_content("#text .out[data-request='r0']")
    screenshot(page, "viewer-json-trace.png")


def test_a_real_model_trace_shows_the_text_growing(cli: Cli, page: Any, tiny_model: Path, tmp_path: Path) -> None:
    doc, html = tmp_path / "real.json", tmp_path / "real.html"
    flags = ["--backend", "torch", "--model", str(tiny_model), "--page-size", "4", "--num-pages", "16"]
    result = cli("run", *flags, "--request", "a:9:6", "--request", "b:5:8:1", "--viz", str(doc))
    assert result.code == 0, result.err
    assert cli("viz", str(doc), "--html", str(html)).code == 0
    trace = read_trace(str(doc))
    assert trace.source == "model" and set(trace.prompts) == {"a", "b"}
    load(page, html)
    seen: dict[str, list[str]] = {"a": [], "b": []}
    for index, snap in enumerate(trace.snapshots):
        if index:
            page.keyboard.press("ArrowRight")
        check_step(page, trace, index)
        for rid in seen:
            selector = f"#text .out[data-request='{rid}'] .generated"
            shown = page.text_content(selector) if page.query_selector(selector) else ""
            assert shown == (snap.text or {}).get(rid, "")
            seen[rid].append(shown)
            if shown:
                assert page.text_content(f"#text .out[data-request='{rid}'] .prompt") == trace.prompts[rid]
    final = {out["request_id"]: out["text"] for out in trace.outputs}
    for rid, texts in seen.items():
        grown = [t for i, t in enumerate(texts) if t and (i == 0 or t != texts[i - 1])]  # each change once
        assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(grown)), texts
        assert len(grown) >= 6 and grown[-1] == final[rid], "the viewer ends on the text the run printed"
    page.keyboard.press("Home")
    page.keyboard.press("l")
    page.keyboard.press("l")
    page.keyboard.press("l")
    check_step(page, trace, 3)
    screenshot(page, "viewer-real-model.png")
