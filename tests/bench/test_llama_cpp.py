"""The llama.cpp runner's parts that need no llama-server: finding it, the request, the streamed reply."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mechserve.bench import llama_cpp
from mechserve.bench.runners import LlamaCppRunner


def test_the_request_is_greedy_token_ids_with_no_prompt_cache() -> None:
    body = llama_cpp.completion_body((5, 6, 7), 12)
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }
    json.dumps(body)  # plain JSON types only


def test_a_streamed_reply_gives_each_id_its_arrival_time() -> None:
    # the shape llama-server sends (one event per token, a ping, the stop event with the timings)
    lines = [
        b'data: {"index":0,"content":" Paris","tokens":[7042],"stop":false,"id_slot":-1}\n',
        b"\n",
        b": ping\n",
        b'data: {"index":0,"content":".","tokens":[30],"stop":false,"id_slot":-1}\n',
        b'data: {"index":0,"content":"","tokens":[],"stop":true,"timings":{"prompt_ms":12.5,"predicted_ms":3.0}}\n',
    ]
    clock = iter([1.0, 2.0, 3.0])
    done = llama_cpp.read_completion(lines, clock=lambda: next(clock))
    assert done.tokens == [7042, 30]
    assert done.token_times == [1.0, 2.0]
    assert done.timings == {"prompt_ms": 12.5, "predicted_ms": 3.0}


def test_a_reply_without_its_stop_event_or_with_an_error_is_refused() -> None:
    with pytest.raises(ValueError, match="ended before its stop event"):
        llama_cpp.read_completion([b'data: {"tokens":[1],"stop":false}\n'])
    with pytest.raises(ValueError, match="llama-server error"):
        llama_cpp.read_completion([b'data: {"error":{"code":400,"message":"bad"}}\n'])
    with pytest.raises(ValueError, match="unexpected line"):
        llama_cpp.parse_event("HTTP/1.1 500")


def _fake_tool(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_not_found_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path / "cache"))
    message = llama_cpp.missing_message()
    assert message is not None and message.startswith("llama-cpp skipped: llama-server not found")
    assert "LLAMA_SERVER" in message and "make llama-cpp" in message and str(tmp_path / "cache") in message
    assert LlamaCppRunner("exact").available() == message
    # A binary asked for by name that is not there is an error, not a skip with exit 0 (a new user's trial).
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(OSError, match="is not an executable file"):
        llama_cpp.missing_message()
    with pytest.raises(OSError, match="is not an executable file"):
        LlamaCppRunner("exact").available()


def test_found_on_the_variable_on_path_or_in_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(llama_cpp.SERVER_ENV, raising=False)
    built = llama_cpp.build_bin()
    built.mkdir(parents=True)
    _fake_tool(built / "llama-server")
    assert llama_cpp.find_tool() == built / "llama-server"
    assert llama_cpp.missing_message() is None
    on_path = tmp_path / "bin"
    on_path.mkdir()
    _fake_tool(on_path / "llama-server")
    monkeypatch.setenv("PATH", str(on_path))
    assert llama_cpp.find_tool() == on_path / "llama-server"
    given = _fake_tool(tmp_path / "my-llama-server")
    _fake_tool(tmp_path / "llama-quantize")
    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(given))
    assert llama_cpp.find_tool() == given
    assert llama_cpp.find_tool("llama-quantize") == tmp_path / "llama-quantize"  # a sibling of $LLAMA_SERVER
    assert os.access(given, os.X_OK)


def test_the_build_is_cpu_only_and_avoids_amx_only_where_the_cpu_has_it(tmp_path: Path) -> None:
    assert llama_cpp.amx_flags("flags\t: fpu avx512f avx512_bf16") == ()
    assert llama_cpp.amx_flags("flags\t: fpu amx_bf16 amx_tile amx_int8") == llama_cpp.AMX_FLAGS
    cmd = llama_cpp.cmake_arguments(tmp_path / "src", tmp_path / "build", llama_cpp.AMX_FLAGS)
    assert cmd[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert "-DGGML_CUDA=OFF" in cmd and "-DLLAMA_USE_PREBUILT_UI=OFF" in cmd  # nothing fetched while building
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in cmd


def test_a_named_llama_server_that_is_not_there_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mechserve.cli.main import main

    monkeypatch.setenv(llama_cpp.SERVER_ENV, str(tmp_path / "nowhere" / "llama-server"))
    argv = ["bench", "run", "--quick", "--workload", "latency", "--engine", "llama-cpp", "--no-roofline"]
    assert main([*argv, "--no-plots", "--out", str(tmp_path / "out")]) == 2
    # (a fresh cache first says it converts the embedded model: that line is progress, not the error)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "converting the embedded" not in line]
    assert len(err) == 1 and "LLAMA_SERVER=" in err[0] and "is not an executable file" in err[0], err
