"""``mechs``, ``diff``, the text view, ``--explain``, ``generate`` and the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import DATA, assert_one_error_line, load_example

from mechserve.spec import RUNGS
from mechserve.workload import load_rung

ROOT = Path(__file__).resolve().parents[2]


def test_mechs_prints_one_aligned_line_per_rung(cli) -> None:
    result = cli("mechs")
    assert result.code == 0
    lines = result.lines
    assert len(lines) == len(RUNGS) == 17
    rungs = [load_rung(name) for name in RUNGS]
    note_width = max(len(r.NOTE) for r in rungs)
    title_width = max(len(r.TITLE) for r in rungs)
    for line, rung in zip(lines, rungs):
        assert line == f"{rung.NOTE.ljust(note_width)}  {rung.TITLE.ljust(title_width)}  {rung.KEY_QUESTION}"
        assert line[note_width : note_width + 2] == "  "
        assert not line.endswith(" ")
    assert lines[0].startswith("00-engine-loop.md")
    assert lines[11].startswith("11-parallelism.md")
    assert lines[12].startswith("12-admission-control.md")
    assert lines[13].startswith("13-output-caching.md")
    assert lines[14].startswith("14-forced-runs.md")


def test_diff_m04_m05_shows_preemption(cli) -> None:
    result = cli("diff", "m04", "m05")
    assert result.code == 0
    lines = result.lines
    assert lines[0] == "--- mechserve/spec/m04_chunked_prefill.py"
    assert lines[1] == "+++ mechserve/spec/m05_preemption.py"
    assert any(line.startswith("@@ ") for line in lines)
    added = [line for line in lines if line.startswith("+") and not line.startswith("+++")]
    assert any("class Irreducible" in line for line in added)
    assert any("preempt" in line for line in added)
    assert "\x1b[" not in result.out  # not a terminal: plain text


def test_diff_accepts_every_rung_spelling(cli) -> None:
    assert cli("diff", "4", "m05_preemption").out == cli("diff", "m04", "05").out


def test_diff_of_a_rung_with_itself_says_so(cli) -> None:
    for argv in (("diff", "m04", "m04"), ("diff", "m07", "7")):
        result = cli(*argv)
        assert result.code == 0 and result.err == ""
        assert len(result.lines) == 1
        assert "are the same rung" in result.out and "nothing to diff" in result.out


def test_diff_m11_m12_shows_admission_control(cli) -> None:
    added = [line for line in cli("diff", "m11", "m12").lines if line.startswith("+")]
    assert any("def add_request" in line for line in added)
    assert any("def abort" in line for line in added)
    # ... plus departure D9 (first come, first served): m11's list-order insertion gives way to arrival
    # and admission order
    removed = [line for line in cli("diff", "m11", "m12").lines if line.startswith("-")]
    assert any("bisect.insort(self.running, r, key=self._list_position)" in line for line in removed)
    assert any("self.running.append(r)  # m12 (D9): running requests in admission order" in line for line in added)
    assert any("self.due += sorted(arrived, key=self._list_position)" in line for line in added)


def test_diff_m12_m13_shows_exactly_output_caching(cli) -> None:
    """m13 is m12 plus one switch: every hunk is about output caching, and every line of m12's code that
    the diff removes comes back inside an ``if self.output_caching`` branch, except the rung's name and the
    sentences its explanations print."""
    lines = cli("diff", "m12", "m13").lines
    assert lines[:2] == ["--- mechserve/spec/m12_admission_control.py", "+++ mechserve/spec/m13_output_caching.py"]
    body = lines[lines.index('+"""m13 — Output caching.') :]
    added = [line[1:] for line in body if line.startswith("+")]
    removed = [line[1:] for line in body if line.startswith("-")]
    assert any("output_caching: bool = False" in line for line in added)
    assert any("def _block_keys" in line for line in added)
    assert sum("# m13" in line for line in added) >= 6
    code = removed[removed.index('TITLE = "Admission control"') :]
    back = {line.strip() for line in added}
    gone = [line.strip() for line in code if line.strip() not in back]
    assert gone == [
        'TITLE = "Admission control"',
        'KEY_QUESTION = "What may enter the engine, and how does a request leave before it finishes?"',
        'NOTE = "12-admission-control.md"',
        "scripted ``eos_after`` trigger still applies).",
        '"""The complete engine as of m12.',
        '"""Cold requests, in admission order (D9), adopt their longest cached prompt prefix; returns tokens reused."""',
        'f"{r.request_id} found {len(hit)} cached block(s) of its prompt and reused {usable} "',
        "A block whose key is already resident with another page is adopted:",
        "the request's table points at the resident page and its own copy is",
        "freed at once (departure D2).",
        'self._why.append(f"{r.request_id} published prompt block(s) on page(s) {own_pages} to the cache.")',
    ], gone
    hunks = "\n".join(lines).split("\n@@ ")[1:]
    assert all("m13" in hunk or "output" in hunk.lower() for hunk in hunks), hunks


