"""The static pictures: PNG and SVG files of a sane size, the same bytes every time, fast for 200 requests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from mechserve.viz.plot import DPI, figure, write_plot
from mechserve.viz.trace import Trace, parse_trace

from .conftest import record


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_demo_picture_is_written_as_png_and_svg(demo_trace: Trace, tmp_path: Path) -> None:
    png, svg = tmp_path / "demo.png", tmp_path / "demo.svg"
    write_plot(demo_trace, png)
    write_plot(demo_trace, svg)
    width, height = png_size(png)
    assert 800 <= width <= 1400 and 400 <= height <= 1200
    assert 10_000 < png.stat().st_size < 400_000
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and 10_000 < len(text) < 2_000_000


def test_the_demo_picture_has_a_timeline_and_a_page_map(demo_trace: Trace) -> None:
    fig = figure(demo_trace)
    timeline, pages = fig.axes
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["r0", "r1", "r2"]
    assert len(pages.get_yticklabels()) == 8 and pages.get_ylabel().startswith("page")
    legend = {t.get_text() for t in pages.get_legend().get_texts()}
    assert {"free", "cache (published block)", "r2's page"} <= legend


def test_the_same_trace_gives_the_same_bytes(demo_trace: Trace, tmp_path: Path) -> None:
    write_plot(demo_trace, tmp_path / "a.png")
    write_plot(demo_trace, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_two_hundred_requests_render_as_images_at_a_bounded_size(
    big_trace: Trace, demo_trace: Trace, tmp_path: Path
) -> None:
    """Both panels are one image each, not one shape per cell: what keeps 200 requests over hundreds of steps
    fast to draw (measured, not asserted: about a second). The artists do not grow with the cells."""
    big, small = figure(big_trace), figure(demo_trace)
    assert [len(ax.images) for ax in big.axes] == [1, 1]

    def shapes(fig: Figure) -> int:
        return sum(len(ax.patches) + len(ax.collections) + len(ax.lines) for ax in fig.axes)

    cells = lambda t: len(t.records) * (len(t.summary or ()) + (t.snapshots[0].num_pages if t.snapshots else 0))  # noqa: E731
    assert cells(big_trace) > 50 * cells(demo_trace)
    assert shapes(big) <= shapes(small) + 20, (shapes(big), shapes(small))
    write_plot(big_trace, tmp_path / "big.png")
    write_plot(big_trace, tmp_path / "big.svg")
    width, height = png_size(tmp_path / "big.png")
    assert width <= 16 * DPI + 10 and height <= 20 * DPI
    assert (tmp_path / "big.svg").stat().st_size < 5_000_000
    timeline = figure(big_trace).axes[0]
    labels = timeline.get_yticklabels()
    assert 20 <= len(labels) <= 45, "about forty row labels, not two hundred"


def test_a_json_trace_gets_the_timeline_and_a_note(demo_trace: Trace, tmp_path: Path) -> None:
    plain = parse_trace("\n".join(json.dumps(r) for r in demo_trace.records))
    fig = figure(plain)
    assert len(fig.axes) == 1
    assert "No page map: a --json trace holds the steps" in fig.get_suptitle()
    write_plot(plain, tmp_path / "plain.png")
    assert png_size(tmp_path / "plain.png")[0] > 0


def test_a_rung_without_pages_gets_the_timeline_alone() -> None:
    workload = {"engine": {}, "requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 2}]}
    fig = figure(record(workload, "m01"))
    assert len(fig.axes) == 1 and "this rung has no page pool" in fig.get_suptitle()


def test_evictions_are_marked_on_the_page_map(big_trace: Trace) -> None:
    pages = figure(big_trace).axes[1]
    legend = {t.get_text() for t in pages.get_legend().get_texts()}
    assert "evicted in this step" in legend


@pytest.mark.parametrize("name", ["out.gif", "out"])
def test_an_unknown_picture_format_is_refused(demo_trace: Trace, tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="a picture must be one of"):
        write_plot(demo_trace, tmp_path / name)
