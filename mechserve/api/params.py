"""Per-request sampling parameters, as in vLLM's ``SamplingParams`` (standard library only).

Validation happens at construction: a bad value raises ``ValueError`` naming
the field, so a request that can never be served never reaches the engine.
Checks that need the model (a stop token id outside the vocabulary) happen
at submission, in ``mechserve.entrypoints.llm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20
# vLLM's _SAMPLING_EPS: a temperature below it is greedy.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    * ``temperature`` (>= 0; below 1e-5 means greedy, as in vLLM), ``top_k`` (0 or -1 = off, else the
      k most likely tokens), ``top_p`` (in (0, 1]: the smallest set whose
      probability reaches p), ``min_p`` (in [0, 1]: drop tokens below
      ``min_p`` x the top probability).  Applied in that order: temperature,
      top-k, top-p, min-p (vLLM's order).
    * ``seed``: a seeded request's token ``i`` is drawn from a generator seeded
      by ``(seed, i)`` alone, so it never depends on which other requests share
      the batch, nor on preemption or speculation.
    * ``max_tokens`` (>= 0; 0 finishes at once with no token), ``min_tokens``
      (EOS and stop ids are masked until this many tokens exist; stop strings
      are not checked before it).
    * ``stop``: strings that end the output (not included in the text unless
      ``include_stop_str_in_output``); ``stop_token_ids``: ids that end it
      (finish reason ``stop``); ``ignore_eos``: the model's EOS is an ordinary
      token.
    * ``logprobs``: return the top-N log-probabilities (0..20) of the model's
      raw distribution (before temperature and masks, vLLM's default) at each
      generated position, plus the chosen token's.
    * ``n``: independent samples per prompt (each a separate request; with a
      seed, sample ``j`` uses ``seed + j``).

    Raises ``ValueError`` on any out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept a bare string / any sequence for the two stop fields, store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            _is_real(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"
        )
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 (off) or > 0, got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens!r}")
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        _check(all(isinstance(s, str) and s for s in stop), f"stop must be non-empty strings, got {stop!r}")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature below ``SAMPLING_EPS``, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def for_sample(self, j: int) -> SamplingParams:
        """The params of the ``j``-th of ``n`` samples: ``n = 1`` and, if seeded, ``seed + j``."""
        seed = None if self.seed is None else self.seed + j
        return replace(self, n=1, seed=seed)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # NaN is not a value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


GREEDY = SamplingParams(temperature=0.0)

__all__ = ["GREEDY", "MAX_LOGPROBS", "SAMPLING_EPS", "SamplingParams"]
