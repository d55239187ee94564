"""The gateway's cheap bounds: bytes per token, JSON depth, and the step cap on request templates."""

from __future__ import annotations

import random

import pytest

from mlxd.gateway.state import decode
from mlxd.gateway.params import MAX_JSON_DEPTH, TemplateStepsExceeded, json_depth, loads, step_capped
from mlxd.shared.errors import InvalidRequestError

SEED = 20261201

_PIECES = [" ", "\n", "\t", "    ", "a", "ab", "the", " the", "é", "日本語", "🦙", "\u0000", "<|im_start|>",
           "<|im_end|>", "-", "=", "0123456789", "\r\n", "ﬁ", "\u200b"]


def test_no_text_has_fewer_tokens_than_its_bytes_over_the_longest_token(tokenizer):
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    bound = tokenizer.max_token_bytes
    assert bound is not None and bound >= max(len(p.encode()) for p in ("<|im_start|>", "<|im_end|>"))
    texts = [" " * 5000, "\n" * 3000, "-" * 4000, "a" * 8000, "<|im_end|>" * 300]
    for _ in range(300):
        texts.append("".join(rng.choice(_PIECES) * rng.choice([1, 1, 2, 40, 200])
                             for _ in range(rng.randrange(1, 60))))
    for text in texts:
        size = len(text.encode("utf-8"))
        assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= size, text[:80]


def test_json_depth_counts_containers_without_recursion():
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1, {"b": []}]}) == 4
    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert json_depth(deep) == 100_001


def test_nesting_past_the_limit_is_an_invalid_request():
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(loads(ok)) == MAX_JSON_DEPTH
    for depth in (MAX_JSON_DEPTH + 1, 999, 1000, 50_000):
        with pytest.raises(InvalidRequestError, match="nest"):
            loads("[" * depth + "]" * depth)
    with pytest.raises(InvalidRequestError, match="nest"):
        decode(b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", dict)


def test_the_step_cap_stops_a_loop_that_never_ends_and_lets_a_short_one_finish():
    def forever():
        while True:
            pass

    with pytest.raises(TemplateStepsExceeded):
        step_capped(forever, 100_000)
    assert step_capped(lambda: sum(range(1000)), 100_000) == 499500

    def swallowing():  # code that catches Exception cannot keep the cap from firing
        while True:
            try:
                forever()
            except Exception:
                pass

    with pytest.raises(TemplateStepsExceeded):
        step_capped(swallowing, 100_000)


def test_a_request_template_that_loops_is_a_400_naming_chat_template(tokenizer):
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequestError) as e:
        tokenizer.render_chat([{"role": "user", "content": "hi"}], chat_template=loops, max_steps=200_000)
    assert e.value.param == "chat_template"
    text = tokenizer.render_chat([{"role": "user", "content": "hi"}], max_steps=5_000_000)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "return_dict", "tools"])
def test_template_kwargs_cannot_set_the_renderers_own_arguments(tokenizer, key):
    with pytest.raises(InvalidRequestError) as e:
        tokenizer.render_chat([{"role": "user", "content": "hi"}], chat_template_kwargs={key: True})
    assert e.value.param == "chat_template_kwargs"
