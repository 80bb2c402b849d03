"""Every upper limit mechserve enforces, in one place (standard library only).

No value a user can give, however large, may make mechserve allocate without bound, step for ever
before it says anything, or start unbounded work: each size has a limit here, and every entry
point (the spec-ladder workloads of ``mechserve run``, ``EngineConfig`` behind ``LLM``/``AsyncLLM``,
the CLI flags and the HTTP fields) checks against the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

# Engine sizes (the keys of a workload's engine section, the fields of EngineConfig).
ENGINE_LIMITS: Mapping[str, int] = {
    "max_step_tokens": 1_000_000,
    "page_size": 65_536,
    "num_pages": 1_000_000,
    "spec_len": 64,
    "world_size": 64,
    "max_waiting": 1_000_000,
    "max_running": 1_000_000,
    "max_model_len": 1_000_000_000,
}
# Replicas of a spec fleet (m15's workload key and --replicas; the fleet benchmark's counts).
MAX_REPLICAS = 256
# The spec's page pool keeps Python bookkeeping per slot: num_pages x page_size at most this.
MAX_SLOTS = 16_777_216
MAX_PAGES = ENGINE_LIMITS["num_pages"]
# Guesses per decode window (spec_len, num_speculative_tokens).
MAX_SPEC_LEN = ENGINE_LIMITS["spec_len"]
# Suffix decoding: the longest substring its trees hold (each id adds up to this many nodes) and how many
# requests' outputs the global tree holds.
MAX_SUFFIX_TREE_DEPTH = 256
MAX_SUFFIX_CACHED_REQUESTS = 1_000_000
# Requests.
MAX_PROMPT_LEN = 1_000_000
MAX_TOTAL_PROMPT_TOKENS = 4_000_000  # all prompts of one workload together
MAX_ARRIVAL_STEP = 1_000_000
MAX_NEW_TOKENS = 1_000_000_000  # allocates nothing by itself
TOKEN_ID_LIMIT = 2**31  # token ids are < 2**31
MAX_LOGPROBS = 20  # top-N log-probabilities per position
MAX_SAMPLES = 64  # n, independent samples of one prompt
MAX_FILTER_IDS = 65_536  # ids in allowed_token_ids / stop_token_ids (logit_bias: MAX_LOGIT_BIAS_IDS)
MAX_BAD_WORDS = 128  # vLLM's MAX_NUM_BAD_WORDS
# A KV budget (kv_memory, --kv-memory): 1 PiB.
MAX_KV_MEMORY = 1 << 50
# An HTTP request body (the server's --max-request-bytes default): larger is a 413 before any parsing.
MAX_REQUEST_BYTES = 4 << 20
# Request input that the engine's loop would otherwise pay for at every step, or a worker at submission.
MAX_STOP_CHARS = 256  # characters in one stop string (held-back suffixes are searched every step)
MAX_LOGIT_BIAS_IDS = 1_024  # ids in one logit_bias (applied to every sampled row)
MAX_GRAMMAR_CHARS = 262_144  # a constraint's text: a schema's JSON, a regex, a grammar, a choice list's JSON
MAX_CHOICES = 1_024  # strings in a structured_outputs choice
# A prompt's text (or a rendered conversation) is refused before tokenization past max_model_len x the
# longest vocabulary entry's characters (no longer text can fit the context), and never below this.
MIN_PROMPT_CHARS = 65_536
# A chat template sent with a request (only with --trust-request-chat-template), rendered in a child process.
RENDER_TIMEOUT_S = 2.0  # one render's wall time
RENDER_MEMORY_BYTES = 256 << 20  # address space one render may add
MAX_RENDER_CHARS = 1 << 20  # characters of its text (the prompt's own limit may be lower)
# An HTTP client must send its request (head and body) within this many seconds, and a response it does not
# read for this long (the socket's buffers full) is given up.
CLIENT_TIMEOUT_S = 30.0

__all__ = [
    "CLIENT_TIMEOUT_S",
    "ENGINE_LIMITS",
    "MAX_ARRIVAL_STEP",
    "MAX_BAD_WORDS",
    "MAX_CHOICES",
    "MAX_FILTER_IDS",
    "MAX_GRAMMAR_CHARS",
    "MAX_KV_MEMORY",
    "MAX_LOGIT_BIAS_IDS",
    "MAX_LOGPROBS",
    "MAX_NEW_TOKENS",
    "MAX_PAGES",
    "MAX_PROMPT_LEN",
    "MAX_RENDER_CHARS",
    "MAX_REPLICAS",
    "MAX_REQUEST_BYTES",
    "MAX_SAMPLES",
    "MAX_SLOTS",
    "MAX_SPEC_LEN",
    "MAX_STOP_CHARS",
    "MAX_SUFFIX_CACHED_REQUESTS",
    "MAX_SUFFIX_TREE_DEPTH",
    "MAX_TOTAL_PROMPT_TOKENS",
    "MIN_PROMPT_CHARS",
    "RENDER_MEMORY_BYTES",
    "RENDER_TIMEOUT_S",
    "TOKEN_ID_LIMIT",
]
