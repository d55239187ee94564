"""Speculative decoding: drafts proposed before the step is scheduled, verified in its sample stage.

Plugs into the step through one ``speculator.Speculator`` that the engine makes only when
``--speculative-config`` is on (propose, draft, verify); ``proposers`` loads its drafter: n-gram
lookup needs none, ``draft_model`` a second checkpoint, ``mtp`` the target's MTP layer or Gemma 4's
assistant (``gemma4_assistant``).
"""
