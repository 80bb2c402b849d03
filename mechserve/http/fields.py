"""Every request field of the server's APIs, in one table: the code's single source, rendered as docs/api-fields.md.

The table lists the fields of OpenAI's completions, chat completions and Responses APIs, vLLM's
extensions of them, llama.cpp server's sampling names and Anthropic's Messages API.  Each row says, per endpoint, whether the server
**honours** the field (and what it becomes: a ``SamplingParams`` field, a prompt option, a response
option) or **refuses** it, and why.  ``mechserve.http.protocol`` decides from it::

    a field outside the table                    a 400 naming it, code ``unsupported_parameter``
                                                 (``mechserve.http.unknown``; ``serve
                                                 --ignore-unknown-fields`` ignores it instead)
    an honoured field                            typed and range-checked by the endpoint's pydantic
                                                 model (a 400 naming it when it is wrong), then used;
                                                 ``refused_values`` are the values it still refuses
    a refused field with a neutral value          accepted: null, or a value that changes nothing
                                                 (``use_beam_search: false``, ``mirostat: 0``, ...)
    a refused field with any other value          a 400 naming it (``param``), code
                                                 ``unsupported_parameter``

``docs/api-fields.md`` is ``render_markdown()``; ``make api-fields`` rewrites it and a test checks that
the two agree.  Another test checks that the pydantic models
have exactly the honoured fields of the table, and walks the table sending each row's ``bad``
value to check that the 400 names the row's field.

Standard library only (and ``mechserve.api.limits``, whose numbers the rows quote).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mechserve.api.limits import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS_IDS,
    MAX_RENDER_CHARS,
    MAX_STOP_CHARS,
    MIN_PROMPT_CHARS,
    RENDER_MEMORY_BYTES,
    RENDER_TIMEOUT_S,
)

COMPLETIONS = "completions"
CHAT = "chat"
BOTH = (COMPLETIONS, CHAT)
RESPONSES = "responses"  # OpenAI's Responses API (mechserve.http.responses_protocol)
MESSAGES = "messages"  # Anthropic's Messages API (mechserve.http.anthropic_protocol)
COUNT_TOKENS = "count_tokens"  # Anthropic's token count of a Messages body
ANTHROPIC_BOTH = (MESSAGES, COUNT_TOKENS)
ENDPOINT_PATHS = {
    COMPLETIONS: "/v1/completions",
    CHAT: "/v1/chat/completions",
    RESPONSES: "/v1/responses",
    MESSAGES: "/v1/messages",
    COUNT_TOKENS: "/v1/messages/count_tokens",
}

OPENAI = "OpenAI"
VLLM = "vLLM"
LLAMA_CPP = "llama.cpp"
ANTHROPIC = "Anthropic"


@dataclass(frozen=True, slots=True)
class Field:
    """One row of the table.

    ``name`` on ``endpoints``, from ``origin``.  ``honoured``: what the field does here (it is then a
    field of the endpoint's pydantic model); else ``why`` the server refuses it.  ``neutral``: the
    values accepted although the field is refused (null is always accepted), ``neutral_note`` says
    so in words when a rule decides (``when_neutral(body)``: the other fields make any value
    neutral).  ``refused_values``: for an honoured field, the values it still refuses.  ``bad``:
    a body fragment that the server answers with a 400 naming this field (the table's own test).
    """

    name: str
    endpoints: tuple[str, ...]
    origin: str
    honoured: str = ""
    why: str = ""
    neutral: tuple[Any, ...] = ()
    neutral_note: str = ""
    when_neutral: Callable[[Mapping[str, Any]], bool] | None = None
    refused_values: str = ""
    bad: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_honoured(self) -> bool:
        return bool(self.honoured)

    def is_neutral(self, value: Any, body: Mapping[str, Any]) -> bool:
        """Whether a refused field's ``value`` changes nothing (null, a neutral value, or the rule says so)."""
        if value is None or any(_same(value, n) for n in self.neutral):
            return True
        return self.when_neutral is not None and self.when_neutral(body)

    def refusal(self) -> str:
        """The 400's message for a non-neutral value of this refused field."""
        accepted = ", ".join(_json(n) for n in self.neutral)
        hint = f" (accepted: null{', ' + accepted if accepted else ''}{'; ' + self.neutral_note if self.neutral_note else ''})"
        return f"{self.name} is {self.why}{hint}"


def _same(a: Any, b: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``false`` is not ``0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def _unset(*names: str, neutral: Mapping[str, Any] | None = None) -> Callable[[Mapping[str, Any]], bool]:
    """A ``when_neutral`` rule: true while each of ``names`` is absent, null or its neutral value."""
    neutral = neutral or {}

    def rule(body: Mapping[str, Any]) -> bool:
        return all(body.get(n) is None or (n in neutral and _same(body[n], neutral[n])) for n in names)

    return rule


_NO_PENALTY = _unset(
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    neutral={"repeat_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0},
)
_SP = "SamplingParams."


def _sampler(switch: str, why: str, off: tuple[Any, ...], on: Any, **options: Any) -> tuple[Field, ...]:
    """A llama.cpp sampler the server refuses (``why``): the row of its ``switch`` (neutral at ``off``), then a
    row per option (``options``: each one's bad value), each neutral whatever its value while the switch is
    0; ``on`` is a value that turns the switch on (every row's ``bad`` sends it)."""
    rule = _unset(switch, neutral={switch: 0})
    return (
        _f(switch, BOTH, LLAMA_CPP, why=why, neutral=off, bad={switch: on}),
        *(
            _f(
                name,
                BOTH,
                LLAMA_CPP,
                why=why,
                neutral_note=f"any value while {switch} is 0",
                when_neutral=rule,
                bad={name: value, switch: on},
            )
            for name, value in options.items()
        ),
    )


_PROMPT_CHARS = (
    "text longer than `max_model_len` x the longest vocabulary entry's characters (at least "
    f"{MIN_PROMPT_CHARS}) is refused before it is tokenized"
)
_CONSTRAINT = (
    f"at most {MAX_GRAMMAR_CHARS} characters; compiled and checked as the step will use it before the request is "
    "admitted, so a constraint with no possible output or over the grammar engine's limits is a 400 saying why"
)
_SPECIALS_AS_TEXT = (
    "special-token strings in them (`<|im_end|>`) are encoded as text, so no message can forge a turn (vLLM and "
    "llama-server parse them; `--allow-special-tokens-in-content` does too)"
)
_REQUEST_TEMPLATE = (
    "a Jinja chat template for this request instead of the model's, only when the server runs with "
    "`--trust-request-chat-template` (vLLM's flag; also on chat `/tokenize`): rendered in a sandbox process, "
    f"at most {RENDER_TIMEOUT_S:g} s, {RENDER_MEMORY_BYTES >> 20} MiB and {MAX_RENDER_CHARS} characters "
    "(and the prompt's own limit)"
)


def _f(name: str, endpoints: tuple[str, ...], origin: str, **kw: Any) -> Field:
    kw.setdefault("bad", {})
    return Field(name, endpoints, origin, **kw)


def _request_template(endpoints: tuple[str, ...], where: str = "") -> Field:
    """vLLM's ``chat_template`` row on ``endpoints`` (``where``: how the field reaches the chat path, if not
    directly): honoured only when the server trusts request templates."""
    return _f(
        "chat_template",
        endpoints,
        VLLM,
        honoured=where + _REQUEST_TEMPLATE,
        refused_values="any template, with a 400 naming the flag, unless the server trusts request templates",
        bad={"chat_template": "{{ x }}"},
    )


FIELDS: tuple[Field, ...] = (
    # --- OpenAI: what the request is ------------------------------------------------------------------------------
    _f(
        "model",
        BOTH,
        OPENAI,
        honoured="the served model's name (`--served-model-name`); another name is a 404",
        bad={"model": 5},
    ),
    _f(
        "prompt",
        (COMPLETIONS,),
        OPENAI,
        honoured="text, token ids, or a list of either (at most 256 prompts; `n` samples each); " + _PROMPT_CHARS,
        bad={"prompt": {"text": "w1"}},
    ),
    _f(
        "messages",
        (CHAT,),
        OPENAI,
        honoured="the conversation, through the model's chat template: roles `system`, `developer` (as system), "
        "`user`, `assistant`, `tool`; content a string or text parts; `name` is passed to the template; an "
        "assistant's `tool_calls` and `tool` messages (with `tool_call_id`) are rendered by a template that "
        "renders tools (as with `tools`); "
        + _SPECIALS_AS_TEXT
        + "; their strings and the rendered conversation: "
        + _PROMPT_CHARS,
        refused_values="an assistant's `function_call` (the deprecated functions API), a call's `arguments` that "
        "are not the JSON text of an object, a tool message without `tool_call_id`, an assistant's `refusal` "
        "(give it as content), image and audio parts",
        bad={"messages": []},
    ),
    # --- OpenAI: sampling -----------------------------------------------------------------------------------------
    _f(
        "max_tokens",
        BOTH,
        OPENAI,
        honoured=_SP + "max_tokens; completions default 16; chat default: until EOS or the context is full; "
        "0 with `echo` scores the prompt only",
        bad={"max_tokens": -1},
    ),
    _f(
        "max_completion_tokens",
        (CHAT,),
        OPENAI,
        honoured=_SP + "max_tokens (the newer name of `max_tokens`)",
        refused_values="beside a `max_tokens` or `n_predict` of another value (vLLM silently takes this one)",
        bad={"max_completion_tokens": -5},
    ),
    _f(
        "n",
        BOTH,
        OPENAI,
        honoured=_SP + "n: 1..64 independent samples (with a seed, sample j uses seed + j)",
        refused_values="more samples than `--max-waiting` requests (they could never all be admitted)",
        bad={"n": 0},
    ),
    _f(
        "best_of",
        (COMPLETIONS,),
        OPENAI,
        honoured="equal to `n` (each sample is drawn once; nothing is ranked)",
        refused_values="any other value",
        bad={"best_of": 3},
    ),
    _f(
        "temperature",
        BOTH,
        OPENAI,
        honoured=_SP + "temperature in [0, 2]; 0 is greedy; default 1",
        bad={"temperature": 2.5},
    ),
    _f("top_p", BOTH, OPENAI, honoured=_SP + "top_p in (0, 1]", bad={"top_p": 0}),
    _f(
        "seed",
        BOTH,
        OPENAI,
        honoured=_SP + "seed: any 64-bit signed integer; the request's draws depend on (seed, token index) alone; "
        "-1 is unseeded (vLLM's and llama.cpp's convention; generate --seed takes the same)",
        bad={"seed": "x"},
    ),
    _f(
        "stop",
        BOTH,
        OPENAI,
        honoured=_SP + f"stop: a string or at most 16 strings of at most {MAX_STOP_CHARS} characters, never in "
        "the text",
        bad={"stop": 5},
    ),
    _f(
        "presence_penalty",
        BOTH,
        OPENAI,
        honoured=_SP + "presence_penalty in [-2, 2]: subtracted from the logit of every id in the output so far",
        bad={"presence_penalty": 3},
    ),
    _f(
        "frequency_penalty",
        BOTH,
        OPENAI,
        honoured=_SP + "frequency_penalty in [-2, 2]: subtracted once per occurrence in the output so far",
        bad={"frequency_penalty": -2.5},
    ),
    _f(
        "logit_bias",
        BOTH,
        OPENAI,
        honoured=_SP + f"logit_bias: at most {MAX_LOGIT_BIAS_IDS} {{token id: bias in [-100, 100]}} added to the "
        "logits; ids checked against the vocabulary",
        refused_values="llama.cpp's array form `[[id, bias]]`",
        bad={"logit_bias": {"5": 101}},
    ),
    _f(
        "logprobs",
        (COMPLETIONS,),
        OPENAI,
        honoured=_SP + "logprobs: the top N (0..20) alternatives of each output token, raw (before "
        "temperature and penalties); with `echo`, of each prompt token too",
        bad={"logprobs": 21},
    ),
    _f("logprobs", (CHAT,), OPENAI, honoured=_SP + "logprobs (with `top_logprobs`, default 0)", bad={"logprobs": 1}),
    _f(
        "top_logprobs",
        (CHAT,),
        OPENAI,
        honoured="0..20 alternatives per token; needs `logprobs: true`",
        bad={"top_logprobs": 21, "logprobs": True},
    ),
    _f(
        "echo",
        (COMPLETIONS,),
        OPENAI,
        honoured="the prompt's text before the completion's, and with `logprobs` the prompt tokens' logprobs "
        "first (the first is null), as evaluation harnesses score log-likelihoods",
        refused_values="with `stream`, `n` > 1 and `logprobs` together",
        bad={"echo": "yes"},
    ),
    _f(
        "suffix",
        (COMPLETIONS,),
        OPENAI,
        why="not supported: no fill-in-the-middle insertion",
        neutral=("",),
        bad={"suffix": "w3"},
    ),
    _f(
        "stream",
        BOTH,
        OPENAI,
        honoured="server-sent events in OpenAI's chunk format, ending with `data: [DONE]`",
        bad={"stream": "yes"},
    ),
    _f(
        "stream_options",
        BOTH,
        OPENAI,
        honoured="`include_usage`: a last chunk with the usage (only with `stream`)",
        bad={"stream_options": {"include_usage": "yes"}},
    ),
    _f(
        "user",
        BOTH,
        OPENAI,
        honoured="accepted; it names the end user to OpenAI and changes nothing here",
        bad={"user": 5},
    ),
    # --- OpenAI chat only -----------------------------------------------------------------------------------------
    _f(
        "response_format",
        BOTH,
        OPENAI,
        honoured='`{"type": "text"}` (unconstrained), `{"type": "json_object"}` (any JSON object) or '
        '`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (the output follows `schema`, '
        "enforced token by token, with `strict` true or false) -> " + _SP + "structured_outputs; a schema that "
        "does not compile is a 400 naming the problem (on completions, a vLLM extension); " + _CONSTRAINT,
        bad={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
    ),
    _f(
        "tools",
        (CHAT,),
        OPENAI,
        honoured="function tools, rendered into the prompt by the chat template (the model's or "
        "`--chat-template`'s when it uses `tools`, else the shipped ChatML tools template); the reply's "
        '`<tool_call>{"name", "arguments"}</tool_call>` blocks come back as `tool_calls` with `finish_reason` '
        '`"tool_calls"`, also streamed as `delta.tool_calls`; with `strict: true` an `auto` call whose arguments '
        "do not validate under the function's schema stays text",
        refused_values="other kinds than `function`, a name outside `[A-Za-z0-9_-]{1,64}` or given twice, "
        "`parameters` that are not a valid JSON schema of an object, more than 128 tools, a model whose "
        "template renders no tools and is not ChatML",
        bad={"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
    ),
    _f(
        "tool_choice",
        (CHAT,),
        OPENAI,
        honoured='`"none"` (the tools are not rendered; a plain reply), `"auto"` (the default with tools: calls '
        'parsed from the text), `"required"` (the grammar forces a JSON list of calls, each valid under its '
        'function\'s `parameters`), `{"type": "function", "function": {"name"}}` (the grammar forces that '
        "function's arguments)",
        refused_values="another value, `required` or a function without `tools`, a name that is not a tool's, "
        "together with another output constraint",
        bad={"tool_choice": "required"},
    ),
    _f(
        "parallel_tool_calls",
        (CHAT,),
        OPENAI,
        honoured="default true; false: at most one call (`auto` stops at the first call's end, `required` "
        "forces a list of one)",
        bad={"parallel_tool_calls": "x"},
    ),
    _f(
        "functions",
        (CHAT,),
        OPENAI,
        why="not supported: the deprecated functions API; give `tools`",
        neutral=([],),
        bad={"functions": [{"name": "f"}]},
    ),
    _f(
        "function_call",
        (CHAT,),
        OPENAI,
        why="not supported: the deprecated functions API; give `tool_choice`",
        neutral=("none", "auto"),
        bad={"function_call": {"name": "f"}},
    ),
    _f(
        "metadata",
        (CHAT,),
        OPENAI,
        honoured="accepted; OpenAI keeps it with stored completions, and nothing is stored here",
        bad={"metadata": "x"},
    ),
    _f(
        "store",
        (CHAT,),
        OPENAI,
        why="not supported: this server stores no completions",
        neutral=(False,),
        bad={"store": True},
    ),
    _f(
        "service_tier",
        (CHAT,),
        OPENAI,
        why="not supported: there is one tier",
        neutral=("auto", "default"),
        bad={"service_tier": "flex"},
    ),
    _f(
        "modalities",
        (CHAT,),
        OPENAI,
        why="not supported: text is the only output",
        neutral=(["text"],),
        bad={"modalities": ["text", "audio"]},
    ),
    _f("audio", (CHAT,), OPENAI, why="not supported: text is the only output", bad={"audio": {"voice": "alloy"}}),
    _f(
        "prediction",
        (CHAT,),
        OPENAI,
        why="not supported: predicted outputs (speculation uses prompt lookup, suffix decoding, a draft model or "
        "an EAGLE head instead: serve --spec-method ngram, suffix, draft or eagle)",
        bad={"prediction": {"type": "content", "content": "w1"}},
    ),
    _f(
        "reasoning_effort",
        (CHAT,),
        OPENAI,
        why="not supported: the models served do not reason",
        bad={"reasoning_effort": "high"},
    ),
    _f("verbosity", (CHAT,), OPENAI, why="not supported", bad={"verbosity": "low"}),
    _f("web_search_options", (CHAT,), OPENAI, why="not supported: no web search", bad={"web_search_options": {}}),
    _f("moderation", (CHAT,), OPENAI, why="not supported: no moderation model", bad={"moderation": {"model": "m"}}),
    _f(
        "prompt_cache_retention",
        (CHAT,),
        OPENAI,
        why="not supported beyond `in_memory`: the prefix cache lives in memory, its pages evicted as needed",
        neutral=("in_memory",),
        bad={"prompt_cache_retention": "24h"},
    ),
    _f(
        "prompt_cache_options",
        (CHAT,),
        OPENAI,
        why="not supported: the prefix cache is automatic (no explicit mode, lifetimes or prewarming)",
        neutral=({},),
        bad={"prompt_cache_options": {"mode": "explicit"}},
    ),
    _f(
        "prompt_cache_key",
        (CHAT,),
        OPENAI,
        honoured="accepted; the prefix cache is keyed by the prompt's own tokens, so no key is needed",
        bad={"prompt_cache_key": 5},
    ),
    _f(
        "safety_identifier", (CHAT,), OPENAI, honoured="accepted; it changes nothing here", bad={"safety_identifier": 5}
    ),
    # --- vLLM's extensions (in the openai client: extra_body) ------------------------------------------------------
    _f("top_k", BOTH, VLLM, honoured=_SP + "top_k: the k most likely ids (0 or -1: off)", bad={"top_k": -2}),
    _f("min_p", BOTH, VLLM, honoured=_SP + "min_p in [0, 1]", bad={"min_p": 2}),
    _f(
        "repetition_penalty",
        BOTH,
        VLLM,
        honoured=_SP + "repetition_penalty > 0 (1: off): every id in the prompt or the output so far has a "
        "positive logit divided by it, a negative one multiplied",
        bad={"repetition_penalty": 0},
    ),
    _f(
        "min_tokens",
        BOTH,
        VLLM,
        honoured=_SP + "min_tokens: no EOS or stop before this many tokens",
        bad={"min_tokens": 5},
    ),
    _f("ignore_eos", BOTH, VLLM, honoured=_SP + "ignore_eos", bad={"ignore_eos": "x"}),
    _f(
        "stop_token_ids",
        BOTH,
        VLLM,
        honoured=_SP + "stop_token_ids, checked against the vocabulary",
        bad={"stop_token_ids": [1 << 30]},
    ),
    _f(
        "include_stop_str_in_output",
        BOTH,
        VLLM,
        honoured=_SP + "include_stop_str_in_output",
        bad={"include_stop_str_in_output": 1},
    ),
    _f("skip_special_tokens", BOTH, VLLM, honoured=_SP + "skip_special_tokens", bad={"skip_special_tokens": 1}),
    _f(
        "spaces_between_special_tokens",
        BOTH,
        VLLM,
        why="not supported: special tokens are decoded as the tokenizer decodes them",
        neutral=(True,),
        bad={"spaces_between_special_tokens": False},
    ),
    _f(
        "allowed_token_ids",
        BOTH,
        VLLM,
        honoured=_SP + "allowed_token_ids: only these ids can be sampled (checked against the vocabulary)",
        refused_values="an empty list",
        bad={"allowed_token_ids": []},
    ),
    _f(
        "bad_words",
        BOTH,
        VLLM,
        honoured=_SP + "bad_words: strings, tokenized as vLLM does; a one-token word is never sampled, a longer "
        "word's last token is banned right after its other tokens",
        bad={"bad_words": [""]},
    ),
    _f(
        "prompt_logprobs",
        BOTH,
        VLLM,
        honoured=_SP + "prompt_logprobs: the top N (0..20) at every prompt position, in vLLM's shape "
        "(`prompt_logprobs` in each completions choice, at the top of a chat response)",
        refused_values="with `stream` and `n` > 1 together",
        bad={"prompt_logprobs": 21},
    ),
    _f(
        "truncate_prompt_tokens",
        BOTH,
        VLLM,
        honoured=_SP + "truncate_prompt_tokens: keep the prompt's last k tokens (-1: the model's context)",
        refused_values="more than the model's context (max_model_len), as vLLM refuses it",
        bad={"truncate_prompt_tokens": 0},
    ),
    _f(
        "add_special_tokens",
        BOTH,
        VLLM,
        honoured="whether the tokenizer adds its special tokens to the text (completions default true; chat "
        "default false: the template writes them)",
        bad={"add_special_tokens": "x"},
    ),
    _f(
        "add_generation_prompt",
        (CHAT,),
        VLLM,
        honoured="open the assistant's turn in the template (default true)",
        bad={"add_generation_prompt": "x"},
    ),
    _f(
        "continue_final_message",
        (CHAT,),
        VLLM,
        honoured="leave the last message open, so the reply continues it (needs `add_generation_prompt: false`)",
        bad={"continue_final_message": True},
    ),
    _f(
        "chat_template_kwargs",
        (CHAT,),
        VLLM,
        honoured="more variables for the chat template (not its own arguments such as `tokenize`)",
        bad={"chat_template_kwargs": {"tokenize": True}},
    ),
    _f(
        "request_id",
        BOTH,
        VLLM,
        honoured="the engine's request id and the response id's suffix (a running id is a 400)",
        bad={"request_id": 5},
    ),
    _f(
        "return_tokens_as_token_ids",
        BOTH,
        VLLM,
        honoured='logprobs name tokens as `"token_id:<id>"`',
        bad={"return_tokens_as_token_ids": "x"},
    ),
    _f(
        "return_token_ids",
        BOTH,
        VLLM,
        honoured="each choice also carries `prompt_token_ids` and `token_ids`",
        bad={"return_token_ids": "x"},
    ),
    _f(
        "use_beam_search",
        BOTH,
        VLLM,
        why="not supported: no beam search",
        neutral=(False,),
        bad={"use_beam_search": True},
    ),
    _f(
        "length_penalty",
        BOTH,
        VLLM,
        why="not supported: it scores beams, and there is no beam search",
        neutral=(1, 1.0),
        bad={"length_penalty": 2.0},
    ),
    _f(
        "priority",
        BOTH,
        VLLM,
        why="not supported: requests are admitted first come, first served (m12)",
        neutral=(0,),
        bad={"priority": 1},
    ),
    _f(
        "logits_processors",
        BOTH,
        VLLM,
        why="not supported: no custom logits processors are loaded",
        neutral=([],),
        bad={"logits_processors": ["x"]},
    ),
    _f(
        "structured_outputs",
        BOTH,
        VLLM,
        honoured="exactly one of `json` (a JSON schema), `regex`, `choice` (a list of strings), `grammar` "
        "(Lark/EBNF, or llama.cpp's GBNF) or `json_object: true` -> " + _SP + "structured_outputs (llguidance); "
        "one constraint field per request (this, `response_format`, `guided_*`, `json_schema`, `grammar`); "
        + _CONSTRAINT,
        bad={"structured_outputs": {"regex": "(w"}},
    ),
    _f(
        "guided_json",
        BOTH,
        VLLM,
        honoured="a JSON schema (object or its text) -> " + _SP + "structured_outputs.json (vLLM's older name)",
        bad={"guided_json": {"type": "object", "not": {}}},
    ),
    _f(
        "guided_regex",
        BOTH,
        VLLM,
        honoured="-> " + _SP + "structured_outputs.regex (the whole output matches)",
        bad={"guided_regex": "(w"},
    ),
    _f(
        "guided_choice",
        BOTH,
        VLLM,
        honoured="-> " + _SP + f"structured_outputs.choice (at most {MAX_CHOICES} strings)",
        bad={"guided_choice": []},
    ),
    _f(
        "guided_grammar",
        BOTH,
        VLLM,
        honoured="Lark/EBNF or GBNF -> " + _SP + "structured_outputs.grammar",
        bad={"guided_grammar": "start: nowhere"},
    ),
    _f(
        "guided_decoding_backend",
        BOTH,
        VLLM,
        why="not supported: the grammar engine is llguidance",
        neutral=("guidance", "llguidance", "auto"),
        bad={"guided_decoding_backend": "xgrammar"},
    ),
    _f(
        "guided_whitespace_pattern",
        BOTH,
        VLLM,
        why='not supported: JSON has no free whitespace (a schema\'s `"x-guidance"` options can change it)',
        bad={"guided_whitespace_pattern": " "},
    ),
    _f(
        "echo",
        (CHAT,),
        VLLM,
        why="not supported: vLLM's chat echo (the reply prefixed with the last message)",
        neutral=(False,),
        bad={"echo": True},
    ),
    _request_template((CHAT,)),
    _f(
        "documents",
        (CHAT,),
        VLLM,
        why="not supported: no documents for the template",
        neutral=([],),
        bad={"documents": [{"text": "w1"}]},
    ),
    _f("mm_processor_kwargs", BOTH, VLLM, why="not supported: text models only", bad={"mm_processor_kwargs": {"a": 1}}),
    _f(
        "cache_salt",
        BOTH,
        VLLM,
        why="not supported: the prefix cache is shared by every request",
        bad={"cache_salt": "x"},
    ),
    _f(
        "kv_transfer_params",
        BOTH,
        VLLM,
        why="not supported: no disaggregated prefill",
        bad={"kv_transfer_params": {"a": 1}},
    ),
    _f("vllm_xargs", BOTH, VLLM, why="not supported", bad={"vllm_xargs": {"a": 1}}),
    # --- llama.cpp server's sampling names (its top_k, min_p, temperature, seed, stop, stream, ignore_eos,
    #     presence_penalty and frequency_penalty are the rows above) ----------------------------------------------
    _f(
        "n_predict",
        BOTH,
        LLAMA_CPP,
        honoured=_SP + "max_tokens (-1: until EOS or the context is full)",
        refused_values="together with a different `max_tokens`",
        bad={"n_predict": -2},
    ),
    _f(
        "cache_prompt",
        BOTH,
        LLAMA_CPP,
        why="not supported as false: the prefix cache is automatic and never changes the output, and cannot "
        "be turned off per request",
        neutral=(True,),
        bad={"cache_prompt": False},
    ),
    _f(
        "n_probs",
        BOTH,
        LLAMA_CPP,
        why="not supported: use `logprobs` (llama.cpp's probabilities shape is not produced)",
        neutral=(0,),
        bad={"n_probs": 3},
    ),
    _f(
        "repeat_penalty",
        BOTH,
        LLAMA_CPP,
        why="not supported: llama.cpp's counts only the last `repeat_last_n` tokens; use `repetition_penalty` "
        "(over the whole prompt and output)",
        neutral=(1, 1.0),
        bad={"repeat_penalty": 1.1},
    ),
    _f(
        "repeat_last_n",
        BOTH,
        LLAMA_CPP,
        why="not supported: penalties count the whole prompt (repetition) or output (presence, frequency)",
        neutral_note="any value while no penalty is set",
        when_neutral=_NO_PENALTY,
        bad={"repeat_last_n": 64, "presence_penalty": 0.5},
    ),
    _f("penalize_nl", BOTH, LLAMA_CPP, why="not supported", neutral=(False,), bad={"penalize_nl": True}),
    *_sampler("mirostat", "not supported: no Mirostat sampling", (0,), 1, mirostat_tau=5.0, mirostat_eta=0.1),
    _f(
        "typical_p",
        BOTH,
        LLAMA_CPP,
        why="not supported: no locally typical sampling",
        neutral=(1, 1.0),
        bad={"typical_p": 0.9},
    ),
    _f("tfs_z", BOTH, LLAMA_CPP, why="not supported: no tail-free sampling", neutral=(1, 1.0), bad={"tfs_z": 0.9}),
    _f("top_n_sigma", BOTH, LLAMA_CPP, why="not supported", neutral=(-1, -1.0), bad={"top_n_sigma": 1.0}),
    _f(
        "min_keep",
        BOTH,
        LLAMA_CPP,
        why="not supported: truncation always keeps the most likely id only",
        neutral=(0, 1),
        bad={"min_keep": 5},
    ),
    *_sampler("dynatemp_range", "not supported: no dynamic temperature", (0, 0.0), 0.5, dynatemp_exponent=2.0),
    *_sampler("xtc_probability", "not supported: no XTC sampling", (0, 0.0), 0.5, xtc_threshold=0.2),
    *_sampler(
        "dry_multiplier",
        "not supported: no DRY penalty",
        (0, 0.0),
        0.8,
        dry_base=1.75,
        dry_allowed_length=2,
        dry_penalty_last_n=-1,
        dry_sequence_breakers=["\n"],
    ),
    _f(
        "samplers",
        BOTH,
        LLAMA_CPP,
        why="not supported: the order is fixed (filters and penalties, temperature, top-k, top-p, min-p)",
        bad={"samplers": ["top_k"]},
    ),
    _f(
        "grammar",
        BOTH,
        LLAMA_CPP,
        honoured="a GBNF (or Lark) grammar -> " + _SP + "structured_outputs.grammar",
        bad={"grammar": "root ::= nowhere"},
    ),
    _f(
        "json_schema",
        BOTH,
        LLAMA_CPP,
        honoured="a JSON schema -> " + _SP + "structured_outputs.json",
        bad={"json_schema": {"type": "object", "not": {}}},
    ),
    _f(
        "id_slot",
        BOTH,
        LLAMA_CPP,
        why="not supported: requests are not pinned to slots",
        neutral=(-1,),
        bad={"id_slot": 0},
    ),
    _f(
        "post_sampling_probs",
        BOTH,
        LLAMA_CPP,
        why="not supported: logprobs are of the raw distribution",
        neutral=(False,),
        bad={"post_sampling_probs": True},
    ),
)


# --- OpenAI's Responses API (POST /v1/responses), translated into the chat path -------------------------------------


def _reasoning_off(body: Mapping[str, Any]) -> bool:
    """``reasoning`` that asks for nothing: every value null, or effort ``none`` (what clients send by default)."""
    value = body.get("reasoning")
    return isinstance(value, Mapping) and all(v is None or (k == "effort" and v == "none") for k, v in value.items())


_R = (RESPONSES,)
_CHAT_PATH = "as on chat completions (the same chat path)"


def _as_chat(name: str) -> Field:
    """Chat completions' row of ``name``, word for word, as a Responses row (the same field, honoured or refused
    the same way on the same chat path)."""
    (row,) = (f for f in FIELDS if f.name == name and CHAT in f.endpoints)
    return replace(row, endpoints=_R)


RESPONSES_FIELDS: tuple[Field, ...] = (
    _f("model", _R, OPENAI, honoured="the served model's name; another name is a 404", bad={"model": 5}),
    _f(
        "input",
        _R,
        OPENAI,
        honoured="a string (one user message) or a list of items, rendered by the chat template: messages (roles "
        "`user`, `assistant`, `system`, `developer` as system; content a string or `input_text`/`output_text` "
        "parts), `function_call` items (an assistant's tool calls) and `function_call_output` items (the tools' "
        "results, by `call_id`); " + _SPECIALS_AS_TEXT + "; with `instructions` and a continued response's "
        "conversation: " + _PROMPT_CHARS,
        refused_values="image, file and audio parts, `refusal` parts, `item_reference`, `reasoning` and built-in "
        "tool items, a call whose `arguments` are not the JSON text of an object",
        bad={"input": 5},
    ),
    _f(
        "instructions",
        _R,
        OPENAI,
        honoured="a system message before the conversation (a continued response's instructions are not carried "
        "over, as OpenAI's)",
        bad={"instructions": 5},
    ),
    _f(
        "previous_response_id",
        _R,
        OPENAI,
        honoured="continue a stored response: its input and output come before `input`; with output caching "
        "(on by default) the prefix cache serves their KV pages, so the continued conversation is not computed "
        "again (`usage.input_tokens_details.cached_tokens`)",
        refused_values="an id not stored (never, `store: false`, deleted, or evicted from the bounded store), a "
        "response still in progress",
        bad={"previous_response_id": "resp_unknown"},
    ),
    _f(
        "store",
        _R,
        OPENAI,
        honoured="default true: the response is kept in memory (the newest `--max-stored-responses`, default "
        "1024) for `GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and "
        "`previous_response_id`; false: not kept",
        bad={"store": "x"},
    ),
    _f(
        "background",
        _R,
        OPENAI,
        honoured="true: the response runs after the request returns it (`status: in_progress`); `GET` polls it, "
        "`POST /v1/responses/{id}/cancel` stops it",
        refused_values="with `stream`, with `store: false`",
        bad={"background": True, "stream": True},
    ),
    _f(
        "stream",
        _R,
        OPENAI,
        honoured="server-sent events in OpenAI's order and shapes, each with its `sequence_number`: "
        "`response.created`, `response.in_progress`, per output item `response.output_item.added`, "
        "`response.content_part.added`, `response.output_text.delta`/`.done`, `response.content_part.done` "
        "(a message) or `response.function_call_arguments.delta`/`.done` (a call), "
        "`response.output_item.done`; then `response.completed` (`response.incomplete` when "
        "`max_output_tokens` cut it or it was cancelled; `error` and `response.failed` when the engine failed)",
        bad={"stream": "x"},
    ),
    _f(
        "stream_options",
        _R,
        OPENAI,
        honoured="`include_obfuscation: false` (none is sent); only with `stream`",
        refused_values="`include_obfuscation: true`",
        bad={"stream_options": {"include_obfuscation": "x"}},
    ),
    _f(
        "max_output_tokens",
        _R,
        OPENAI,
        honoured=_SP + "max_tokens (unset: until EOS or the context is full); a cut response is `incomplete` "
        "(`incomplete_details.reason: max_output_tokens`)",
        bad={"max_output_tokens": 0},
    ),
    _f("temperature", _R, OPENAI, honoured=_SP + "temperature in [0, 2]; default 1", bad={"temperature": 2.5}),
    _as_chat("top_p"),
    _f(
        "tools",
        _R,
        OPENAI,
        honoured="function tools (`{type: function, name, description, parameters, strict}`), " + _CHAT_PATH,
        refused_values="built-in tools (`web_search`, `file_search`, `computer_use_preview`, `code_interpreter`, "
        "`image_generation`, `shell`, ...), `mcp` and `custom` tools, `defer_loading`, `async`, "
        "`allowed_callers` other than direct, `output_schema`",
        bad={"tools": [{"type": "web_search"}]},
    ),
    _f(
        "tool_choice",
        _R,
        OPENAI,
        honoured='`"none"`, `"auto"`, `"required"` or `{"type": "function", "name"}`, '
        + _CHAT_PATH
        + " (`required` and a named function are forced by the grammar engine)",
        refused_values="`allowed_tools`, a built-in, MCP or custom tool",
        bad={"tool_choice": "required"},
    ),
    _f(
        "parallel_tool_calls",
        _R,
        OPENAI,
        honoured="default true; false: at most one call",
        bad={"parallel_tool_calls": "x"},
    ),
    _f(
        "max_tool_calls",
        _R,
        OPENAI,
        honoured="accepted: it bounds calls of built-in tools, and this server runs none",
        bad={"max_tool_calls": 0},
    ),
    _f(
        "text",
        _R,
        OPENAI,
        honoured='`format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", '
        '"schema", "strict"}` -> ' + _SP + "structured_outputs, as chat's `response_format` (" + _CONSTRAINT + "); "
        "`verbosity: medium`",
        refused_values="`verbosity` low or high",
        bad={"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
    ),
    _f(
        "include",
        _R,
        OPENAI,
        honoured='`["message.output_text.logprobs"]`: each `output_text` (and each streamed delta) carries '
        "`logprobs` (with `top_logprobs` alternatives)",
        refused_values="every other value (they name built-in tools' outputs, images, encrypted reasoning); "
        "logprobs together with tools",
        bad={"include": ["file_search_call.results"]},
    ),
    _f(
        "top_logprobs",
        _R,
        OPENAI,
        honoured="0..20 alternatives per token; needs `include` logprobs",
        bad={"top_logprobs": 21},
    ),
    _f(
        "truncation",
        _R,
        OPENAI,
        honoured='`"disabled"` (the default): a conversation longer than the context is a 400',
        refused_values='`"auto"` (no item of the conversation is dropped)',
        bad={"truncation": "auto"},
    ),
    _f(
        "metadata",
        _R,
        OPENAI,
        honoured="up to 16 string pairs (keys of 64, values of 512 characters), kept with the response and "
        "returned with it",
        bad={"metadata": "x"},
    ),
    _f("user", _R, OPENAI, honoured="accepted; returned with the response, changes nothing", bad={"user": 5}),
    _f("safety_identifier", _R, OPENAI, honoured="accepted; changes nothing here", bad={"safety_identifier": 5}),
    _f(
        "prompt_cache_key",
        _R,
        OPENAI,
        honoured="accepted; the prefix cache is keyed by the prompt's own tokens",
        bad={"prompt_cache_key": 5},
    ),
    _f(
        "reasoning",
        _R,
        OPENAI,
        why="not supported: the models served do not reason",
        neutral=({},),
        neutral_note="any object whose values are null, or effort `none`",
        when_neutral=_reasoning_off,
        bad={"reasoning": {"effort": "high"}},
    ),
    _f(
        "conversation",
        _R,
        OPENAI,
        why="not supported: there is no Conversations API; continue with `previous_response_id`",
        bad={"conversation": "conv_1"},
    ),
    _f("prompt", _R, OPENAI, why="not supported: no stored prompt templates", bad={"prompt": {"id": "pmpt_1"}}),
    _f(
        "context_management",
        _R,
        OPENAI,
        why="not supported: no compaction",
        neutral=([],),
        bad={"context_management": [{"type": "compaction"}]},
    ),
    _as_chat("prompt_cache_retention"),
    _f(
        "prompt_cache_options",
        _R,
        OPENAI,
        why="not supported: the prefix cache is automatic (no breakpoints, lifetimes or prewarming)",
        neutral=({},),
        bad={"prompt_cache_options": {"prewarm": True}},
    ),
    _as_chat("service_tier"),
    _f(
        "background_options",
        _R,
        OPENAI,
        why="not supported: no completion windows",
        neutral=({},),
        bad={"background_options": {"completion_window": "2h"}},
    ),
    _f("image", _R, OPENAI, why="not supported: text models only", bad={"image": {"context_compression": "enabled"}}),
    _as_chat("moderation"),
    _f("access_programs", _R, OPENAI, why="not supported", bad={"access_programs": {"cyber": "standard"}}),
    # vLLM's extensions of its ResponsesRequest
    _f("top_k", _R, VLLM, honoured=_SP + "top_k (0 or -1: off)", bad={"top_k": -2}),
    _as_chat("min_p"),
    _f("repetition_penalty", _R, VLLM, honoured=_SP + "repetition_penalty > 0", bad={"repetition_penalty": 0}),
    _f("seed", _R, VLLM, honoured=_SP + "seed (-1: unseeded)", bad={"seed": "x"}),
    _f(
        "stop",
        _R,
        VLLM,
        honoured=_SP + f"stop: a string or at most 16, of at most {MAX_STOP_CHARS} characters",
        bad={"stop": 5},
    ),
    _as_chat("ignore_eos"),
    _as_chat("skip_special_tokens"),
    _as_chat("include_stop_str_in_output"),
    _f(
        "request_id",
        _R,
        VLLM,
        honoured="the response id's suffix (`resp_<request_id>`) and the engine's request id",
        bad={"request_id": 5},
    ),
    _request_template(_R, "chat's field, on the chat request this body becomes: "),
    _f("priority", _R, VLLM, why="not supported: first come, first served (m12)", neutral=(0,), bad={"priority": 1}),
    _f("cache_salt", _R, VLLM, why="not supported: one prefix cache for every request", bad={"cache_salt": "x"}),
    _as_chat("mm_processor_kwargs"),
    _as_chat("vllm_xargs"),
    _f(
        "enable_response_messages",
        _R,
        VLLM,
        why="not supported: no raw prompt and output messages are returned",
        neutral=(False,),
        bad={"enable_response_messages": True},
    ),
    _f(
        "previous_input_messages",
        _R,
        VLLM,
        why="not supported: give the history as `input` items or `previous_response_id`",
        neutral=([],),
        bad={"previous_input_messages": [{"role": "user", "content": "w1"}]},
    ),
)

# --- Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), translated into the chat path ------


def _thinking_off(body: Mapping[str, Any]) -> bool:
    value = body.get("thinking")
    return isinstance(value, Mapping) and value.get("type") == "disabled"


_M = (MESSAGES,)
MESSAGES_FIELDS: tuple[Field, ...] = (
    _f(
        "model",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="required: the served model's name; another name is a 404 (`not_found_error`)",
        bad={"model": 5},
    ),
    _f(
        "messages",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="the conversation, through the chat template: `user` and `assistant` turns (consecutive turns of one "
        "role are one turn, as Anthropic's), content a string or blocks: `text`, an assistant's `tool_use` (its "
        "tool calls) and a user's `tool_result` (by `tool_use_id`; text content; `is_error` shown as `Error: ` "
        "before it); a last `assistant` turn is continued (prefill); "
        + _SPECIALS_AS_TEXT
        + "; with `system`: "
        + _PROMPT_CHARS,
        refused_values="`image`, `document`, `search_result`, `thinking`/`redacted_thinking` and server-tool "
        "blocks; an empty list",
        bad={"messages": []},
    ),
    _f(
        "max_tokens",
        _M,
        ANTHROPIC,
        honoured="required: " + _SP + "max_tokens; a reply cut by it has `stop_reason: max_tokens`",
        refused_values="0 (pre-warming the prompt cache is not supported)",
        bad={"max_tokens": 0},
    ),
    _f(
        "system",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="a system message first: a string, or text blocks joined by newlines",
        bad={"system": 5},
    ),
    _f(
        "stop_sequences",
        _M,
        ANTHROPIC,
        honoured=_SP + f"stop (at most 16, of at most {MAX_STOP_CHARS} characters); a matched one is the reply's "
        "`stop_sequence` with `stop_reason: stop_sequence`",
        bad={"stop_sequences": 5},
    ),
    _f(
        "stream",
        _M,
        ANTHROPIC,
        honoured="server-sent events in Anthropic's sequence: `message_start`, per block `content_block_start`, "
        "`content_block_delta` (`text_delta`, or `input_json_delta` for a `tool_use`), `content_block_stop` (a "
        "`ping` after the first block's start), `message_delta` (`stop_reason`, `stop_sequence`, usage), "
        "`message_stop`; an `error` event if the engine fails",
        bad={"stream": "x"},
    ),
    _f(
        "temperature",
        _M,
        ANTHROPIC,
        honoured=_SP + "temperature in [0, 1] (Anthropic's range); default 1",
        bad={"temperature": 1.5},
    ),
    _f("top_p", _M, ANTHROPIC, honoured=_SP + "top_p in (0, 1]", bad={"top_p": 1.5}),
    _f("top_k", _M, ANTHROPIC, honoured=_SP + "top_k (0: off)", bad={"top_k": -1}),
    _f(
        "metadata",
        _M,
        ANTHROPIC,
        honoured="`user_id` accepted; it changes nothing here",
        bad={"metadata": {"user_id": 5}},
    ),
    _f(
        "tools",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="client tools (`name`, `description`, `input_schema`), rendered and parsed as chat's function "
        "tools; the reply's calls are `tool_use` blocks (`stop_reason: tool_use`)",
        refused_values="server and Anthropic-defined tools (`bash_*`, `text_editor_*`, `web_search_*`, "
        "`code_execution_*`, `computer_*`, ...), a name outside `[A-Za-z0-9_-]{1,64}`, an `input_schema` that is "
        "not a JSON schema of an object",
        bad={"tools": [{"type": "bash_20250124", "name": "bash"}]},
    ),
    _f(
        "tool_choice",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="`auto` (the default with tools), `any` (the grammar forces one or more calls), `tool` with "
        "`name` (the grammar forces that tool's input), `none` (the tools are not shown to the model); "
        "`disable_parallel_tool_use: true`: at most one call (exactly one under `any`)",
        refused_values="`any` or `tool` without tools, a name that is not a tool's, together with `output_config."
        "format`",
        bad={"tool_choice": {"type": "any"}},
    ),
    _f(
        "output_config",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured='`format: {"type": "json_schema", "schema"}` -> ' + _SP + "structured_outputs (the text is JSON "
        "valid under the schema; " + _CONSTRAINT + ")",
        refused_values="`effort` (the models served do not reason)",
        bad={"output_config": {"effort": "high"}},
    ),
    _f(
        "output_format",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="the structured-outputs beta's name of `output_config.format` (a token count checks its shape "
        "only: the format changes no prompt token)",
        refused_values="together with `output_config.format`",
        bad={"output_format": {"type": "json_schema"}},
    ),
    _f(
        "cache_control",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="`{type: ephemeral}` accepted (also on blocks): the prefix cache is automatic and caches every "
        "full page of every prompt; `usage.cache_read_input_tokens` says what it served",
        bad={"cache_control": {"type": "persistent"}},
    ),
    _f(
        "user_profile_id",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        honoured="accepted; changes nothing here",
        bad={"user_profile_id": 5},
    ),
    _f(
        "workspace_id", ANTHROPIC_BOTH, ANTHROPIC, honoured="accepted; there are no workspaces", bad={"workspace_id": 5}
    ),
    _f(
        "thinking",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        why="not supported: extended thinking (the models served do not reason)",
        neutral_note='`{"type": "disabled"}`',
        when_neutral=_thinking_off,
        bad={"thinking": {"type": "enabled", "budget_tokens": 1024}},
    ),
    _f(
        "service_tier",
        _M,
        ANTHROPIC,
        why="not supported: there is one tier",
        neutral=("auto", "standard_only"),
        bad={"service_tier": "priority"},
    ),
    _f(
        "speed", ANTHROPIC_BOTH, ANTHROPIC, why="not supported: one speed", neutral=("standard",), bad={"speed": "fast"}
    ),
    _f("container", _M, ANTHROPIC, why="not supported: no code execution containers", bad={"container": "c"}),
    _f(
        "diagnostics",
        _M,
        ANTHROPIC,
        why="not supported: no cache-miss diagnostics",
        bad={"diagnostics": {"previous_message_id": "msg_1"}},
    ),
    _f("inference_geo", _M, ANTHROPIC, why="not supported: one place", bad={"inference_geo": "us"}),
    _f(
        "mcp_servers",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        why="not supported: no MCP connector",
        neutral=([],),
        bad={"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
    ),
    _f(
        "context_management",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        why="not supported: no context editing",
        bad={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    ),
    # the beta endpoint's fields (client.beta.messages: the same bodies, with an anthropic-beta header)
    _f(
        "billing_policy",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        why="not supported: nothing is billed",
        bad={"billing_policy": {"type": "billing_policy", "bill_to": "user_profile"}},
    ),
    _f(
        "compaction",
        ANTHROPIC_BOTH,
        ANTHROPIC,
        why="not supported: no compaction",
        bad={"compaction": {"type": "enabled"}},
    ),
    _f(
        "fallback_credit_token",
        _M,
        ANTHROPIC,
        why="not supported: nothing is billed",
        bad={"fallback_credit_token": "t"},
    ),
    _f("fallbacks", _M, ANTHROPIC, why="not supported: one model, which never declines", bad={"fallbacks": ["m"]}),
    _f(
        "thread",
        _M,
        ANTHROPIC,
        why="not supported: no server-held conversations; send the whole conversation",
        bad={"thread": {"type": "create"}},
    ),
    _request_template(ANTHROPIC_BOTH, "vLLM's chat field, on the chat request this body becomes: "),
)

FIELDS = FIELDS + RESPONSES_FIELDS + MESSAGES_FIELDS


def fields_for(endpoint: str) -> tuple[Field, ...]:
    """The table's rows for ``endpoint`` (``COMPLETIONS``, ``CHAT``, ``RESPONSES``, ``MESSAGES``, ``COUNT_TOKENS``)."""
    return tuple(f for f in FIELDS if endpoint in f.endpoints)


def honoured_names(endpoint: str) -> frozenset[str]:
    """The fields ``endpoint``'s pydantic model declares."""
    return frozenset(f.name for f in fields_for(endpoint) if f.is_honoured)


def refused_field(endpoint: str, body: Mapping[str, Any], present: Sequence[str]) -> Field | None:
    """The first refused field of ``endpoint`` among ``present`` (names in ``body``) whose value is not neutral."""
    refused = {f.name: f for f in fields_for(endpoint) if not f.is_honoured}
    for name in present:
        row = refused.get(name)
        if row is not None and not row.is_neutral(body[name], body):
            return row
    return None


UNKNOWN_FIELDS = [
    "## Unknown fields",
    "",
    "A key of a body is known when this table has a row for it (at the top of a body), or when the part of the "
    "body it is in has it: the parts' keys are those of the `openai` and `anthropic` SDKs' request types (a test "
    "checks every key of those types, and every row of the SDKs' top-level types, against the server). Any other "
    "key is a 400 `unsupported_parameter` naming its path (`max_token`, `messages.0.contnet`, "
    "`tools.0.function.paramters`) with the closest known name beside it when one is close, on every endpoint, "
    "`/tokenize` and `/detokenize` "
    "included. The parts whose keys are checked:",
    "",
    "* completions and chat: `stream_options`, `response_format` and its `json_schema`, each message of "
    "`messages` with its text parts and its `tool_calls` (and their `function`), each function tool of `tools` "
    "and its `function`, a named `tool_choice` and its `function` (`structured_outputs` refuses its unknown keys "
    "itself);",
    "* responses: `text` and `text.format`, `stream_options`, each `input` item of type `message`, "
    "`function_call` or `function_call_output` with their `input_text` and `output_text` parts, each function "
    "tool, a named `tool_choice`;",
    "* messages and count_tokens: each message and its `text`, `tool_use` and `tool_result` blocks (a "
    "`tool_result`'s text blocks too), the `system` blocks, each client tool, `tool_choice`, `output_config` "
    "and its `format`, `output_format`, `cache_control`, `metadata`;",
    "* a part of another type (an image part, a built-in tool, a `custom` tool) is refused by its type before its "
    "keys are looked at; JSON schemas, `metadata` maps, `logit_bias` and `chat_template_kwargs` are free-form and "
    "are not checked.",
    "",
    "Keys of those parts that change nothing here are accepted: a text part's `prompt_cache_breakpoint` and "
    "Anthropic's `cache_control` (the prefix cache is automatic); what an earlier response returned and a client "
    "sends back: a Responses item's `id`, `status` and `phase`, an `output_text`'s `annotations` and "
    "`logprobs`, a call's `namespace`, an output's `name`, an Anthropic call's `caller` (direct) and "
    "`toolset_name`, a tool's `eager_input_streaming`. Refused inside parts: an assistant message's `audio` and "
    "`refusal`, `stream_options.include_obfuscation: true`, a Responses tool's `defer_loading`, `async`, "
    "`allowed_callers` other than direct and `output_schema`, a Responses call's `async`, an Anthropic tool's "
    "`defer_loading`, "
    "`allowed_callers` other than direct and `input_examples`, a programmatic `caller`.",
    "",
    "`mechserve serve --ignore-unknown-fields` accepts and ignores unknown keys instead, at every depth (for "
    "proxies and gateways, such as LiteLLM, that add their own keys; vLLM and SGLang always ignore them and have "
    "no such switch): each key's path, with list indices as `*` (`messages.*.id`), is logged once per server, "
    "and a response to a request that had any names them in its `x-mechserve-ignored-fields` header "
    "(comma-separated, at most 32).",
    "",
]


def render_markdown() -> str:
    """docs/api-fields.md: every row, per origin, with what each endpoint does with it."""
    lines = [
        "# Request fields of the server's APIs",
        "",
        "Generated from `mechserve/http/fields.py` (`make api-fields`); a test checks that this page and the "
        "code agree.",
        "",
        "Every field below is either **honoured** or **refused** with a 400 whose `param` names it "
        "(`code: unsupported_parameter`, or `invalid_value` for a bad value; Anthropic's error body names it "
        "at the start of its `message`). A refused field is accepted "
        "with a *neutral* value, one that changes nothing: `null` always, and the values listed. "
        "A field outside this table, or a key that the part of the body it is in does not have (`messages.0.contnet`), "
        "is refused too: a 400 `unsupported_parameter` whose `param` is its path and whose message suggests the "
        "closest known name (`unknown field 'max_token' (did you mean 'max_tokens'?)`), as OpenAI's and Anthropic's "
        "own APIs refuse it (vLLM ignores it; [Unknown fields](#unknown-fields)). "
        "`/v1/completions` is *completions*, `/v1/chat/completions` is *chat*, `/v1/responses` is *responses*, "
        "Anthropic's `/v1/messages` is *messages* and `/v1/messages/count_tokens` *count_tokens*.",
        "",
    ]
    sections = (
        (OPENAI, "OpenAI", BOTH),
        (VLLM, "vLLM's extensions", BOTH),
        (LLAMA_CPP, "llama.cpp server's names", BOTH),
        (None, "OpenAI's Responses API (`/v1/responses`)", (RESPONSES,)),
        (ANTHROPIC, "Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`)", ANTHROPIC_BOTH),
    )
    for origin, title, endpoints in sections:
        # the Anthropic section also lists vLLM's fields these endpoints take (marked as such)
        origins = (ANTHROPIC, VLLM) if origin == ANTHROPIC else (origin,)
        lines += [
            f"## {title}",
            "",
            "| field | endpoints | honoured as | refused: why | neutral values |",
            "|---|---|---|---|---|",
        ]
        for f in FIELDS:
            if (origin is not None and f.origin not in origins) or not set(f.endpoints) & set(endpoints):
                continue
            home = f.origin == OPENAI or (origin is not None and f.origin == origin)
            where = ", ".join(f.endpoints) + ("" if home else f" ({f.origin})")
            honoured = f.honoured + (f"; refused: {f.refused_values}" if f.refused_values else "")
            neutral = "—"
            if not f.honoured:
                neutral = ", ".join(f"`{_json(n)}`" for n in (None, *f.neutral))
                neutral += f"; {f.neutral_note}" if f.neutral_note else ""
            cells = [f"`{f.name}`", where, honoured or "—", f.why or "—", neutral]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        lines.append("")
    lines += UNKNOWN_FIELDS
    lines += [
        "## What the server answers beyond OpenAI's shapes",
        "",
        "* `stop_reason` in every choice (vLLM's): the stop id or string that ended it, null for EOS.",
        "* `prompt_logprobs` (with the `prompt_logprobs` field) in each completions choice and at the top "
        "of a chat response, in vLLM's shape: one entry per prompt token, null for the first, else "
        '`{"<token id>": {"logprob", "rank", "decoded_token"}}` with the prompt token first.',
        "* With `return_token_ids`: `prompt_token_ids` and `token_ids` in each choice.",
        "",
        "Prompt logprobs are exact when the prompt prefix came from the prefix cache or the prompt was "
        "computed in chunks: positions computed in a step get their logits from that step's forward; "
        "positions served from the cache are recomputed, in one extra forward over the prompt up to the "
        "first computed position, for that request alone, into a scratch KV cache.",
        "",
        "## JSON schemas: objects are closed unless they say otherwise",
        "",
        "Every JSON schema the grammar engine enforces (`response_format`, `structured_outputs.json`, `guided_json`, "
        "`json_schema`, a forced tool call's `parameters`, Responses' `text.format`, Anthropic's `input_schema` and "
        "`output_config.format`) is read with **closed objects**: an object schema that lists `properties` (or "
        "`patternProperties`) and sets neither `additionalProperties` nor `unevaluatedProperties` allows no other "
        "property, as vLLM's default grammar backend (xgrammar, whose `strict_mode` is on) reads it; a bare "
        '`{"type": "object"}` is still any object, and the members of an `allOf` are left open. This is not '
        "JSON Schema's default, under which a small model invents properties until it runs out of tokens "
        "(clients such as LangChain drop `additionalProperties: false` from tool schemas unless `strict`). "
        "`mechserve serve --allow-additional-properties` (`EngineConfig.allow_additional_properties`) restores "
        "JSON Schema's open objects. (vLLM's own switch, `--structured-outputs-config` "
        "`disable_additional_properties`, closes objects for its llguidance backend only, to match xgrammar's "
        "default; here closed is the default and the option opens them.)",
        "",
    ]
    return "\n".join(lines)


__all__ = [
    "ANTHROPIC_BOTH",
    "BOTH",
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "ENDPOINT_PATHS",
    "FIELDS",
    "MESSAGES",
    "RESPONSES",
    "Field",
    "fields_for",
    "honoured_names",
    "refused_field",
    "render_markdown",
]
