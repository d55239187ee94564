"""LoRA adapters: many over one base model, mixed in one packed step (``adapters``, ``layers``, ``registry``)."""
