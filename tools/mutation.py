"""Mutation testing of the modules whose bugs would hurt most, one module at a time (issues 20 and 31).

Each module runs mutmut 3 in its own scratch copy of the worktree (``build/mutation/<name>/``,
ignored by git) with a ``[tool.mutmut]`` table written for that module alone: ``only_mutate`` names
the one file and ``pytest_add_cli_args_test_selection`` the tests that own it, so a mutant of the
detokenizer never waits on the engine's suite.  Inside that selection mutmut's own trampolines map
each mutated function to the tests that call it, and each mutant runs only those (stopping at the
first failure).  One worker (``--max-children 1``): the machine is shared.

What keeps a mutant cheap without weakening the verdicts (``tools/mutation_plugin.py``, loaded in
every pytest run): the property tests try at most ``MAX_EXAMPLES`` examples each in the sweep
(derandomized), and a survivor is run again with the tests' own counts before it is reported; the
tests a mutant runs go fastest first.  A module may limit the sweep to some functions
(``Module.functions``: m15's router, whose engine is m14's) and may have mypy reject mutants
first (``Module.type_check``).

    python tools/mutation.py                       # every module, smallest first
    python tools/mutation.py verify detokenizer    # just these
    python tools/mutation.py m13 --sample 0.25     # a seeded quarter of m13's mutants (default: 0.1)
    python tools/mutation.py router --max-examples 0 --no-recheck   # the tests' own example counts
    python tools/mutation.py --list                # the modules and their tests

Each run writes ``build/mutation/<name>/summary.json`` (counts, the surviving mutants with their
diffs, mutmut's time per mutant and the load average sampled during the run); ``--report`` prints
the Markdown table docs/mutation.md starts from.  Reruns start from a fresh scratch copy (``--keep``
reuses mutmut's cache in it instead).  ``--collect`` summarises an interrupted run,
``--rerun-survivors`` runs the last run's survivors against today's tests.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "mutation"
MUTMUT = Path(sys.executable).with_name("mutmut")
PLUGIN = Path(__file__).with_name("mutation_plugin.py")
# Hypothesis examples per property test while the mutants are swept (derandomized; tools/mutation_plugin.py):
# most mutants die on the first examples, and a survivor is run again with the tests' own counts.
MAX_EXAMPLES = 10
LOAD_EVERY_S = 30
# mutmut workers (`--max-children`): 1 on a shared machine; `make mutation` gives every core (MUTATION_JOBS).
MAX_CHILDREN = 1


@dataclass(frozen=True)
class Module:
    """One module under mutation: its source file and the tests that own it (pytest arguments)."""

    name: str
    path: str
    tests: tuple[str, ...]
    # More pytest arguments for this module's runs (e.g. tests deselected: too slow for every mutant).
    pytest_args: tuple[str, ...] = ()
    # torch's thread pools are not fork-safe once started; those suites fork from a clean server.
    forkserver: bool = False
    # The fraction of the module's mutants `make mutation` runs (seeded); 1.0 (whole) for every module
    # issue 31 names, a tenth of m13 (the rung below the top one).
    sample: float = 1.0
    # Only the mutants of these functions run (mutmut's names without the module's dotted path and the
    # mutant number, as fnmatch patterns: "x_choose", "xǁRouterStateǁ*"); empty: every function.
    functions: tuple[str, ...] = ()
    # Hypothesis examples per property test in the sweep (tools/mutation_plugin.py; None: the tests' own).
    # Survivors are run again with the tests' own counts before they are reported.
    max_examples: int | None = MAX_EXAMPLES
    # mypy (the project's `make lint` settings) over the mutated file first: a mutant it rejects is
    # "caught by type check" (CI would refuse it) and runs no test.
    type_check: bool = False

    @property
    def dotted(self) -> str:
        """The module's import path (mutmut's prefix of every mutant name)."""
        return self.path.removesuffix(".py").replace("/", ".")

    def patterns(self) -> list[str]:
        """The mutant-name patterns ``mutmut run`` is limited to (none: every mutant)."""
        return [f"{self.dotted}.{f}__mutmut_*" for f in self.functions]

    def selects(self, mutant: str) -> bool:
        """Whether ``mutant`` (a full mutmut name) is one of this module's selected functions' mutants."""
        return not self.functions or any(fnmatch.fnmatchcase(mutant, p) for p in self.patterns())


FAST = ("-m", "not slow and not gpu", "-p", "no:cacheprovider", "-p", "mutation_plugin")

# The HTTP layer's translation and refusals, at the model level (no server: a served check per mutant would
# take minutes); the request-capturing server test and tests/http/test_fields.py's served walk run in the
# ordinary suite.
HTTP_MODEL_TESTS = (
    "tests/http/test_field_layer.py",
    "tests/http/test_fields.py::test_the_docs_are_the_table_rendered",
    "tests/http/test_fields.py::test_the_request_models_declare_exactly_the_honoured_fields",
    "tests/http/test_fields.py::test_every_row_is_complete_and_names_are_unique_per_endpoint",
)
# protocol.py's shared pieces (``_Body``, ``check_supported``, the limits) also serve the Responses and
# Anthropic request models, whose server-less tests are these.
# The unknown-key walk (``_Body.unknown_fields``, the tools' and tool_choice's keys) and the request models'
# refusals are checked server-less in tests/http/test_unknown_fields.py too; its served tests stay out.
UNKNOWN_FIELDS_MODEL_TESTS = tuple(
    f"tests/http/test_unknown_fields.py::{t}"
    for t in (
        "test_a_body_names_its_unknown_keys_with_the_closest_known_name",
        "test_a_body_of_known_keys_has_no_unknown_key",
        "test_the_tables_refused_rows_are_known_not_unknown",
        "test_every_key_of_the_official_sdks_body_parts_is_known",
        "test_an_assistant_messages_audio_is_refused",
        "test_include_obfuscation_is_refused_only_when_true",
        "test_an_ignored_tool_call_key_does_not_reach_the_template",
        "test_the_unknown_keys_of_function_tools_and_a_named_tool_choice_are_each_found",
    )
)
PROTOCOL_TESTS = (*HTTP_MODEL_TESTS, "tests/http/test_api_translation.py", *UNKNOWN_FIELDS_MODEL_TESTS)
HTTP_NO_SERVER = ("--deselect", "tests/http/test_field_layer.py::test_the_engine_receives_the_view")

# E1 on every plan item of m13 and m14 (parametrized by rung; docs/mutation.md, m13's `_plan` 30).
PLAN_KNOWN_IDS = (
    "tests/property/test_plan_known_ids.py::test_a_recomputed_prompt_chunk_knows_only_prompt_ids",
    "tests/property/test_plan_known_ids.py::test_every_plan_item_knows_exactly_its_known_ids",
)

# The explanation tells the truth (tests/property/test_explain.py; parametrized by rung, m13 and m14).
EXPLAIN = (
    "tests/property/test_explain.py::test_every_sentence_is_a_known_kind_and_states_what_the_step_did",
    "tests/property/test_explain.py::test_the_scenarios_say_every_kind_of_sentence",
)

# m14's own tests (its note and its properties) and the ladder-wide properties' cases for m14 (each is
# parametrized by rung; the other rungs' cases exercise other files).
M14_TESTS = (
    "tests/notes/test_m14_forced_runs.py",
    "tests/property/test_m14_properties.py",
    # the top rungs' edges, parametrized by rung (m13's run selects the whole file too; each rung's cases
    # call only their own file's functions, so mutmut maps them to that rung's mutants alone)
    "tests/property/test_m13_edges.py",
    *(f"{t}[m14_forced_runs]" for t in EXPLAIN),
    "tests/property/test_step_halves.py::test_schedule_execute_commit_is_step[m14_forced_runs]",
    "tests/property/test_step_halves.py::test_schedule_execute_commit_is_step_with_forced_runs",
    "tests/property/test_step_halves.py::test_a_stop_ends_the_named_requests_with_the_ids_they_kept[m14_forced_runs]",
    "tests/property/test_ladder_properties.py::test_outcome_is_finished_or_the_documented_error[m14_forced_runs]",
    "tests/property/test_ladder_properties.py::test_every_request_finishes_when_each_fits_the_pool[m14_forced_runs]",
    "tests/property/test_ladder_properties.py::test_trace_round_trips_and_is_deterministic[m14_forced_runs]",
    "tests/property/test_speculation_properties.py::test_decode_window_verdicts_follow_the_script[m14_forced_runs]",
    "tests/property/test_speculation_properties.py::test_decode_window_verdicts_cut_at_stop_ids[m14_forced_runs]",
    *(f"{t}[m14_forced_runs]" for t in PLAN_KNOWN_IDS),
)

# m15's router: the policies (`choose` and what it calls), the state only commit/observe/finish change,
# cache_aware's approximate tree, the config's validation, `Router` and `replay`, and the block hashes a
# router builds from tokens.  m15's Engine is m14's (the `m14` module covers it) and its Fleet is the
# simulation around the router; their mutants are generated but not run.
ROUTER_FUNCTIONS = (
    "x_choose",
    "x__least",
    "x__round_robin",
    "x__least_loaded",
    "x__cache_aware",
    "x__normalized",
    "x__precise",
    "x__oracle",
    "x__overloaded",
    "x__scored",
    "x__prefix_by_mask",
    "x_replay",
    "xǁRouterConfigǁ*",
    "xǁRouteRequestǁfrom_tokens",
    "xǁ_TreeNodeǁ*",
    "xǁApproxTreeǁ*",
    "xǁRouterStateǁ*",
    "xǁRouterǁ*",
)

# m16's additions to m15 (`mechserve diff m15 m16`): the control call `limit_drafts`, rule D1's draft limit and
# its `explain` sentence in `_draft`, and the engine's own copy of each request's `draft_limit_script` (made in
# `add_request`, kept in the table `__init__` creates).  Everything else in the file is m15's (m14's engine and
# the router), covered by the `m14` and `router` modules; its mutants are generated but not run.
M16_FUNCTIONS = (
    "xǁEngineǁ__init__",
    "xǁEngineǁadd_request",
    "xǁEngineǁlimit_drafts",
    "xǁEngineǁ_draft",
)

# m16's note tests and the ladder-wide properties' cases for m16 (the explanation property draws
# draft_limit_scripts; the top rungs' edges run m16 too).
M16_TESTS = (
    "tests/notes/test_m16_request_draft_lengths.py",
    "tests/property/test_m13_edges.py",
    *(f"{t}[m16_request_draft_lengths]" for t in EXPLAIN),
    "tests/property/test_step_halves.py::test_schedule_execute_commit_is_step[m16_request_draft_lengths]",
    "tests/property/test_step_halves.py::test_schedule_execute_commit_is_step_with_forced_runs[m16_request_draft_lengths]",
    "tests/property/test_step_halves.py::test_a_stop_ends_the_named_requests_with_the_ids_they_kept[m16_request_draft_lengths]",
    "tests/property/test_ladder_properties.py::test_outcome_is_finished_or_the_documented_error[m16_request_draft_lengths]",
    "tests/property/test_ladder_properties.py::test_every_request_finishes_when_each_fits_the_pool[m16_request_draft_lengths]",
    "tests/property/test_ladder_properties.py::test_trace_round_trips_and_is_deterministic[m16_request_draft_lengths]",
    "tests/property/test_speculation_properties.py::test_decode_window_verdicts_follow_the_script[m16_request_draft_lengths]",
    "tests/property/test_speculation_properties.py::test_decode_window_verdicts_cut_at_stop_ids[m16_request_draft_lengths]",
    *(f"{t}[m16_request_draft_lengths]" for t in PLAN_KNOWN_IDS),
)

# The structured-output matcher's tests that run no server and no embedded model (tests/http's
# structured tests serve; test_bench_structured runs the benchmark on SmolLM2).
STRUCTURED_TESTS = (
    "tests/structured/test_matcher.py",
    "tests/structured/test_closed_objects.py",
    "tests/structured/test_hostile_grammars.py",
    "tests/structured/test_request_failures.py",
    "tests/structured/test_masked_distribution.py",
    "tests/structured/test_constrained_engine.py",
)

# Smallest first, so the report has something in it early.  "The page pool" of issue 31 is
# kv/paged.py, the pool's pages as K/V tensors and the attention over them; the pool's bookkeeping
# (free list, owners, take/release: `PagePool`) is in the top rung, so `m14` covers it, and
# engine/pool.py only sizes it (how many pages fit the memory), tested through the CLI and LLM suites.
MODULES: tuple[Module, ...] = (
    Module(
        "verify",
        "mechserve/executor/verify.py",
        ("tests/executor/test_spec_sampling.py",),
        forkserver=True,
    ),
    Module(
        "detokenizer",
        "mechserve/engine/detokenizer.py",
        ("tests/engine/test_detokenizer.py", "tests/engine/test_stop_strings.py"),
    ),
    Module(
        "fields",
        "mechserve/http/fields.py",
        HTTP_MODEL_TESTS,
        HTTP_NO_SERVER,
    ),
    Module(
        "protocol",
        "mechserve/http/protocol.py",
        PROTOCOL_TESTS,
        HTTP_NO_SERVER,
    ),
    Module(
        "router",
        "mechserve/spec/m15_routing.py",
        (
            "tests/notes/test_m15_routing.py",
            "tests/property/test_m15_properties.py",
            "tests/property/test_m15_router_edges.py",
        ),
        functions=ROUTER_FUNCTIONS,
    ),
    # The top rung the engine runs: only what m16 adds to m15 (M16_FUNCTIONS).
    Module(
        "m16",
        "mechserve/spec/m16_request_draft_lengths.py",
        M16_TESTS,
        functions=M16_FUNCTIONS,
    ),
    Module(
        "sampling",
        "mechserve/executor/sampling.py",
        (
            "tests/executor/test_sampling.py",
            "tests/executor/test_penalties.py",
            "tests/executor/test_spec_sampling.py",
            "tests/executor/test_sampling_engine.py",
            "tests/executor/test_sampler_streams.py",
            "tests/structured/test_request_failures.py",
        ),
        forkserver=True,
    ),
    Module(
        "structured",
        "mechserve/executor/structured.py",
        STRUCTURED_TESTS,
        forkserver=True,
    ),
    Module(
        "paged",
        "mechserve/kv/paged.py",
        ("tests/kv/test_native_attention.py", "tests/executor/test_torch_executor.py"),
        forkserver=True,
    ),
    Module("m14", "mechserve/spec/m14_forced_runs.py", M14_TESTS),
    Module(
        "m13",
        "mechserve/spec/m13_output_caching.py",
        (
            "tests/notes/test_m13_output_caching.py",
            "tests/property/test_m13_properties.py",
            "tests/property/test_m13_edges.py",
            *(f"{t}[m13_output_caching]" for t in PLAN_KNOWN_IDS),
            *(f"{t}[m13_output_caching]" for t in EXPLAIN),
        ),
        sample=0.1,
    ),
)
BY_NAME = {m.name: m for m in MODULES}

# mutmut's exit-code verdicts (mutmut.models: status_by_exit_code), grouped for the report.
KILLED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVED = {"survived", "suspicious"}


def _toml_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(x) for x in items) + "]"


def _prepare(mod: Module, keep: bool, *, max_examples: int | None, scratch: str | None = None) -> Path:
    """A scratch copy of mechserve/, tests/, docs/ and pyproject.toml with this module's [tool.mutmut] table
    (in ``build/mutation/<scratch or module name>``), property tests capped at ``max_examples`` (None: their own)."""
    work = SCRATCH / (scratch or mod.name)
    if work.exists() and not keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for d in ("mechserve", "tests", "docs"):
        shutil.copytree(ROOT / d, work / d, dirs_exist_ok=True, ignore=ignore)
    shutil.copyfile(PLUGIN, work / PLUGIN.name)
    pytest_args = [*FAST, "--mutation-max-examples", str(max_examples or 0), *mod.pytest_args]
    # mypy as `make lint` runs it (the project's settings, copied with pyproject.toml), on the mutated file;
    # mutmut needs "mypy" as an argument of its own to read the JSON report.
    type_check = [sys.executable, "-m", "mypy", "--output", "json", mod.path] if mod.type_check else []
    table = "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["mechserve"]',
            f"only_mutate = {_toml_list([mod.path])}",
            f"pytest_add_cli_args_test_selection = {_toml_list(list(mod.tests))}",
            f"pytest_add_cli_args = {_toml_list(pytest_args)}",
            f"type_check_command = {_toml_list(type_check)}",
            f'process_isolation = "{"forkserver" if mod.forkserver else "fork"}"',
            "use_git_change_detection = false",
            # docs/: tests/http/test_fields.py compares docs/api-fields.md with the table; the plugin: -p above
            f"also_copy = {_toml_list(['docs', PLUGIN.name])}",
            "",
        ]
    )
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + table)
    return work


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The worktree must not shadow the mutated copy mutmut puts first on sys.path.
    env.pop("PYTHONPATH", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _mutmut(work: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run mutmut in ``work``; its progress spinner goes to ``work/mutmut.log`` unless captured.

    While it runs, the machine's 1-minute load average is sampled every ``LOAD_EVERY_S`` seconds into
    ``work/load.json`` (the figures docs/mutation.md reports beside each wall time)."""
    if capture:
        return subprocess.run([str(MUTMUT), *args], cwd=work, env=_env(), text=True, capture_output=True, check=False)
    loads_file, cpu_file = work / "load.json", work / "cpu.json"
    loads: list[float] = json.loads(loads_file.read_text()) if loads_file.exists() else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(work / "mutmut.log", "a") as log:
        proc = subprocess.Popen([str(MUTMUT), *args], cwd=work, env=_env(), text=True, stdout=log, stderr=log)
        while True:
            loads.append(round(os.getloadavg()[0], 2))
            loads_file.write_text(json.dumps(loads))
            try:
                rc = proc.wait(timeout=LOAD_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                continue
    # CPU seconds of mutmut and every process under it (each reaped by its parent): with one worker and
    # one thread per process, about what the run's wall time would be on an idle machine.
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cpu_file.write_text(json.dumps(round(cpu + (json.loads(cpu_file.read_text()) if cpu_file.exists() else 0.0), 1)))
    return subprocess.CompletedProcess(proc.args, rc, "", "")


def _statuses(work: Path) -> dict[str, str]:
    out = _mutmut(work, "results", "--all", "true", capture=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\S+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
path, names = sys.argv[1], json.loads(sys.stdin.read())
print(json.dumps({n: get_diff_for_mutant(n, path=path) for n in names}))
"""


def _diffs(work: Path, mod: Module, names: list[str]) -> dict[str, str]:
    """Each mutant's diff, all in one process (``mutmut show`` starts one per mutant)."""
    if not names:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _DIFFS, mod.path],
        cwd=work,
        env=_env(),
        input=json.dumps(names),
        text=True,
        capture_output=True,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def _probe(mod: Module) -> str:
    """One mutant's name (the first selected function's, or the first top-level function's, first mutant):
    running it generates them all."""
    if mod.functions:
        return mod.patterns()[0].replace("__mutmut_*", "__mutmut_1")
    tree = ast.parse((ROOT / mod.path).read_text())
    first = next(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
    return f"*.x_{first}__mutmut_1"


def _meta(work: Path, mod: Module) -> dict[str, Any]:
    meta = work / "mutants" / (mod.path + ".meta")
    return dict(json.loads(meta.read_text())) if meta.exists() else {}


def _all_mutant_names(work: Path, mod: Module) -> list[str]:
    """Every mutant mutmut generates for the module (read from its .meta file after generation)."""
    return sorted(_meta(work, mod).get("exit_code_by_key", {}))


def run_module(
    mod: Module,
    *,
    sample: float,
    seed: int,
    keep: bool,
    max_examples: int | None,
    recheck: bool = True,
    only: Sequence[str] = (),
) -> dict[str, Any]:
    """Sweep ``mod``'s mutants (a seeded ``sample`` of those of its selected functions, or the mutants
    matching ``only``, fnmatch patterns of mutmut's full names), then, when the sweep capped the
    property tests (``max_examples``) and ``recheck``, run the survivors again with the tests' own
    example counts (``rerun_survivors``)."""
    work = _prepare(mod, keep, max_examples=max_examples)
    started = time.monotonic()
    names: list[str] = list(only) or mod.patterns()
    if sample < 1.0 and not only:
        # Generate the mutants (and collect stats) running one mutant only, then
        # draw the seeded sample from the selected functions' mutants and run it.
        first = _mutmut(work, "run", "--max-children", str(MAX_CHILDREN), _probe(mod))
        if first.returncode != 0:
            raise SystemExit(f"mutmut failed generating {mod.name}'s mutants (exit {first.returncode})")
        everyone = [n for n in _all_mutant_names(work, mod) if mod.selects(n)]
        rng = random.Random(seed)
        names = sorted(rng.sample(everyone, max(1, round(sample * len(everyone)))))
    proc = _mutmut(work, "run", "--max-children", str(MAX_CHILDREN), *names)
    if proc.returncode != 0:
        raise SystemExit(f"mutmut failed on {mod.name} (exit {proc.returncode}); see {work / 'mutmut.log'}")
    summary = summarise(
        mod, work, names, sample=sample, seed=seed, wall=time.monotonic() - started, max_examples=max_examples
    )
    if recheck and max_examples and summary["survivors"]:
        summary = rerun_survivors(mod, why="the tests' own example counts")
    return summary


def summarise(
    mod: Module,
    work: Path,
    names: list[str],
    *,
    sample: float,
    seed: int,
    wall: float,
    max_examples: int | None,
    partial: bool = False,
) -> dict[str, Any]:
    """Count the verdicts in ``work`` (of ``names``, mutant names or patterns, when given; always only
    the selected functions') and keep each survivor's diff, the per-mutant durations and the load."""
    statuses = {k: v for k, v in _statuses(work).items() if mod.selects(k)}
    if names:
        statuses = {k: v for k, v in statuses.items() if any(fnmatch.fnmatchcase(k, n) for n in names)}
    counts: dict[str, int] = {}
    for v in statuses.values():
        counts[v] = counts.get(v, 0) + 1
    survivors = sorted(k for k, v in statuses.items() if v in SURVIVED or v == "no tests")
    diffs = _diffs(work, mod, survivors)
    everyone = _all_mutant_names(work, mod)
    durations = [d for k, d in _meta(work, mod).get("durations_by_key", {}).items() if k in statuses and d]
    loads_file, cpu_file = work / "load.json", work / "cpu.json"
    loads: list[float] = json.loads(loads_file.read_text()) if loads_file.exists() else []
    summary: dict[str, Any] = {
        "module": mod.path,
        "tests": list(mod.tests),
        "functions": list(mod.functions),
        "generated": len(everyone),
        "generated_selected": sum(1 for n in everyone if mod.selects(n)),
        "run": len(statuses),
        "sample": sample,
        "seed": seed,
        "max_examples": max_examples,
        "max_children": MAX_CHILDREN,
        "killed": sum(n for s, n in counts.items() if s in KILLED),
        "survived": sum(n for s, n in counts.items() if s in SURVIVED),
        "no_tests": counts.get("no tests", 0),
        "not_checked": counts.get("not checked", 0),
        "caught_by_type_check": counts.get("caught by type check", 0),
        "statuses": counts,
        "wall_s": round(wall, 1),
        "cpu_s": json.loads(cpu_file.read_text()) if cpu_file.exists() else None,
        # mutmut's own time per mutant run (fork to exit), not counting generation and the stats run
        "mutant_s_total": round(sum(durations), 1),
        "mutant_s_mean": round(sum(durations) / len(durations), 2) if durations else None,
        "load": {"min": min(loads), "mean": round(sum(loads) / len(loads), 1), "max": max(loads)} if loads else None,
        "partial": partial,
        "survivors": diffs,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def rerun_survivors(mod: Module, why: str = "tests added since", max_examples: int | None = None) -> dict[str, Any]:
    """Run the last run's survivors again against today's tests, by default with the tests' own hypothesis
    example counts (fresh copy, fresh stats); record the result, the cap and ``why`` in its summary."""
    f = SCRATCH / mod.name / "summary.json"
    summary = json.loads(f.read_text())
    names = sorted(summary["survivors"])
    again: dict[str, str] = {}
    started = time.monotonic()
    if names:
        work = _prepare(mod, keep=False, max_examples=max_examples, scratch=mod.name + "-rerun")
        proc = _mutmut(work, "run", "--max-children", str(MAX_CHILDREN), *names)
        if proc.returncode != 0:
            raise SystemExit(f"mutmut failed re-running {mod.name} (exit {proc.returncode}); see {work / 'mutmut.log'}")
        again = {k: v for k, v in _statuses(work).items() if k in set(names)}
    summary["rerun"] = again
    summary["rerun_why"] = why
    summary["rerun_max_examples"] = max_examples
    summary["rerun_wall_s"] = round(time.monotonic() - started, 1)
    summary["still_surviving"] = sorted(k for k, v in again.items() if v not in KILLED)
    f.write_text(json.dumps(summary, indent=1))
    return summary


def report() -> str:
    rows = [
        "| module | test files or ids | killed / run (generated) | killed by the first run | score | wall "
        "| CPU | s per mutant | load avg mean (min-max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mod in MODULES:
        f = SCRATCH / mod.name / "summary.json"
        if not f.exists():
            rows.append(f"| `{mod.path}` | — | not run | | | | | | |")
            continue
        s = json.loads(f.read_text())
        run = s["run"] - s["not_checked"]
        killed = s["killed"]
        if "rerun" in s:  # survivors of the first run that a rerun kills (full example counts, tests added since)
            killed += sum(1 for v in s["rerun"].values() if v in KILLED)
        score = 100.0 * killed / run if run else 0.0
        generated = f"{s['generated']} generated"
        if s.get("functions"):
            generated = f"{s['generated_selected']} of the file's {s['generated']} generated: the selected functions'"
        if s["sample"] < 1:
            generated += f", sample {s['sample']:.0%} seed {s['seed']}"
        if s.get("partial"):
            generated += ", interrupted: mutmut runs the mutants whose tests are fastest first"
        if s.get("caught_by_type_check"):
            generated += f"; {s['caught_by_type_check']} caught by mypy"
        per = "" if s.get("mutant_s_mean") is None else f"{s['mutant_s_mean']:.1f}"
        load = s.get("load")
        loads = f"{load['mean']} ({load['min']}-{load['max']})" if load else ""
        cpu = "" if s.get("cpu_s") is None else f"{s['cpu_s'] / 60:.1f} min"
        rows.append(
            f"| `{mod.path}` | {len(s['tests'])} | {killed} / {run} ({generated}) "
            f"| {s['killed']} | {score:.1f}% | {s['wall_s'] / 60:.1f} min | {cpu} | {per} | {loads} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("modules", nargs="*", help=f"any of {', '.join(BY_NAME)} (default: all, smallest first)")
    ap.add_argument("--sample", type=float, default=None, help="fraction of mutants to run (seeded)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help=f"hypothesis examples per property test in the sweep (default {MAX_EXAMPLES}; 0: the tests' own)",
    )
    ap.add_argument(
        "--no-recheck",
        action="store_true",
        help="do not run a capped sweep's survivors again with the tests' own example counts",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only the mutants whose mutmut names match (fnmatch; repeatable), e.g. '*_plan__mutmut_30'",
    )
    ap.add_argument("--keep", action="store_true", help="reuse the scratch copy and mutmut's cache")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--report", action="store_true", help="print the Markdown table of the last runs")
    ap.add_argument("--collect", action="store_true", help="summarise an interrupted run from mutmut's cache")
    ap.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="run the last run's survivors against the current tests (the tests' own example counts unless --max-examples)",
    )
    ap.add_argument(
        "--max-children",
        type=int,
        default=1,
        metavar="N",
        help="mutants run at once (mutmut's workers; default 1, the machine is shared)",
    )
    args = ap.parse_args(argv)
    if args.max_children < 1:
        ap.error(f"--max-children must be >= 1, not {args.max_children}")
    global MAX_CHILDREN
    MAX_CHILDREN = args.max_children
    if args.max_examples is not None and args.max_examples < 0:
        ap.error(f"--max-examples must be >= 0, not {args.max_examples}")
    if args.list:
        for m in MODULES:
            print(f"{m.name:12} {m.path:40} {' '.join(m.tests)}")
        return 0
    if args.report:
        print(report())
        return 0
    unknown = [n for n in args.modules if n not in BY_NAME and not any(fnmatch.fnmatch(m, n) for m in BY_NAME)]
    if unknown:
        print(f"mutation: unknown module {unknown[0]!r} (one of {', '.join(BY_NAME)})", file=sys.stderr)
        return 2
    chosen = [m for m in MODULES if not args.modules or m.name in args.modules]

    def cap(mod: Module) -> int | None:
        return mod.max_examples if args.max_examples is None else (args.max_examples or None)

    if args.collect:
        for mod in chosen:
            work = SCRATCH / mod.name
            wall = (work / "mutmut.log").stat().st_mtime - (work / "pyproject.toml").stat().st_mtime
            summarise(mod, work, [], sample=1.0, seed=args.seed, wall=wall, max_examples=cap(mod), partial=True)
        print(report())
        return 0
    if args.rerun_survivors:
        for mod in chosen:
            s = rerun_survivors(mod, max_examples=args.max_examples or None)
            print(
                f"mutation: {mod.name}: {len(s['rerun'])} survivors re-run, {len(s['still_surviving'])} still survive"
            )
        print(report())
        return 0
    for mod in chosen:
        sample = args.sample if args.sample is not None else mod.sample
        s = run_module(
            mod,
            sample=sample,
            seed=args.seed,
            keep=args.keep,
            max_examples=cap(mod),
            recheck=not args.no_recheck,
            only=args.only,
        )
        print(
            f"mutation: {mod.name}: killed {s['killed']} / {s['run']} "
            f"(survived {s['survived']}, no tests {s['no_tests']}) in {s['wall_s']} s",
            flush=True,
        )
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
