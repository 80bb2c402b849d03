"""What users call: ``LLM`` (offline batches), ``AsyncLLM`` and its background ``Stepper``, stream events,
serving metrics, and the prompt forms every front end accepts (``prompts``)."""
