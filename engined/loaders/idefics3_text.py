"""The text model of an Idefics3 checkpoint (SmolVLM's first generation): a Llama stored under
``model.text_model``, beside the vision tower (``model.vision_model``) and the connector.

mlx_lm has no ``idefics3`` family, but its vision-checkpoint wrapper for Mistral 3 holds exactly
this: mlx_lm's Llama as ``language_model``, built from ``text_config``. The class here is that
wrapper, its weights renamed from Idefics3's layout first; the tower and connector are the vision
wing's (``engined.vision``), so the text model drops them.
"""

from __future__ import annotations

from mlx_lm.models import mistral3

ModelArgs = mistral3.ModelArgs


class Model(mistral3.Model):
    def sanitize(self, weights: dict) -> dict:
        renamed = {}
        for key, value in weights.items():
            if key.startswith(("model.vision_model.", "model.connector.")):
                continue
            if key.startswith("model.text_model."):
                key = "language_model.model." + key.removeprefix("model.text_model.")
            elif key.startswith("lm_head."):
                key = "language_model." + key
            renamed[key] = value
        return super().sanitize(renamed)
