"""Benchmarks behind ``mechserve bench``: one module per benchmark, each with ``add_arguments(parser)`` and
``run(args)``, registered in ``mechserve.cli.bench.BENCHMARKS``.

``serve_client``: drive a running server with Poisson arrivals (``mechserve bench serve``).
"""
