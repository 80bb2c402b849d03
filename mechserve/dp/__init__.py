"""Data-parallel replicas: N engine-core processes behind one API server (vLLM's ``--data-parallel-size``).

``wire`` holds the msgspec structs that cross the ZeroMQ sockets between the API server and each
replica; ``replica`` is the engine-core process (``python -m mechserve.dp.replica``); ``client`` is
``DataParallelLLM``, the ``AsyncLLM`` the server runs over the replicas, routing each request with m15's
router (``mechserve.router.fleet.WorkerFleet``); ``metrics`` joins the replicas' Prometheus series
under vLLM's ``engine`` label.  docs/fleet.md ("Data-parallel replicas") says what crosses and why.
"""

from __future__ import annotations

import os


def available_threads() -> int:
    """The CPUs this process may run on (``serve --threads``' default with ``--data-parallel-size``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
