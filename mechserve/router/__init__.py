"""``mechserve router``: m15's routing policies over HTTP in front of ``mechserve serve`` workers.

``fleet.py`` holds the workers and m15's ``Router`` over the live ones (and the decision log);
``app.py`` is the HTTP front (forwarding, streaming, health checks, failures); ``events.py`` hears
the workers' KV events for the ``precise`` policy.
"""
