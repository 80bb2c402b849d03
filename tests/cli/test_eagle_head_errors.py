"""Every way an EAGLE head can be missing or wrong is one clear error, on every path that loads one (issue 27).

A head is loaded when an engine is built with ``--spec-method eagle``: ``LLM``, ``AsyncLLM``, ``mechserve
generate``, ``serve`` (at start, before it binds its port), ``bench spec-decode`` and each data-parallel
replica.  Each fault (no head trained, a directory that is missing or is a file, a file missing, truncated or
corrupt, a ``config.json`` that is not JSON or has a bad shape, tensors that do not fit, another model's
head, a draft vocabulary that does not fit) is a ``HeadError`` from ``LLM`` (a ``ValueError`` and a
``ModelLoadError``) whose one line names the head's directory and the ``mechserve train-draft`` that mends
it, and exactly that line with exit status 2 from the CLI.
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import Result
from safetensors.torch import load_file, save_file

from mechserve.api.errors import HeadError, ModelLoadError
from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.entrypoints.llm import LLM
from mechserve.model import eagle
from mechserve.model.loader import LoadedModel

Cli = Callable[..., Result]
GENERATE = ("generate", "w1 w2 w3", "--max-tokens", "3", "--num-pages", "16", "--spec-method", "eagle")


def _copy(good: Path, d: Path) -> None:
    shutil.copytree(good, d)


def _edit_config(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path, Path], None]:
    def make(good: Path, d: Path) -> None:
        _copy(good, d)
        config = json.loads((d / eagle.CONFIG_FILE).read_text())
        edit(config)
        (d / eagle.CONFIG_FILE).write_text(json.dumps(config))

    return make


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[Path, Path], None]:
    def make(good: Path, d: Path) -> None:
        _copy(good, d)
        tensors = load_file(str(d / eagle.HEAD_FILE))
        edit(tensors)
        save_file(tensors, str(d / eagle.HEAD_FILE))

    return make


def _write(name: str, data: bytes) -> Callable[[Path, Path], None]:
    def make(good: Path, d: Path) -> None:
        _copy(good, d)
        (d / name).write_bytes(data)

    return make


def _truncate(good: Path, d: Path) -> None:
    _copy(good, d)
    data = (d / eagle.HEAD_FILE).read_bytes()
    (d / eagle.HEAD_FILE).write_bytes(data[: len(data) // 2])


def _remove(name: str) -> Callable[[Path, Path], None]:
    def make(good: Path, d: Path) -> None:
        _copy(good, d)
        (d / name).unlink()

    return make


def _set_shape(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["shape"][key] = value

    return edit


def _another_model(config: dict[str, Any]) -> None:
    config["target_fingerprint"] = "0" * 64
    config["target"] = "/models/another"


def _bad_ranking(tensors: dict[str, torch.Tensor]) -> None:
    tensors["draft_vocab"][0] = 999  # an id past the vocabulary (128)


# The fix each kind of fault names: write a head into that directory, train one for this model, or ask for fewer ids.
WRITE = (
    "write one there with `mechserve train-draft --model {model} --output {d}`, or name another with --eagle-head DIR"
)
RETRAIN = "train one for it with `mechserve train-draft --model {model}` and name it with --eagle-head"
FEWER = "give 1 to 128 (--eagle-draft-vocab N), or 0 for all of them"

# name: (make the directory d from a good head, what the message says, the fix, extra speculative options)
FAULTS: dict[str, tuple[Callable[[Path, Path], None], str, str, dict[str, Any]]] = {
    "no such directory": (lambda good, d: None, "no EAGLE head at {d}: no such directory; ", WRITE, {}),
    "a file": (
        lambda good, d: d.write_text("x"),
        "no EAGLE head at {d}: it is a file, not a head's directory; ",
        WRITE,
        {},
    ),
    "an empty directory": (
        lambda good, d: d.mkdir(),
        "no EAGLE head in {d}: it holds neither config.json nor head.safetensors; ",
        WRITE,
        {},
    ),
    "no config.json": (
        _remove(eagle.CONFIG_FILE),
        "no EAGLE head in {d}: it holds head.safetensors but no config.json; ",
        WRITE,
        {},
    ),
    "no head.safetensors": (
        _remove(eagle.HEAD_FILE),
        "no EAGLE head in {d}: it holds config.json but no head.safetensors; ",
        WRITE,
        {},
    ),
    "config.json not JSON": (
        _write(eagle.CONFIG_FILE, b'{"shape": '),
        "the EAGLE head in {d} is unreadable: config.json is not JSON (",
        WRITE,
        {},
    ),
    "config.json not UTF-8": (
        _write(eagle.CONFIG_FILE, b'{"shape": "\xff"}'),
        "the EAGLE head in {d} is unreadable: config.json is not JSON (",
        WRITE,
        {},
    ),
    "config.json a list": (
        _write(eagle.CONFIG_FILE, b"[1, 2]"),
        "the EAGLE head in {d} is unreadable: config.json is not a JSON object; ",
        WRITE,
        {},
    ),
    "a shape field of the wrong type": (
        _edit_config(_set_shape("hidden", "64")),
        "the EAGLE head in {d} is unreadable: config.json: shape.hidden must be an integer >= 1, got '64'; ",
        WRITE,
        {},
    ),
    "a window of 0": (
        _edit_config(_set_shape("window", 0)),
        "the EAGLE head in {d} is unreadable: config.json: shape.window must be an integer >= 1, got 0; ",
        WRITE,
        {},
    ),
    "a shape without a field": (
        _edit_config(lambda c: c["shape"].pop("heads")),
        'the EAGLE head in {d} is unreadable: config.json has no "shape" with the fields ',
        WRITE,
        {},
    ),
    "no fingerprint": (
        _edit_config(lambda c: c.pop("target_fingerprint")),
        'the EAGLE head in {d} is unreadable: config.json has no "target_fingerprint"',
        WRITE,
        {},
    ),
    "a truncated head.safetensors": (
        _truncate,
        "the EAGLE head in {d} is unreadable: head.safetensors is truncated or not a safetensors file (",
        WRITE,
        {},
    ),
    "a head.safetensors that is not one": (
        _write(eagle.HEAD_FILE, b"not safetensors"),
        "the EAGLE head in {d} is unreadable: head.safetensors is truncated or not a safetensors file (",
        WRITE,
        {},
    ),
    "an empty head.safetensors": (
        _write(eagle.HEAD_FILE, b""),
        "the EAGLE head in {d} is unreadable: head.safetensors is truncated or not a safetensors file (",
        WRITE,
        {},
    ),
    "a missing tensor": (
        _edit_tensors(lambda t: t.pop("qkv.weight")),
        'the EAGLE head in {d} does not fit its config.json (Missing key(s) in state_dict: "qkv.weight"',
        WRITE,
        {},
    ),
    "a tensor of another shape": (
        _edit_tensors(lambda t: t.update({"fc.weight": torch.zeros(3, 3)})),
        "the EAGLE head in {d} does not fit its config.json (size mismatch for fc.weight",
        WRITE,
        {},
    ),
    "a draft vocabulary that is not a ranking": (
        _edit_tensors(_bad_ranking),
        "the EAGLE head in {d} is unreadable: head.safetensors: its draft_vocab is not a ranking of the 128 ids",
        WRITE,
        {},
    ),
    "another model's head": (
        _edit_config(_another_model),
        "the EAGLE head trained for /models/another does not match the loaded model {model} (fingerprints "
        "0000000000000000 vs ",
        RETRAIN,
        {},
    ),
    "a head of another shape": (
        _edit_config(_set_shape("vocab", 256)),
        "has another shape than the loaded model {model} (vocab 256 vs 128; the head is in {d}); ",
        RETRAIN,
        {},
    ),
    "eagle_draft_vocab past the vocabulary": (
        _copy,
        "eagle_draft_vocab 129 is more than the 128 ids the EAGLE head in {d} ranks (the model's vocabulary): ",
        FEWER,
        {"eagle_draft_vocab": 129},
    ),
}


def _llm_error(loaded: LoadedModel, **spec: Any) -> HeadError:
    with pytest.raises(HeadError) as caught:
        LLM(loaded, speculative_config={"method": "eagle", **spec}, num_pages=16)
    return caught.value


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_one_line_naming_the_head_and_the_fix_from_llm_and_generate(
    fault: str, tiny: LoadedModel, tiny_dir: tuple[Path, Any], tiny_head: Path, tmp_path: Path, cli: Cli
) -> None:
    make, says, fix, options = FAULTS[fault]
    d = tmp_path / "head"
    make(tiny_head, d)
    model = str(tiny_dir[0])
    error = _llm_error(tiny, model=str(d), **options)
    message = str(error)
    assert isinstance(error, ValueError) and isinstance(error, ModelLoadError)
    assert "\n" not in message and str(d) in message, message
    assert says.format(d=d, model=model) in message, message
    assert message.endswith(fix.format(d=d, model=model)), message
    flags = [word for k, v in options.items() for word in (f"--{k.replace('_', '-')}", str(v))]
    result = cli(*GENERATE, "--model", model, "--eagle-head", str(d), *flags)
    assert (result.code, result.out) == (2, "")
    assert result.err == f"mechserve: error: {message}\n"  # the same text, one line


def test_no_head_trained_says_which_train_draft_to_run_everywhere(
    tiny: LoadedModel,
    tiny_dir: tuple[Path, Any],
    tiny_head: Path,
    tmp_path: Path,
    cli: Cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``--eagle-head`` the head is the one ``train-draft`` wrote into the cache: none there is one line
    saying which ``train-draft`` to run, from ``LLM``, ``generate`` and ``bench spec-decode`` alike; a broken
    one there says to run it again."""
    # the cache's head directory, moved here (MECHSERVE_CACHE would also move the built kernels)
    monkeypatch.setattr(eagle, "head_dir", lambda fingerprint: tmp_path / fingerprint[:16])
    model = str(tiny_dir[0])
    looked = tmp_path / eagle.model_fingerprint(tiny.model)[:16]
    message = str(_llm_error(tiny))
    assert message == (
        f"no EAGLE head has been trained for the loaded model {model} (looked in {looked}): run `mechserve "
        f"train-draft --model {model}` first, or name one with --eagle-head DIR"
    )
    result = cli(*GENERATE, "--model", model)
    assert (result.code, result.err) == (2, f"mechserve: error: {message}\n")
    bench = ["bench", "spec-decode", "--model", model, "--prompts", "1", "--max-tokens", "2", "--batches", "1"]
    result = cli(*bench, "--sets", "novel", "--configs", "eagle", "--num-pages", "32")
    assert (result.code, result.err) == (2, f"mechserve: error: configuration eagle: {message}\n")
    shutil.copytree(tiny_head, looked)
    (looked / eagle.CONFIG_FILE).write_text("{")
    message = str(_llm_error(tiny))
    assert message.startswith(f"the EAGLE head in {looked} is unreadable: config.json is not JSON (")
    assert message.endswith(f"; run `mechserve train-draft --model {model}` to write it again")
    shutil.rmtree(looked)
    shutil.copytree(tiny_head, looked)  # written where train-draft writes it, it is found
    with LLM(tiny, speculative_config={"method": "eagle"}, num_pages=16) as llm:
        assert llm.core.speculative is not None and llm.core.speculative.method == "eagle"


