"""``mechserve.LLM`` on the tiny random Llama (word tokenizer ``w0`` .. ``w127``): generate, chat, errors, trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_engines import VOCAB, hf_greedy, random_prompts, words

from mechserve.api.params import SamplingParams
from mechserve.entrypoints.llm import LLM, RequestsRejected
from mechserve.model.loader import torch_dtype

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(tiny, page_size=4, num_pages=64, max_step_tokens=32)


@pytest.fixture(autouse=True)
def pages_come_back(request: pytest.FixtureRequest):
    """After every test on the shared ``llm``: the pool is consistent and no page is private."""
    yield
    if "llm" in request.fixturenames:
        core = request.getfixturevalue("llm").core
        core.check_pages()
        assert core.stats().pages.private == 0 and not core.has_unfinished()


def test_generate_strings_and_ids_in_input_order(llm: LLM, tiny_hf) -> None:
    prompts = random_prompts([9, 2, 15, 5], seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (8, 1, 3, 12)]  # they end in another order
    outs = llm.generate([words(p) for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.prompt for o in outs] == [words(p) for p in prompts]
    for o, p, sp in zip(outs, prompts, params):
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, p, sp.max_tokens)
        assert o.outputs[0].text == "".join(f" w{t}" for t in o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length" and o.finished
    by_ids = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt is None for o in by_ids)
    (one,) = llm.generate(prompts[0], GREEDY, use_tqdm=False)  # one prompt as a list of ints
    assert one.prompt_token_ids == prompts[0]
    (text,) = llm.generate(words(prompts[0]), GREEDY, use_tqdm=False)
    (as_dict,) = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    assert text.outputs[0].token_ids == as_dict.outputs[0].token_ids == one.outputs[0].token_ids
    llm.core.check_pages()


def test_default_params_are_vllms(llm: LLM) -> None:
    (out,) = llm.generate([1, 2, 3], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16  # max_tokens 16, temperature 1.0 (the tiny model has no EOS)
    assert SamplingParams().temperature == 1.0


def test_n_samples(llm: LLM) -> None:
    outs = llm.generate(["w1 w2 w3", "w4"], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    again = llm.generate(["w1 w2 w3", "w4"], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in again]
    llm.core.check_pages()


def test_prefix_caching_on_and_off_give_the_same_greedy_ids(tiny, tiny_hf) -> None:
    shared = random_prompts([23], seed=2)[0]
    prompts = [shared + tail for tail in random_prompts([1, 4, 7, 2], seed=3)]
    results = {}
    for caching in (True, False):
        llm = LLM(tiny, page_size=4, num_pages=64, prefix_caching=caching)
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # publishes the shared blocks
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        reused = sum(sum(r.reused.values()) for r in llm.trace)
        assert (reused > 0) == caching
        llm.core.check_pages()
    assert results[True] == results[False] == [hf_greedy(tiny_hf, p, 6) for p in prompts]


def test_bad_inputs_are_rejected_and_the_others_complete(llm: LLM, tiny_hf) -> None:
    good = random_prompts([4, 8], seed=4)
    prompts = [good[0], [], [VOCAB + 1, 3], [1] * 300, good[1], [1, 2]]
    params = [GREEDY, GREEDY, GREEDY, SamplingParams(max_tokens=300), GREEDY, SamplingParams(stop_token_ids=[10**6])]
    with pytest.raises(RequestsRejected) as info:
        llm.generate(prompts, params, use_tqdm=False)
    err = info.value
    assert isinstance(err, ValueError) and sorted(err.errors) == [1, 2, 3, 5]
    assert "EMPTY_PROMPT" in str(err.errors[1]) and f"prompt token id {VOCAB + 1}" in str(err.errors[2])
    assert "TOO_LONG" in str(err.errors[3]) and "stop_token_ids: 1000000" in str(err.errors[5])
    assert "4 of 6 prompt(s) rejected at submission" in str(err)
    assert [o is None for o in err.outputs] == [False, True, True, True, False, True]
    assert err.outputs[0].outputs[0].token_ids == hf_greedy(tiny_hf, good[0], 6)
    assert err.outputs[4].outputs[0].token_ids == hf_greedy(tiny_hf, good[1], 6)
    llm.core.check_pages()
    assert llm.core.stats().pages.private == 0
    assert (
        llm.generate([good[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == err.outputs[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
    ],
)
def test_bad_sampling_params_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_wrong_call_shapes_fail_at_once(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompt"):
        llm.generate(["w1", "w2", "w3"], [GREEDY, GREEDY], use_tqdm=False)
    # A new user's trial: a string here was read as 9 SamplingParams.
    with pytest.raises(TypeError, match="must be SamplingParams or a list of them, got str"):
        llm.generate("w1", "notparams", use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got a dict in it"):
        llm.generate(["w1"], [{"temperature": 0}], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="a prompt must be a string or a list of token ids"):
        llm.generate([[1, 2], 3.5], use_tqdm=False)
    assert llm.generate([], use_tqdm=False) == []


def test_chat_applies_the_template(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    (out,) = llm.chat([{"role": "user", "content": "w7 w8"}], GREEDY, use_tqdm=False)
    assert out.prompt == "w1 w7 w8 w2 w3"
    assert out.prompt_token_ids == [1, 7, 8, 2, 3]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    both = llm.chat(
        [[{"role": "user", "content": "w9"}], [{"role": "user", "content": "w10"}]],
        GREEDY,
        use_tqdm=False,
        add_generation_prompt=False,
    )
    assert [o.prompt_token_ids for o in both] == [[1, 9, 2], [1, 10, 2]]
    monkeypatch.setattr(llm.core.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "w1"}], use_tqdm=False)


def test_trace_is_the_last_call_or_everything(tiny) -> None:
    llm = LLM(tiny, page_size=4, num_pages=32)
    llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    first = list(llm.trace)
    llm.generate([4, 5, 6], GREEDY, use_tqdm=False)
    assert llm.trace[0].step == first[-1].step + 1  # replaced: only the last call's records
    assert all(r.step == i + llm.trace[0].step for i, r in enumerate(llm.trace))
    assert [r.to_json()["step"] for r in llm.trace] == [r.step for r in llm.trace]
    keep = LLM(tiny, page_size=4, num_pages=32, trace=True)
    keep.generate([1, 2, 3], GREEDY, use_tqdm=False)
    keep.generate([4, 5, 6], GREEDY, use_tqdm=False)
    assert [r.step for r in keep.trace] == list(range(len(keep.trace)))
    assert {"0", "1"} <= {rid for r in keep.trace for rid in r.admitted}


def test_progress_bar_on_stderr(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["w1 w2", "w3"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "output tok/s" in err
    llm.generate(["w1 w2", "w3"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_dtype_is_selectable(tiny_dir, tiny_hf) -> None:
    path, _ = tiny_dir
    assert torch_dtype("auto") is torch.float32 and torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_dtype("int8")
    half = LLM(str(path), dtype="bfloat16", page_size=4, num_pages=16)
    assert half.core.model.dtype is torch.bfloat16
    (out,) = half.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    full = LLM(Path(path), page_size=4, num_pages=16)
    assert full.core.model.dtype is torch.float32
    assert full.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_hf, [1, 2, 3], 6)


def test_kv_memory_sizes_the_pool(tiny) -> None:
    from mechserve.engine.pool import page_bytes

    per_page = page_bytes(tiny.model, 4)
    llm = LLM(tiny, page_size=4, kv_memory=10 * per_page + 1)
    assert (llm.core.num_pages, llm.core.sized_by) == (10, "kv_memory")
    auto = LLM(tiny, page_size=16)
    assert auto.core.sized_by == "auto" and auto.core.num_pages * 16 >= 512  # at least one full context


def test_kv_memory_takes_a_size_string_as_the_cli_does(tiny) -> None:
    """The trial: ``LLM(kv_memory="512MiB")`` was a raw TypeError; it takes ``--kv-memory``'s sizes."""
    from mechserve.engine.pool import page_bytes

    llm = LLM(tiny, page_size=4, kv_memory="512KiB")
    assert (llm.core.num_pages, llm.core.sized_by) == ((512 << 10) // page_bytes(tiny.model, 4), "kv_memory")
    (out,) = llm.generate(["w1 w2 w3"], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="kv_memory: expected a size such as 512MiB or 2GiB, got 'lots'"):
        LLM(tiny, kv_memory="lots")


def test_import_mechserve_never_imports_torch() -> None:
    code = (
        "import sys, mechserve, mechserve.spec, mechserve.spec.m12_admission_control, mechserve.engine.detokenizer\n"
        "import mechserve.api.outputs\n"
        "from mechserve import SamplingParams\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert mechserve.LLM.__name__ == 'LLM' and 'torch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
