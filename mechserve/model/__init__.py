"""Models: checkpoint files and the embedded SmolLM2 (``checkpoint``), the Llama-family forward
(``llama``), its tensor-parallel shard (``sharded``), draft models (``draft``) and the loader that
builds a ready model from a name (``loader``)."""