def test_bench_spec_decode_names_the_configuration_whose_engine_cannot_be_built(
    tiny_dir: tuple[Path, Any], cli: Cli
) -> None:
    """The same kind of fault for the draft model: more layers than the model has is one line, not an
    internal error."""
    model = str(tiny_dir[0])
    argv = ["bench", "spec-decode", "--model", model, "--prompts", "1", "--max-tokens", "2", "--batches", "1"]
    result = cli(*argv, "--sets", "novel", "--configs", "draft", "--draft-layers", "9", "--num-pages", "32")
    assert result.code == 2 and result.err.count("\n") == 1
    assert result.err.startswith(f"mechserve: error: configuration draft: draft model '{model}:layers=9': layers=9")


def test_async_llm_and_the_server_refuse_at_start(
    tiny: LoadedModel, tiny_dir: tuple[Path, Any], tmp_path: Path, cli: Cli
) -> None:
    """``AsyncLLM`` raises what ``LLM`` raises; ``serve`` prints it as its one line before it binds its port (the
    port is taken here: a server that started anyway would say it cannot bind it)."""
    missing = tmp_path / "nowhere"
    message = str(_llm_error(tiny, model=str(missing)))
    with pytest.raises(HeadError) as caught:
        AsyncLLM(tiny, speculative_config={"method": "eagle", "model": str(missing)}, num_pages=16)
    assert str(caught.value) == message
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["serve", "--model", str(tiny_dir[0]), "--port", port, "--num-pages", "16", "--spec-method", "eagle"]
        result = cli(*argv, "--eagle-head", str(missing))
    assert (result.code, result.err) == (2, f"mechserve: error: {message}\n")


