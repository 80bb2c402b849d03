"""The mechanism ladder: one module per rung, each the complete engine as of its mechanism.

Standard library only.  Import a rung directly (``import mechserve.spec.m11_parallelism``);
``RUNGS`` names them in order without importing any.
"""

RUNGS = (
    "m00_engine_loop",
    "m01_continuous_batching",
    "m02_token_budget",
    "m03_paged_state",
    "m04_chunked_prefill",
    "m05_preemption",
    "m06_prefix_hash",
    "m07_radix_cache",
    "m08_cache_aware_scheduling",
    "m09_speculative_decode",
    "m10_executor_boundary",
    "m11_parallelism",
    "m12_admission_control",
    "m13_output_caching",
    "m14_forced_runs",
    "m15_routing",
    "m16_request_draft_lengths",
)
TOP = RUNGS[-1]
ENGINE_TOP = "m16_request_draft_lengths"
"""The top rung of one engine: what the runtime schedules with, and what ``run`` and ``demo`` drive by
default.  m16 is also the top rung of the ladder: it carries m15's routing (several such engines behind
a router, a fleet) unchanged and adds per-request draft lengths to the one engine."""
