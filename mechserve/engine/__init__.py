"""In front of the boundary: ``EngineCore`` (one step, in one place), the ``Scheduler`` over the top rung,
the per-request state, incremental detokenization, pool sizing and what the core builds behind the
boundary (``executors``).  See docs/architecture.md."""
