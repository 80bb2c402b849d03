"""The types a caller of mechserve sees, with no runtime behind them (standard library and the spec only).

``params`` (``SamplingParams``), ``outputs`` (``RequestOutput``, ``StepOutput``, ...), ``config``
(``EngineConfig``, ``SpeculativeConfig``), ``limits`` (every upper limit), ``errors`` (every error a
caller can meet) and ``env`` (every environment variable read).  Nothing here imports torch.
"""
