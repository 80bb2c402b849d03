"""``mechserve generate`` sampling flags and ``--chat``, and ``mechserve run --backend torch``, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tiny_engines import VOCAB, hf_greedy

from mechserve.cli.main import main

PROMPT = "w3 w14 w15 w92 w65 w35"
PROMPT_IDS = [3, 14, 15, 92, 65, 35]


def call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def final_json(out: str) -> dict[str, Any]:
    return json.loads(out.splitlines()[-1])


def error_line(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and err.startswith("mechserve: error: "), err
    return err


def test_generate_is_greedy_by_default_and_says_so(tiny_dir, capsys) -> None:
    path, hf = tiny_dir
    rc, out, err = call(["generate", PROMPT, "--model", str(path), "--max-tokens", "5", "--json", "-q"], capsys)
    assert rc == 0, err
    assert final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, PROMPT_IDS, 5)
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "default 0: greedy" in text and "--chat" in text and "--stop TEXT" in text


def test_generate_seeded_sampling_is_repeatable(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    argv = ["generate", PROMPT, "--model", str(path), "--max-tokens", "8", "--json", "-q"]
    argv += ["--temperature", "1.3", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "7"]
    first = final_json(call(argv, capsys)[1])["outputs"][0]["token_ids"]
    second = final_json(call(argv, capsys)[1])["outputs"][0]["token_ids"]
    assert first == second and len(first) == 8


def test_generate_n_logprobs_stop(tiny_dir, capsys) -> None:
    path, hf = tiny_dir
    greedy = hf_greedy(hf, PROMPT_IDS, 6)
    text = "".join(f" w{t}" for t in greedy)
    stop_word = f"w{greedy[3]} "  # a whole word (with the space after it), so "w6" cannot match "w67"
    cut = text.index(stop_word)
    consumed = next(k for k in range(1, 7) if len("".join(f" w{t}" for t in greedy[:k])) >= cut + len(stop_word))
    argv = ["generate", PROMPT, "--model", str(path), "--max-tokens", "6", "--json", "-q"]
    rc, out, err = call([*argv, "--n", "2", "--logprobs", "2", "--stop", stop_word, "--stop", "zz"], capsys)
    assert rc == 0, err
    outputs = final_json(out)["outputs"]
    assert [o["index"] for o in outputs] == [0, 1]
    for o in outputs:
        assert o["finish_reason"] == "stop" and o["stop_reason"] == stop_word
        assert o["text"] == text[:cut] and o["token_ids"] == greedy[:consumed]
        # vLLM's shape: per token, {id: {logprob, rank, decoded_token}}, the chosen id first, then the top 2
        assert [int(next(iter(lp))) for lp in o["logprobs"]] == o["token_ids"] and len(o["logprobs"][0]) in (2, 3)
        first = o["logprobs"][0][str(o["token_ids"][0])]
        assert first["decoded_token"] == f"w{o['token_ids'][0]}" and first["rank"] >= 1
    # A stop string ends a sample with status STOP, not as an abort; the summary says which string.
    summary = final_json(out)["summary"]
    assert [
        (e["request_id"], e["state"], e["finish_reason"], e["generated"], e.get("stop_string")) for e in summary
    ] == [
        ("r0#0", "FINISHED", "STOP", consumed, stop_word),
        ("r0#1", "FINISHED", "STOP", consumed, stop_word),
    ]
    rc, out, err = call([*argv, "--stop-token-id", str(greedy[2])], capsys)
    (o,) = final_json(out)["outputs"]
    end = greedy.index(greedy[2]) + 1
    assert (o["token_ids"], o["finish_reason"], o["stop_reason"]) == (greedy[:end], "stop", greedy[2])


def test_generate_text_view_shows_samples_and_logprobs(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    rc, out, err = call(
        ["generate", PROMPT, "--model", str(path), "--max-tokens", "3", "--n", "2", "--logprobs", "1"], capsys
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert any(line.startswith("[0] " + PROMPT) for line in lines) and any(line.startswith("[1] ") for line in lines)
    assert sum("rank" in line for line in lines) == 6
    assert lines[-1].startswith("6 token(s)") and lines[-1].endswith("finished length, length")


def test_the_trace_line_shows_a_stop_string_finish(tiny_dir, capsys) -> None:
    """A stop string's finish is a finish with status STOP in the step that found it (it was once logged
    as an abort, shown in an otherwise empty extra step); no step line is empty."""
    path, hf = tiny_dir
    greedy = hf_greedy(hf, PROMPT_IDS, 4)
    rc, out, err = call(
        ["generate", PROMPT, "--model", str(path), "--max-tokens", "6", "--stop", f"w{greedy[1]}"], capsys
    )
    assert rc == 0, err
    steps = [line for line in out.splitlines() if line.startswith("step")]
    assert steps[-1].endswith("finished r0=STOP"), steps
    assert not any("aborted" in line for line in steps), steps
    assert all(len(line.split()) > 2 for line in steps), steps


def test_generate_chat_applies_the_template(tiny_dir, capsys) -> None:
    path, hf = tiny_dir
    rc, out, err = call(["generate", "w7 w8", "--chat", "--model", str(path), "--max-tokens", "4", "--json"], capsys)
    assert rc == 0, err
    assert final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, [1, 7, 8, 2, 3], 4)


def test_generate_chat_takes_a_chat_template(tiny_dir, capsys, tmp_path) -> None:
    """``--chat-template`` (vLLM's flag): inline Jinja or a file, instead of the model's; only with ``--chat``."""
    path, hf = tiny_dir
    inline = "{% for m in messages %}w100 {{ m['content'] }}{% endfor %} w101"
    rc, out, err = call(
        ["generate", "w7 w8", "--chat", "--chat-template", inline, "--model", str(path), "--max-tokens", "3", "--json"],
        capsys,
    )
    assert rc == 0, err
    assert final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, [100, 7, 8, 101], 3)
    (tmp_path / "t.jinja").write_text(inline)
    rc, out, err = call(
        [
            "generate",
            "w7 w8",
            "--chat",
            "--chat-template",
            str(tmp_path / "t.jinja"),
            "--model",
            str(path),
            "--max-tokens",
            "3",
            "--json",
        ],
        capsys,
    )
    assert rc == 0 and final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, [100, 7, 8, 101], 3)
    rc, _, err = call(["generate", "w7", "--chat-template", inline, "--model", str(path)], capsys)
    assert rc == 2 and "--chat-template applies to --chat" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--temperature", "hot"], "--temperature: expected a finite number, got 'hot'"),
        (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens: must be in [0, max_tokens=4]"),
        (["--logprobs", "21"], "--logprobs: expected an integer in [0, 20], got '21'"),
        (["--n", "0"], "--n: expected an integer in [1, 64], got '0'"),
        (["--stop", ""], "--stop: must not be empty"),
    ],
)
def test_bad_sampling_flags_are_refused_before_the_model_loads(extra, message, capsys) -> None:
    rc, _, err = call(["generate", PROMPT, "--model", "/no/such/dir", *extra], capsys)
    assert message in error_line(rc, err)


def test_stop_token_id_outside_the_vocabulary(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    rc, out, err = call(["generate", PROMPT, "--model", str(path), "--stop-token-id", str(VOCAB)], capsys)
    assert f"stop_token_ids: {VOCAB} is not a token id of this model" in error_line(rc, err) and out == ""


# mechserve run --backend torch ---------------------------------------------------------------------------------------


def test_run_torch_prints_the_trace_and_the_texts(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    argv = ["run", "--backend", "torch", "--model", str(path), "--request", "a:10:3", "--request", "b:5:2:1"]
    rc, out, err = call(argv, capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("m16 Per-request draft lengths") and "torch backend" in lines[0]
    assert "step 0" in lines and any(line.strip().startswith("tokens") for line in lines)
    text = lines.index("text")
    assert lines[text + 1].startswith('a  " w') and lines[text + 2].startswith('b  " w')
    rc, out, err = call([*argv, "--json"], capsys)
    final = final_json(out)
    assert [s["finish_reason"] for s in final["summary"]] == ["LENGTH", "LENGTH"]
    assert [len(o["token_ids"]) for o in final["outputs"]] == [3, 2]
    steps = [json.loads(line) for line in out.splitlines()[:-1]]
    assert [t for s in steps for t in s["tokens"].get("a", [])] == final["outputs"][0]["token_ids"]


def test_run_torch_spec_file_with_tokens_rejections_and_stop_ids(tiny_dir, tmp_path: Path, capsys) -> None:
    path, hf = tiny_dir
    spec = {
        "engine": {"max_step_tokens": 6, "page_size": 2, "num_pages": 12},
        "requests": [
            {"request_id": "x", "tokens": PROMPT_IDS, "max_new_tokens": 4},
            {"request_id": "big", "prompt_len": 30, "max_new_tokens": 2},
            {"request_id": "s", "tokens": PROMPT_IDS, "max_new_tokens": 8, "arrival_step": 2, "stop_token_ids": []},
        ],
    }
    stop_id = hf_greedy(hf, PROMPT_IDS, 3)[2]
    spec["requests"][2]["stop_token_ids"] = [stop_id]
    file = tmp_path / "w.json"
    file.write_text(json.dumps(spec))
    rc, out, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file), "--json"], capsys)
    assert rc == 0, err
    final = final_json(out)
    assert {s["request_id"]: s["state"] for s in final["summary"]} == {
        "x": "FINISHED",
        "big": "REJECTED",
        "s": "FINISHED",
    }
    outputs = {o["request_id"]: o for o in final["outputs"]}
    assert outputs["x"]["token_ids"] == hf_greedy(hf, PROMPT_IDS, 4)
    assert outputs["s"]["finish_reason"] == "stop" and outputs["s"]["stop_reason"] == stop_id
    assert outputs["s"]["token_ids"][-1] == stop_id and stop_id not in outputs["s"]["token_ids"][:-1]
    assert any(["big", "NEVER_FITS"] in json.loads(line)["rejected"] for line in out.splitlines()[:-1])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request", "a:4:2:0:1"], "eos_after: a real model ends on its own EOS"),
        (["--request", "a:4:2", "--mech", "m05"], "--backend torch runs the top engine rung (m16)"),
        (["--request", "a:4:2", "--world-size", "8"], "world size 8 exceeds the model's 4 attention heads"),
    ],
)
def test_run_torch_refuses_what_only_the_scripted_model_has(tiny_dir, argv, message, capsys) -> None:
    path, _ = tiny_dir
    rc, _, err = call(["run", "--backend", "torch", "--model", str(path), *argv], capsys)
    assert message in error_line(rc, err)


def test_run_torch_refuses_accept_scripts_and_foreign_ids(tiny_dir, tmp_path: Path, capsys) -> None:
    path, _ = tiny_dir
    file = tmp_path / "w.json"
    file.write_text(
        json.dumps({"requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 2, "accept_script": [1]}]})
    )
    rc, _, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file)], capsys)
    assert "has an accept_script" in error_line(rc, err)
    file.write_text(
        json.dumps(
            {"requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 4, "forced_script": {"0": [5]}}]}
        )
    )
    rc, _, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file)], capsys)
    assert "has a forced_script" in error_line(rc, err)
    file.write_text(
        json.dumps({"requests": [{"request_id": "a", "prompt_len": 3, "max_new_tokens": 4, "draft_limit_script": [0]}]})
    )
    rc, _, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file)], capsys)
    assert "has a draft_limit_script" in error_line(rc, err)  # m16: a real run's limits come from its governor
    file.write_text(json.dumps({"requests": [{"request_id": "a", "tokens": [1, VOCAB], "max_new_tokens": 2}]}))
    rc, _, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file)], capsys)
    assert f"tokens holds {VOCAB}, not a token id of the model" in error_line(rc, err)


def test_run_model_needs_the_torch_backend(capsys) -> None:
    rc, _, err = call(["run", "--request", "a:4:2", "--model", "smollm2"], capsys)
    assert "--model needs --backend torch" in error_line(rc, err)


def test_dtype_flag(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    rc, out, err = call(
        ["generate", PROMPT, "--model", str(path), "--max-tokens", "3", "--dtype", "bfloat16", "-q"], capsys
    )
    assert rc == 0 and len(out.split()) == 3, err
    rc, out, err = call(
        ["run", "--backend", "torch", "--model", str(path), "--dtype", "float16", "--request", "a:3:2"], capsys
    )
    assert rc == 0, err
    rc, _, err = call(["run", "--request", "a:4:2", "--dtype", "bfloat16"], capsys)
    assert "--dtype needs --backend torch" in error_line(rc, err)


def test_quantization_flag(tiny_dir, capsys) -> None:
    path, _ = tiny_dir
    for extra in (["--quantization", "q4_1"], ["--quantization", "q8_0", "--dtype", "bfloat16"]):
        argv = ["generate", PROMPT, "--model", str(path), "--max-tokens", "3", "-q", *extra]
        rc, out, err = call(argv, capsys)
        assert rc == 0 and len(out.split()) == 3, err
    rc, _, err = call(
        ["run", "--backend", "torch", "--model", str(path), "--quantization", "q8_0", "--request", "a:3:2"], capsys
    )
    assert rc == 0, err
    rc, _, err = call(
        ["generate", PROMPT, "--model", str(path), "--quantization", "q4_1", "--dtype", "float16"], capsys
    )
    assert "--quantization: quantization q4_1 runs with dtype float32 or bfloat16, not float16" in error_line(rc, err)
    rc, _, err = call(["generate", PROMPT, "--model", str(path), "--quantization", "q4_1", "--world-size", "2"], capsys)
    assert "runs on one rank" in error_line(rc, err)
    rc, _, err = call(["run", "--request", "a:4:2", "--quantization", "q4_1"], capsys)
    assert "--quantization needs --backend torch" in error_line(rc, err)


def test_device_flag_is_checked_and_an_absent_device_is_one_error_line(tiny_dir, capsys) -> None:
    import torch

    path, hf = tiny_dir
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    gen = ["generate", PROMPT, "--model", str(path), "--max-tokens", "3"]
    run = ["run", "--backend", "torch", "--model", str(path), "--request", "a:6:2"]
    for argv in (gen, run):
        rc, _, err = call([*argv, "--device", missing], capsys)
        assert f"device '{missing}' is not available" in error_line(rc, err)
        rc, _, err = call([*argv, "--device", "gpu"], capsys)
        assert "--device: device must be 'cpu', 'cuda' or 'cuda:N'" in error_line(rc, err)
    rc, out, err = call([*gen, "--device", "cpu", "--json", "-q"], capsys)
    assert rc == 0, err
    assert final_json(out)["outputs"][0]["token_ids"] == hf_greedy(hf, PROMPT_IDS, 3)
    rc, _, err = call(["run", "--request", "a:6:2", "--device", "cpu"], capsys)
    assert "--device needs --backend torch" in error_line(rc, err)
    rc, _, err = call(["run", "--request", "a:6:2", "--compile"], capsys)
    assert "--compile needs --backend torch" in error_line(rc, err)


def test_run_torch_honours_prefix_caching_and_the_hold(tiny_dir, tmp_path: Path, capsys) -> None:
    """The engine section's prefix_caching and hold_shared_prefix reach the real engine (EngineConfig): with
    prefix caching off nothing is reused or published; the hold (on by default with --backend torch) admits
    the second of two requests sharing a prompt block only once the first has published it."""
    path, hf = tiny_dir

    def run_torch(**engine: object) -> list[dict[str, Any]]:
        spec = {
            "engine": {"max_step_tokens": 16, "page_size": 2, "num_pages": 16, **engine},
            "requests": [
                {"request_id": "p", "tokens": PROMPT_IDS, "max_new_tokens": 2},
                {"request_id": "r", "tokens": [*PROMPT_IDS[:4], 7, 8], "max_new_tokens": 2},
            ],
        }
        file = tmp_path / "w.json"
        file.write_text(json.dumps(spec))
        rc, out, err = call(["run", "--backend", "torch", "--model", str(path), "--spec", str(file), "--json"], capsys)
        assert rc == 0, err
        final = final_json(out)
        assert [o["token_ids"] for o in final["outputs"]] == [
            hf_greedy(hf, PROMPT_IDS, 2),
            hf_greedy(hf, [*PROMPT_IDS[:4], 7, 8], 2),
        ]
        return [json.loads(line) for line in out.splitlines()[:-1]]

    held = run_torch()
    assert held[0]["admitted"] == ["p"] and held[1]["admitted"] == ["r"] and held[1]["reused"] == {"r": 4}
    unheld = run_torch(hold_shared_prefix=False)
    assert unheld[0]["admitted"] == ["p", "r"]
    off = run_torch(prefix_caching=False)
    assert off[0]["admitted"] == ["p", "r"]  # the hold waits for cached blocks: off with the cache
    assert not any(step["reused"] or step["published"] for step in off)
