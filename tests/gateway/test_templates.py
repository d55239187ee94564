"""Chat templates: the model's own, an override, the controls, and rejections as 400s."""

from __future__ import annotations

import pytest

from mlxd.gateway.openai_types import ChatMessage
from mlxd.gateway.params import check_chat, load_chat_template, message_dicts
from mlxd.shared.errors import InvalidRequestError

CONVO = [{"role": "user", "content": "Hi"}]


def test_models_own_template_with_generation_prompt(tokenizer):
    text = tokenizer.render_chat(CONVO)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not tokenizer.render_chat(CONVO, add_generation_prompt=False).endswith("assistant\n")


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    convo = CONVO + [{"role": "assistant", "content": "Hello, I am"}]
    text = tokenizer.render_chat(convo, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I am")
    # The controls are checked with the rest of the request, before rendering.
    check_chat(convo, "messages", add_generation_prompt=False, continue_final=True, chat_template=None,
               trust_request_template=False)
    with pytest.raises(InvalidRequestError):
        check_chat(convo, "messages", add_generation_prompt=True, continue_final=True, chat_template=None,
                   trust_request_template=False)
    with pytest.raises(InvalidRequestError):
        check_chat(CONVO, "messages", add_generation_prompt=False, continue_final=True, chat_template=None,
                   trust_request_template=False)


def test_template_override_from_a_file_and_kwargs(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ flavour }}]{% endfor %}")
    template = load_chat_template(str(path))
    assert tokenizer.render_chat(CONVO, chat_template=template,
                                 chat_template_kwargs={"flavour": "x"}) == "[user|Hi|x]"
    assert load_chat_template("{{ 1 }}") == "{{ 1 }}"  # not a file: the template itself


def test_template_errors_are_invalid_requests(tokenizer):
    with pytest.raises(InvalidRequestError, match="chat template"):
        tokenizer.render_chat(CONVO, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(InvalidRequestError):
        tokenizer.render_chat(CONVO, chat_template="{% for %}")


def test_text_parts_are_joined_image_parts_kept_and_other_parts_refused():
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
    assert message_dicts(msgs) == [{"role": "user", "content": "a\nb"}]
    # An image keeps the parts in order, for the template to place its placeholder (gateway.media reads the URL).
    msgs = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}},
                                              {"type": "text", "text": "a"}])]
    assert message_dicts(msgs) == [{"role": "user", "content": [{"type": "image", "url": "x"},
                                                                {"type": "text", "text": "a"}]}]
    with pytest.raises(InvalidRequestError) as e:
        message_dicts([ChatMessage(role="user", content=[{"type": "input_audio", "input_audio": {"data": "x"}}])])
    assert e.value.param == "messages[0].content"
