"""What a long-lived engine needs beyond ``EngineCore``: the engine thread and the serving metrics.

``mechserve.async_llm.AsyncLLM`` is the public API built on them; the HTTP
server (``mechserve.server``) sits on ``AsyncLLM``.
"""