def test_diff_m13_m14_shows_exactly_forced_runs(cli) -> None:
    """m14 is m13 plus an outcome field and one phase in sampling: every hunk is marked ``# m14`` or is
    about forcing, and the only lines of m13's code the diff removes are the rung's name, docstring lines
    that gained a sentence, the scripted executor's constructor and outcome (they take the forced
    scripts) and the EOS clamp (which forced ids may carry below 0)."""
    lines = cli("diff", "m13", "m14").lines
    assert lines[:2] == ["--- mechserve/spec/m13_output_caching.py", "+++ mechserve/spec/m14_forced_runs.py"]
    body = lines[lines.index('+"""m14 — Forced runs (jump-forward).') :]
    added = [line[1:] for line in body if line.startswith("+")]
    removed = [line[1:] for line in body if line.startswith("-")]
    assert any("forced: tuple[int, ...] = ()  # m14" in line for line in added)
    assert any("def _force" in line for line in added)
    assert sum("# m14" in line for line in added) >= 8
    code = removed[removed.index('TITLE = "Output caching"') :]
    back = {line.strip() for line in added}
    gone = [line.strip() for line in code if line.strip() not in back]
    assert gone == [
        'TITLE = "Output caching"',
        'KEY_QUESTION = "How does a conversation\'s next turn reuse the answer the engine has just generated?"',
        'NOTE = "13-output-caching.md"',
        "so far: the prompt's keys, then keys over appended ids.",
        '"""The record as a JSON-ready dict, trace fields in contract order."""',
        "returned where rule S says EOS (``eos_after``).",
        "def __init__(self, scripts: dict[str, list[int]], eos_after: dict[str, int]) -> None:",
        "return Outcome(item.request_id, item.start_position, item.num_tokens, accepted, item.placements, tuple(ids))",
        '"""The complete engine as of m13.',
        "a = min(a, r.eos_after - r.generated)  # the EOS clamp",
    ], gone
    hunks = "\n".join(lines).split("\n@@ ")[1:]
    assert all("m14" in hunk or "forced" in hunk.lower() for hunk in hunks), hunks


def test_diff_m14_m15_shows_exactly_routing(cli) -> None:
    """m15 is m14's engine plus KV events (a record field, the block hash, reset_prefix_cache) and,
    after the engine, the router and the fleet: every hunk is marked ``m15`` or is about events,
    hashes or routing, and the only lines of m14's code the diff removes are the rung's name and the
    engine's docstring lines that name the rung or gained a sentence, and the line that computed a
    request's keys (a routed request brings them)."""
    lines = cli("diff", "m14", "m15").lines
    assert lines[:2] == ["--- mechserve/spec/m14_forced_runs.py", "+++ mechserve/spec/m15_routing.py"]
    body = lines[lines.index('+"""m15 — Routing across replicas.') :]
    added = [line[1:] for line in body if line.startswith("+")]
    removed = [line[1:] for line in body if line.startswith("-")]
    assert any(line.startswith("def choose(") for line in added) and any(
        line.startswith("class Fleet") for line in added
    )
    assert sum("# m15" in line for line in added) >= 8
    code = removed[removed.index('TITLE = "Forced runs"') :]
    back = {line.strip() for line in added}
    gone = [line.strip() for line in code if line.strip() not in back]
    assert gone == [
        'TITLE = "Forced runs"',
        'KEY_QUESTION = "When the output\'s next tokens are already known, why compute them one per step?"',
        'NOTE = "14-forced-runs.md"',
        "appends.",
        '"""The complete engine as of m14.',
        "r.prompt_keys = prefix_keys(r.tokens, self.pool.page_size, self.namespace)",
    ], gone
    hunks = "\n".join(lines).split("\n@@ ")[1:]
    words = ("m15", "hash", "event", "route", "fleet", "replica", "BlockStored")
    assert all(any(w in hunk for w in words) for hunk in hunks), hunks


def test_diff_unknown_rung(cli) -> None:
    assert_one_error_line(cli("diff", "m04", "m42"), "unknown rung", "m05_preemption")