def test_data_parallel_replicas_report_the_same_error(
    tiny: LoadedModel, tiny_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Each replica process loads the head; the one that fails says why, and ``LLM(data_parallel_size=2)`` (as
    ``serve -dp 2``) raises that line."""
    missing = tmp_path / "nowhere"
    message = str(_llm_error(tiny, model=str(missing)))
    spec = {"method": "eagle", "model": str(missing)}
    with pytest.raises(ValueError) as caught:
        LLM(str(tiny_dir[0]), data_parallel_size=2, speculative_config=spec, num_pages=16)
    assert str(caught.value) == message


def test_the_fix_names_the_model_as_train_draft_takes_it(
    tiny: LoadedModel, tiny_dir: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model by its name (not its converted directory in the cache), another by its directory, and
    ``--output`` only for a head named by its directory."""
    assert eagle.train_command(tiny.model) == f"mechserve train-draft --model {tiny_dir[0]}"
    assert eagle.train_command(tiny.model, tmp_path / "a b") == (
        f"mechserve train-draft --model {tiny_dir[0]} --output '{tmp_path / 'a b'}'"
    )
    monkeypatch.setattr(eagle, "embedded_dir", lambda: Path(tiny_dir[0]))
    assert eagle.train_command(tiny.model) == "mechserve train-draft --model smollm2"
