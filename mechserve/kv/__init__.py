"""The paged KV cache behind the boundary: the page tensors and the attention batch of a step
(``paged``), and the native paged-attention kernel with its build (``native``, ``csrc/``)."""
