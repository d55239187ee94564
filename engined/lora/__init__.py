"""LoRA adapters: many over one base model, mixed in one packed step (``adapters``, ``layers``, ``registry``).

Plugs in where the engine is built (``registry.LoraRegistry`` wraps the model's linears before the
runner installs its attention), at admission (the scheduler runs a request only while its adapter
holds a slot) and in each forward (the runner sets the step's per-token slots).
"""