def test_text_view_names_values(cli) -> None:
    result = cli("demo")
    assert result.code == 0 and result.err == ""
    out = result.out
    assert "step 0" in out and "step 5" in out
    assert "TOKEN" in out and "LENGTH" in out
    assert "r0=6" in out
    assert "rolled_back  r2=2" in out
    for forbidden in ("Sample.", "FinishReason.", "RequestState.", "MappingProxy", "{", "'"):
        assert forbidden not in out
    assert all(not line.endswith(" ") for line in result.lines)


def test_text_view_shows_only_non_empty_fields(cli) -> None:
    result = cli("demo")
    step0 = result.out.split("step 1")[0]
    assert "executed" in step0 and "published" in step0
    assert "preempted" not in step0 and "evicted" not in step0 and "drafted" not in step0


def test_text_view_summary_table(cli) -> None:
    lines = cli("demo").lines
    header = lines.index(next(line for line in lines if line.startswith("request")))
    assert lines[header].split() == ["request", "state", "finish", "generated", "computed"]
    assert lines[header + 1].split() == ["r0", "FINISHED", "LENGTH", "4", "9"]
    assert lines[header + 3].split() == ["r2", "FINISHED", "LENGTH", "5", "14"]


def test_text_view_lists_pages_and_idle_steps(cli, spec_file) -> None:
    example = load_example(DATA / "examples" / "02-preemption-anchor.json")
    out = cli("run", "--spec", spec_file(example["workload"])).out
    assert "\n  evicted      5, 4\n" in out
    assert "\n  preempted    c, b\n" in out
    idle = cli("run", "--request", "late:2:1:2").out
    assert "\nsteps 0–1: nothing to do (waiting for arrivals)\nstep 2\n" in idle


def test_text_view_collapses_a_long_idle_gap(cli) -> None:
    text = cli("run", "--request", "a:2:1", "--request", "late:2:1:1000")
    assert text.code == 0, text.err
    assert "\nsteps 1–999: nothing to do (waiting for arrivals)\nstep 1000\n" in text.out
    assert len(text.lines) < 30
    single = cli("run", "--request", "a:2:1", "--request", "late:2:1:2").out
    assert "\nstep 1: nothing to do (waiting for arrivals)\nstep 2\n" in single
    as_json = cli("run", "--request", "a:2:1", "--request", "late:2:1:1000", "--json")
    assert [line["step"] for line in as_json.json_lines()[:-1]] == list(range(1001))  # the contract: every step


def test_text_view_idle_step_before_an_engine_error(cli) -> None:
    result = cli("run", "--mech", "m02", "--request", "big:9:1", "--request", "small:2:1")
    assert_one_error_line(result, "never fits after step 1")
    assert result.lines[-1] == "step 1: nothing could be scheduled for the running requests"


def test_text_view_shows_rejections_and_the_summary_state(cli, spec_file) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    result = cli("run", "--spec", spec_file(example["workload"]))
    assert result.code == 0, result.err
    assert "\n  rejected   big=NEVER_FITS\n" in result.out
    assert "[" not in result.out.split("rejected")[1].splitlines()[0]
    rows = {line.split()[0]: line for line in result.lines if line.startswith(("big ", "small "))}
    assert rows["big"].split() == ["big", "REJECTED", "(NEVER_FITS)", "-", "0", "0"]
    assert rows["small"].split() == ["small", "FINISHED", "LENGTH", "2", "4"]


def test_text_view_shows_aborts() -> None:
    import io

    from rich.console import Console

    from mechserve.cli.render import TextView
    from mechserve.spec import m12_admission_control as m12

    engine = m12.Engine([m12.Request("a", [1, 2, 3], 5), m12.Request("b", [4, 5], 5)], 8, 4, 8)
    out = io.StringIO()
    view = TextView(console=Console(file=out, width=100, highlight=False))
    view.step(engine.step())
    engine.abort("a")
    view.step(engine.step())
    view.finish(engine.summary())
    text = out.getvalue()
    assert ["aborted", "a"] in [line.split() for line in text.splitlines()]
    assert [line.split() for line in text.splitlines() if line.startswith("a ")] == [["a", "ABORTED", "-", "1", "3"]]


