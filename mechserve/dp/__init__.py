"""Data-parallel replicas: N engine-core processes behind one API server (vLLM's ``--data-parallel-size``).

``wire`` holds the msgspec structs that cross the ZeroMQ sockets between the API server and each
replica; ``replica`` is the engine-core process (``python -m mechserve.dp.replica``); ``client`` is
``DataParallelLLM``, the ``AsyncLLM`` the server runs over the replicas, routing each request with m15's
router (``mechserve.router.fleet.WorkerFleet``); ``metrics`` joins the replicas' Prometheus series
under vLLM's ``engine`` label.  docs/fleet.md ("Data-parallel replicas") says what crosses and why.
"""
