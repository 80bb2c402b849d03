"""``mechserve generate`` through the real command line (``mechserve.cli.main``), on a tiny model with a word tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_runs import run_engine as generate
from tiny_checkpoints import VOCAB, hf_greedy, save_tiny, tiny_config

from mechserve.api.config import EngineConfig
from mechserve.api.errors import KVMemoryError
from mechserve.cli import generate as generate_cli
from mechserve.cli.main import main
from mechserve.engine import executors as executors_module
from mechserve.engine import pool as engine_module
from mechserve.engine.core import EngineCore
from mechserve.engine.pool import available_memory, page_bytes
from mechserve.model.loader import LoadedModel, load_model
from mechserve.spec import m14_forced_runs as m14


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("mechserve: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err.strip()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    hf = save_tiny(path, tiny_config())
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir: tuple[Path, object]) -> LoadedModel:
    return load_model(str(tiny_dir[0]))


PROMPT = "w3 w14 w15 w92 w65 w35 w89 w79 w32 w38 w46 w26 w43 w38 w32 w79 w50 w28"
PROMPT_IDS = [int(w[1:]) for w in PROMPT.split()]


def test_text_trace_then_text(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "6", "--max-step-tokens", "8"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("step   0  scheduled r0  executed r0=8")
    assert "sampled" not in lines[0]  # a chunk inside the prompt samples nothing
    assert any("finished r0=LENGTH" in line for line in lines)
    assert lines[-2].startswith(PROMPT) and len(lines[-2].split()) == len(PROMPT.split()) + 6
    assert "6 token(s)" in lines[-1]


def test_rate_line_reports_prefill_and_decode(tiny_dir: tuple[Path, object], capsys) -> None:
    path, _ = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "5"], capsys)
    assert rc == 0, err
    last = out.splitlines()[-1]
    assert f"prefill {len(PROMPT_IDS)} token(s) in " in last and "time to first token" in last
    assert "decode 4 token(s) in " in last and "finished length" in last
    assert " 0.0 tok/s" not in last and "(0 tok/s" not in last
    rc, out, _ = call([PROMPT, "--model", str(path), "--max-tokens", "1"], capsys)
    assert rc == 0 and "decode" not in out.splitlines()[-1] and "1 token(s)" in out.splitlines()[-1]


def test_rate_is_never_rounded_to_zero() -> None:
    assert generate_cli.rate(1, 1000.0) == "0.001 tok/s"
    assert generate_cli.rate(3, 0.0) != "0.0 tok/s"
    assert generate_cli.rate(123, 1.0) == "123 tok/s"
    assert generate_cli.rate(45, 2.0) == "22.5 tok/s"


def test_json_matches_transformers(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, hf = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "9", "--spec-len", "2", "--json"], capsys)
    assert rc == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    steps, final = objs[:-1], objs[-1]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert all("tokens" in s and "accepted" in s and "rejected" in s for s in steps)
    assert list(final) == ["summary", "outputs"]
    (summary,) = final["summary"]
    (output,) = final["outputs"]
    assert list(output) == ["request_id", "text", "token_ids", "finish_reason", "stop_reason", "index"]
    assert output["token_ids"] == hf_greedy(hf, PROMPT_IDS, 9)
    assert output["text"] == "".join(f" w{i}" for i in output["token_ids"])
    assert summary == {
        "request_id": "r0",
        "state": "FINISHED",
        "generated": 9,
        "computed": len(PROMPT_IDS) + 8,
        "finish_reason": "LENGTH",
    }
    assert output["request_id"] == "r0" and output["finish_reason"] == "length" and output["index"] == 0
    assert [t for s in steps for t in s["tokens"].get("r0", [])] == output["token_ids"]


def test_quiet_prints_only_the_text(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, hf = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "4", "-q"], capsys)
    assert rc == 0 and err == ""
    assert out == "".join(f" w{i}" for i in hf_greedy(hf, PROMPT_IDS, 4)) + "\n"
    rc, out, _ = call([PROMPT, "--model", str(path), "--max-tokens", "4", "--quiet", "--json"], capsys)
    assert rc == 0 and len(out.splitlines()) == 1 and list(json.loads(out)) == ["summary", "outputs"]


def test_zero_max_tokens_finishes_at_once(tiny_dir: tuple[Path, object], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "0", "--json"], capsys)
    assert rc == 0, err
    final = json.loads(out.splitlines()[-1])
    assert final["outputs"][0]["token_ids"] == [] and final["outputs"][0]["finish_reason"] == "length"


def test_default_step_budget_is_vllms() -> None:
    from mechserve.cli.parser import Parser

    parser = Parser(prog="mechserve generate")
    generate_cli.add_arguments(parser)
    assert parser.parse_args(["hi"]).max_step_tokens == 2048 == EngineConfig().max_step_tokens


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--page-size", "0"], "--page-size: must be > 0, got 0"),
        (["--max-step-tokens", "-1"], "--max-step-tokens: must be > 0"),
        (["--num-pages", "0"], "--num-pages: must be > 0"),
        (["--spec-len", "-2"], "--spec-len: must be >= 0"),
        (["--max-tokens", "-1"], "--max-tokens: expected an integer in [0, 1000000000], got '-1'"),
        (["--max-tokens", "ten"], "--max-tokens: expected an integer in [0, 1000000000], got 'ten'"),
        (["--num-pages", str(10**12)], "--num-pages: must be at most 1000000"),
        (["--page-size", str(10**12)], "--page-size: must be at most 65536"),
        (["--max-tokens", str(10**10)], "--max-tokens: expected an integer in [0, 1000000000], got '10000000000'"),
        (["--spec-len", "65"], "--spec-len: must be at most 64"),
        (["--num-pages", "1000000", "--page-size", "64"], "16777216 slots"),
        (["--kv-memory", "lots"], "--kv-memory: expected a size such as 512MiB"),
        (["--kv-memory", "0GiB"], "--kv-memory: must be > 0"),
        (["--kv-memory", "9" * 400], "--kv-memory: must be at most"),
    ],
)
def test_arguments_are_checked_before_the_model_loads(
    extra: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mechserve.model.loader.load_model", no_loading)
    rc, _, err = call([PROMPT, "--model", "/no/such/dir", *extra], capsys)
    one_error_line(rc, err, message)


def test_empty_prompt_is_refused_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = call(["", "--model", "/no/such/dir"], capsys)
    one_error_line(rc, err, "prompt: must not be empty")


def test_missing_model_dir(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = call([PROMPT, "--model", "/no/such/dir"], capsys)
    one_error_line(rc, err, "model not found: /no/such/dir (a directory or a .gguf file)")


def test_never_fits_is_rejected_at_the_door(tiny_dir: tuple[Path, object], capsys) -> None:
    path, _ = tiny_dir
    rc, out, err = call([PROMPT, "--model", str(path), "--num-pages", "2", "--page-size", "4"], capsys)
    line = one_error_line(rc, err, "request rejected: NEVER_FITS (needs 21 pages of 4 positions, the pool has 2")
    assert "--num-pages" in line and out == ""


def test_longer_than_the_models_context_is_rejected(tiny_dir: tuple[Path, object], capsys) -> None:
    path, _ = tiny_dir  # max_position_embeddings 512
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", str(512 - len(PROMPT_IDS) + 1)], capsys)
    one_error_line(rc, err, "request rejected: TOO_LONG", "= 513", "context of 512 positions", "--max-tokens")
    assert out == ""


def test_the_models_context_is_the_engines_max_model_len(tiny_loaded: LoadedModel) -> None:
    fits = generate(tiny_loaded.model, [PROMPT_IDS], 512 - len(PROMPT_IDS))
    assert fits.core.max_model_len == 512 and fits.completions[0].rejected is None
    over = generate(tiny_loaded.model, [PROMPT_IDS, [1, 2]], 512 - len(PROMPT_IDS) + 1)
    assert over.completions[0].rejected == "TOO_LONG" and over.completions[0].token_ids == ()
    assert over.completions[1].rejected is None and over.completions[1].finish_reason == "LENGTH"


def test_kv_cache_over_the_budget(tiny_dir: tuple[Path, object], capsys) -> None:
    path, _ = tiny_dir
    rc, _, err = call([PROMPT, "--model", str(path), "--num-pages", "1000", "--kv-memory", "1MiB"], capsys)
    one_error_line(
        rc, err, "KV cache of 7.8 MiB for 1000 pages does not fit in 1.0 MiB of the KV budget", "--num-pages"
    )
    rc, _, err = call([PROMPT, "--model", str(path), "--kv-memory", "1KiB"], capsys)
    one_error_line(rc, err, "holds no page", "--kv-memory")


def test_kv_cache_over_the_available_memory(
    tiny_dir: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    path, _ = tiny_dir
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4000 kB\nMemFree:        1000 kB\nMemAvailable:   2048 kB\n")
    monkeypatch.setattr(engine_module, "MEMINFO", str(meminfo))
    assert available_memory(str(meminfo)) == 2 << 20
    rc, out, err = call([PROMPT, "--model", str(path), "--num-pages", "1000"], capsys)
    one_error_line(rc, err, "KV cache of 7.8 MiB for 1000 pages does not fit in 2.0 MiB of available memory")
    assert "lower --num-pages" in err and out == ""
    rc, _, err = call([PROMPT, "--model", str(path), "--kv-memory", "1GiB"], capsys)
    one_error_line(rc, err, "of available memory", "lower --kv-memory")


def test_no_meminfo_means_no_check(tmp_path: Path) -> None:
    assert available_memory(str(tmp_path / "absent")) is None
    (tmp_path / "odd").write_text("MemTotal: 1 kB\n")
    assert available_memory(str(tmp_path / "odd")) is None


def test_kv_memory_sizes_the_pool(tiny_loaded: LoadedModel) -> None:
    per_page = page_bytes(tiny_loaded.model, 16)
    assert per_page == 2 * 2 * 16 * 2 * 16 * 4
    core = EngineCore(tiny_loaded, EngineConfig(kv_memory=10 * per_page + 5))
    assert (core.num_pages, core.sized_by) == (10, "kv_memory")
    with pytest.raises(KVMemoryError, match="holds no page"):
        EngineCore(tiny_loaded, EngineConfig(kv_memory=per_page - 1))


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2G", 2 << 30),
        ("2Gi", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("4GB", 4 * 10**9),
        ("100", 100),
        ("64 KiB", 64 << 10),
        ("7b", 7),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert generate_cli.parse_size(text) == size


def test_allocation_failure_is_a_clear_error(
    tiny_dir: tuple[Path, object], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    path, _ = tiny_dir

    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000 bytes"
        )

    monkeypatch.setattr(executors_module, "TorchExecutor", no_memory)
    rc, _, err = call([PROMPT, "--model", str(path), "--num-pages", "64"], capsys)
    one_error_line(
        rc,
        err,
        "could not allocate the KV cache of 512.0 KiB for 64 pages",
        "can't allocate memory",
        "lower --num-pages",
    )


class _FailingAt:
    """Wraps ``TorchExecutor`` so that its ``execute`` raises ``error`` at step ``step``."""

    def __init__(self, step: int, error: Exception) -> None:
        self.step, self.error = step, error

    def __call__(self, *args: object, **kwargs: object) -> object:
        inner = engine_module_executor(*args, **kwargs)
        calls = iter(range(1_000_000))
        original = inner.execute

        def execute(plan: tuple[m14.PlanItem, ...]) -> tuple[m14.Outcome, ...]:
            if next(calls) == self.step:
                raise self.error
            return original(plan)

        inner.execute = execute  # type: ignore[method-assign]
        return inner


engine_module_executor = executors_module.TorchExecutor


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (m14.Irreducible("r0 needs 9 page(s) but the pool has 8"), "Irreducible during step 2: r0 needs 9 page(s)"),
        (m14.BoundaryViolation("r0: bad outcome"), "BoundaryViolation during step 2: r0: bad outcome"),
        (RuntimeError("CPU allocator: failed to allocate 10 GB"), "out of memory during step 2: CPU allocator"),
        (ValueError("something odd"), "ValueError during step 2: something odd"),
    ],
)
def test_engine_error_part_way_prints_the_steps_before_it(
    error: Exception, message: str, tiny_dir: tuple[Path, object], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    path, _ = tiny_dir
    monkeypatch.setattr(executors_module, "TorchExecutor", _FailingAt(2, error))
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "6", "--max-step-tokens", "8"], capsys)
    one_error_line(rc, err, message)
    assert [line.split()[1] for line in out.splitlines()] == ["0", "1"]
    rc, out, err = call([PROMPT, "--model", str(path), "--max-tokens", "6", "--max-step-tokens", "8", "--json"], capsys)
    one_error_line(rc, err, message)
    assert [json.loads(line)["step"] for line in out.splitlines()] == [0, 1]


def test_unsupported_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    rc, _, err = call(["hi", "--model", str(tmp_path)], capsys)
    one_error_line(rc, err, "mechserve: error: unsupported model_type 'bert'")


def test_seed_takes_the_servers_range_and_minus_one_is_unseeded(tiny_dir: tuple[Path, object], capsys) -> None:
    """``--seed`` follows the HTTP ``seed`` field: any 64-bit signed integer, -1 unseeded (it refused -1)."""
    path = str(tiny_dir[0])

    def tokens(*seed: str) -> list[int]:
        argv = [PROMPT, "--model", path, "--max-tokens", "12", "--temperature", "1.5", *seed, "--json"]
        rc, out, err = call(argv, capsys)
        assert rc == 0, err
        return json.loads(out.splitlines()[-1])["outputs"][0]["token_ids"]

    lowest = tokens("--seed", str(-(1 << 63)))
    assert lowest == tokens("--seed", str(-(1 << 63)))  # seeded: the same draws
    assert tokens("--seed", "-5") == tokens("--seed", "-5")
    assert tokens("--seed", "-1") == tokens()  # -1 is no seed: the engine's own draws, as without --seed
    assert len({tuple(lowest), tuple(tokens("--seed", "-5")), tuple(tokens("--seed", "7"))}) > 1
    one_error_line(*call([PROMPT, "--model", path, "--seed", str(1 << 63)], capsys)[::2], "--seed")
    one_error_line(*call([PROMPT, "--model", path, "--seed", str(-(1 << 63) - 1)], capsys)[::2], "--seed")
