"""Behind the boundary: the executor contract (``protocol``), ``TorchExecutor``, the draft proposers,
speculative verification and the governor that sizes windows, and tensor-parallel ranks
(``rank``: one rank process; ``rank_group``: the driver's handle on all of them)."""
