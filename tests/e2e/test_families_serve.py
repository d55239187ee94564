"""Families through the whole stack: `mlxd serve` on a tiny Gemma 4 vision-layout checkpoint (text model
under language_model, later layers reading earlier layers' K/V) answers the real openai SDK."""

import openai

from tests.e2e.serve_harness import Serve
from tests.tiny_models import fresh_seed, make_tiny_model


def test_serve_answers_chat_on_a_gemma4_checkpoint_with_shared_kv_layers(tmp_path):
    model = make_tiny_model(tmp_path / "gemma4", "gemma4", seed=fresh_seed("model"))
    serve = Serve(tmp_path, model=str(model)).start()
    try:
        serve.wait_healthy()
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "the cat " * 30}]  # past the window of 12
        plain = client.chat.completions.create(model="gemma4", messages=messages, max_tokens=8, temperature=0)
        assert plain.usage.completion_tokens >= 1 and plain.usage.prompt_tokens > 30
        stream = client.chat.completions.create(model="gemma4", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == plain.choices[0].message.content  # greedy: the same text, streamed or not
    finally:
        serve.stop()