def test_help_names_the_ladder_from_rungs(cli) -> None:
    from mechserve.cli.main import build_parser

    for command in ("run", "demo"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
    for command in (["run", "--help"], ["demo", "--help"]):
        out = cli(*command).out
        assert f"m00 .. {RUNGS[-1][:3]}" in " ".join(out.split())
        assert "m00 .. m11 " not in out


def test_text_view_unfinished_request_has_no_finish_reason(cli, spec_file) -> None:
    example = load_example(DATA / "examples" / "07-error-irreducible.json")
    result = cli("run", "--spec", spec_file(example["workload"]), "--mech", "m11")
    assert_one_error_line(result, "Irreducible", "step 2")
    assert "step 1" in result.out and "step 2" not in result.out
    assert "request" not in result.out.splitlines()[-1]  # no summary after an error


def test_explain_prints_the_engines_sentences(cli) -> None:
    plain = cli("demo").out
    explained = cli("demo", "--explain").out
    assert "r0 arrived (arrival_step 0) and was admitted." in explained
    assert "rolled back" in explained
    assert "arrived" not in plain


def test_run_on_a_lower_rung(cli) -> None:
    result = cli("run", "--request", "a:3:2", "--request", "b:2:2", "--mech", "m00", "--json")
    assert result.code == 0
    first = result.json_lines()[0]
    assert list(first) == ["step", "admitted", "scheduled", "executed", "sampled", "finished"]
    assert first["executed"] == {"a": 3, "b": 2}


def test_demo_runs_on_rungs_without_speculation(cli) -> None:
    result = cli("demo", "--mech", "m05")
    assert result.code == 0
    assert "no speculative decoding" in result.out
    assert "drafted" not in result.out


def test_help_lists_every_command(cli) -> None:
    result = cli("--help")
    assert result.code == 0
    for command in ("mechs", "demo", "run", "diff", "generate"):
        assert command in result.out


def test_generate_without_its_module_is_one_error_line(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mechserve.cli.lazy.GENERATE_MODULE", "mechserve.cli.no_such_generate_module")
    assert_one_error_line(cli("generate", "--prompt", "hi"), "generate")


def test_generate_passes_its_arguments_to_the_module(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen = {}
    module = types.ModuleType("fake_generate")
    module.add_arguments = lambda parser: parser.add_argument("--prompt")  # type: ignore[attr-defined]

    def run(args) -> int:
        seen["prompt"] = args.prompt
        return 0

    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_generate", module)
    monkeypatch.setattr("mechserve.cli.lazy.GENERATE_MODULE", "fake_generate")
    assert cli("generate", "--prompt", "hello").code == 0
    assert seen == {"prompt": "hello"}
    assert_one_error_line(cli("generate", "--bogus"), "--bogus")


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, mechserve.cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_spec_commands_do_not_import_torch() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from mechserve.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    for argv in (['mechs'], ['demo'], ['demo', '--json'], ['run', '--request', 'a:3:2'], ['diff', 'm04', 'm05']):\n"
        "        assert main(argv) == 0, argv\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_diff_colours_by_line_kind() -> None:
    from mechserve.cli.diff import colour

    assert colour("+added").style == "green"
    assert colour("-removed").style == "red"
    assert colour("@@ -1,2 +1,3 @@").style == "cyan"
    assert colour("+++ b").style == colour("--- a").style == "bold"
    assert colour(" context").style == ""


def test_diff_is_coloured_on_a_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from mechserve.cli.main import main

    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(["diff", "m04", "m05"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[32m+" in out and "\x1b[31m-" in out and "\x1b[36m@@" in out


def test_console_script_demo_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mechserve", "demo", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    demo = load_example(DATA / "demo.json")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == len(demo["trace"]) + 1
    assert lines[-1] == {"summary": demo["summary"]}


@pytest.mark.skipif(not (Path(sys.executable).parent / "mechserve").exists(), reason="console script not installed")
def test_installed_console_script_demo_json() -> None:
    script = Path(sys.executable).parent / "mechserve"
    proc = subprocess.run([str(script), "demo", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["summary"][0]["request_id"] == "r0"


def test_console_script_error_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mechserve", "run", "--request", "a:0:1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mechserve: error: ")
    assert "Traceback" not in proc.stderr


def test_run_output_caching_flag(cli) -> None:
    """``--output-caching`` turns m13's switch on over any workload; a rung below m13 refuses it in one line;
    ``--no-output-caching`` is m12's trace (and allowed on every rung)."""
    on = cli("run", "--request", "a:6:9", "--output-caching", "--json")
    assert on.code == 0, on.err
    steps = on.json_lines()[:-1]
    assert sum(sum(step["published"].values()) for step in steps) == 3
    assert "output_caching on" in cli("run", "--request", "a:6:9", "--output-caching").lines[0]
    off = cli("run", "--request", "a:6:9", "--no-output-caching", "--json")
    assert off.out == cli("run", "--request", "a:6:9", "--json", "--mech", "m12").out
    assert sum(sum(step["published"].values()) for step in off.json_lines()[:-1]) == 1
    assert_one_error_line(
        cli("run", "--request", "a:6:9", "--output-caching", "--mech", "m12"), "m12 has no output caching"
    )
    assert cli("run", "--request", "a:6:9", "--no-output-caching", "--mech", "m05").code == 0
