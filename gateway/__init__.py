"""The OpenAI-compatible HTTP gateway: text in and out, token ids to and from the engine."""
