"""``mechserve viz`` and the ``--viz`` / ``--plot`` flags of demo and run: files written, output unchanged, one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mechserve.viz.html import render_html
from mechserve.viz.trace import Trace, read_trace

from .conftest import Cli, example


def assert_one_error_line(result, words: str) -> None:
    assert result.code == 2
    lines = result.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mechserve: error: "), result.err
    assert words in lines[0], lines[0]


def test_demo_writes_the_viewer_and_the_picture_and_prints_the_same(cli: Cli, tmp_path: Path) -> None:
    html, png = tmp_path / "demo.html", tmp_path / "demo.png"
    plain = cli("demo")
    drawn = cli("demo", "--viz", str(html), "--plot", str(png))
    assert drawn.code == 0 and drawn.out == plain.out
    assert drawn.err.splitlines() == [
        f"wrote {html}: the interactive viewer",
        f"wrote {png}: the timeline and page map",
    ]
    assert html.read_text().startswith("<!doctype html>") and png.read_bytes()[:4] == b"\x89PNG"


def test_a_json_run_keeps_stdout_pure_and_writes_the_trace_document(cli: Cli, tmp_path: Path) -> None:
    doc = tmp_path / "trace.json"
    result = cli("demo", "--json", "--viz", str(doc))
    assert result.out == cli("demo", "--json").out
    trace = read_trace(str(doc))
    assert trace.snapshots is not None and len(trace.snapshots) == 6 and trace.summary[2]["request_id"] == "r2"


def test_viz_draws_a_trace_document_and_a_json_trace(cli: Cli, tmp_path: Path) -> None:
    doc = tmp_path / "trace.json"
    cli("demo", "--viz", str(doc))
    out = {name: tmp_path / name for name in ("a.html", "a.png", "a.svg")}
    result = cli("viz", str(doc), "--html", str(out["a.html"]), "--png", str(out["a.png"]), "--svg", str(out["a.svg"]))
    assert result.code == 0 and all(path.stat().st_size > 1000 for path in out.values())
    lines = cli("demo", "--json", "--explain").out
    result = cli("viz", "-", "--html", str(tmp_path / "b.html"), "--png", str(tmp_path / "b.png"), stdin=lines)
    assert result.code == 0
    assert "the timeline (the trace has no pool)" in result.err
    assert "holds the steps, not the page pool" in (tmp_path / "b.html").read_text()


def test_run_writes_the_steps_of_a_failed_run_before_the_error(cli: Cli, spec_path, tmp_path: Path) -> None:
    doc = tmp_path / "failed.json"
    result = cli("run", "--spec", spec_path(example("07")), "--mech", "m11", "--viz", str(doc))
    assert result.code == 2
    assert result.err.splitlines() == [
        f"wrote {doc}: the trace document",
        "mechserve: error: Irreducible during step 2: big needs 5 page(s) but the pool has 4",
    ]
    trace = read_trace(str(doc))
    assert [r["step"] for r in trace.records] == [0, 1] and trace.summary is None


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("viz", "missing.json", "--html", "x.html"), "cannot read trace missing.json"),
        (("viz", "{trace}"), "nothing to write"),
        (("viz", "{garbage}", "--png", "x.png"), "line 1: not JSON"),
        (("viz", "{trace}", "--html", "/no/such/dir/x.html"), "cannot write /no/such/dir/x.html"),
        (("demo", "--viz", "out.txt"), "--viz out.txt: the file must end in .html"),
        (("demo", "--plot", "out.gif"), "--plot out.gif: the file must end in .png, .svg or .pdf"),
        (("run", "--request", "a:4:2", "--plot", "out.jpg"), "--plot out.jpg"),
        (("viz",), "the following arguments are required: TRACE"),
        # A new user's trial: PNG bytes were written under x.jpg, SVG under x.png.
        (("viz", "{trace}", "--png", "x.jpg"), "--png x.jpg: the file must end in .png"),
        (("viz", "{trace}", "--svg", "x.png"), "--svg x.png: the file must end in .svg"),
        (("viz", "{trace}", "--html", "x.txt"), "--html x.txt: the file must end in .html"),
    ],
)
def test_problems_are_one_error_line(cli: Cli, tmp_path: Path, argv: tuple[str, ...], words: str) -> None:
    trace, garbage = tmp_path / "t.json", tmp_path / "garbage.txt"
    trace.write_text(cli("demo", "--json").out)
    garbage.write_text("not a trace\n")
    argv = tuple(a.format(trace=trace, garbage=garbage) for a in argv)
    assert_one_error_line(cli(*argv), words)


def test_the_viewer_is_self_contained(demo_trace: Trace) -> None:
    page = render_html(demo_trace)
    assert not re.search(r"\b(src|href)\s*=", page), "no external resource of any kind"
    assert "http://" not in page and "https://" not in page
    data = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S)
    assert data is not None
    doc = json.loads(data.group(1))
    assert doc["requests"] == ["r0", "r1", "r2"] and len(doc["snapshots"]) == 6 and doc["timeline"]["cells"]


def test_a_prompt_cannot_close_the_data_script(tmp_path: Path) -> None:
    trace = Trace(
        records=[{"step": 0, "admitted": ["x"], "explain": ["</script><script>alert(1)</script>"]}],
        prompts={"x": "</script>"},
        title="<b>t</b>",
    )
    page = render_html(trace)
    assert page.count("</script>") == 2, "only the two real script ends"
    assert "<title>&lt;b&gt;t&lt;/b&gt;</title>" in page


def test_generate_writes_a_real_model_trace_and_keeps_json_pure(cli: Cli, tiny_model: Path, tmp_path: Path) -> None:
    doc = tmp_path / "gen.json"
    argv = ["generate", "w1 w2 w3 w4 w5", "--model", str(tiny_model), "--max-tokens", "6", "--page-size", "4"]
    plain = cli(*argv, "--json")
    drawn = cli(*argv, "--json", "--viz", str(doc))
    assert drawn.code == 0 and drawn.out == plain.out and drawn.err == f"wrote {doc}: the trace document\n"
    trace = read_trace(str(doc))
    final = json.loads(plain.out.splitlines()[-1])["outputs"][0]["text"]
    assert trace.source == "model" and trace.prompts == {"r0": "w1 w2 w3 w4 w5"}
    assert trace.snapshots[-1].text == {"r0": final} and trace.outputs[0]["text"] == final
    assert [len(s.text["r0"]) for s in trace.snapshots] == sorted(len(s.text["r0"]) for s in trace.snapshots)
