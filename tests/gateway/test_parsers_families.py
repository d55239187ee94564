"""The parsers of the newer families on recorded outputs in their formats, as their chat templates write them.

gpt-oss (harmony: analysis, commentary and final channels), Gemma 4
(``<|tool_call>call:name{key:<|"|>…<|"|>}<tool_call|>``, thought channel),
GLM-4.5 (``<arg_key>``/``<arg_value>``, ``<think>``) and Mistral 3
(``[TOOL_CALLS]name[ARGS]{…}``): read whole and streamed at every boundary,
each format's grammar admitting its own calls, and the parsers picked from a
chat template.
"""

from __future__ import annotations

import json

import pytest

from mlxd.gateway.chat_run import ChatOutput
from mlxd.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, ReasoningStream, choose_parsers
from mlxd.gateway.parsers.template_detect import template_parsers
from tests.gateway.test_parsers import TIME, TOOLS, N, W, complete, matcher_accepts

# (parser, recorded text, expected content, expected calls as (name, arguments object))
# -- reasoning ---------------------------------------------------------------------------------

REASONING = [
    ("gemma4", "<|channel>thought\nThe user wants 2+2.<channel|>It is 4.", "The user wants 2+2.", "It is 4."),
    ("gemma4", "It is 4, thinking was off.", "", "It is 4, thinking was off."),
    ("glm45", "\n<think>Sum it.</think>\nIt is 4.", "Sum it.", "It is 4."),
    ("mistral", "[THINK]Sum it.[/THINK]It is 4.", "Sum it.", "It is 4."),
    ("harmony", "<|channel|>analysis<|message|>Sum it.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "Sum it.", "It is 4."),
    ("harmony", "<|channel|>analysis<|message|>Cut off while thin", "Cut off while thin", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_split_streamed_at_every_boundary(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    assert parser.split(text) == (reasoning or None, content)
    for i in range(len(text) + 1):
        s = ReasoningStream(parser)
        r1, c1 = s.feed(text[:i])
        r2, c2 = s.feed(text[i:])
        r3, c3 = s.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning, content), f"split at {i}"


def test_gemma4_prompt_with_thinking_off_does_not_start_inside_the_thought():
    parser = REASONING_PARSERS["gemma4"]
    assert not parser.prompt_opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>")
    assert parser.prompt_opens_reasoning("<|turn>model\n<|channel>thought\n")


HARMONY_TURN = ('<|channel|>analysis<|message|>Weather, so call the tool.<|end|><|start|>assistant<|channel|>'
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}')


def test_harmony_reasoning_then_tool_parser_split_a_turn_streamed_as_whole():
    """The chat path's order: harmony reasoning first, its content read by the harmony tool parser."""
    whole = ChatOutput("harmony", "<|start|>assistant", TOOL_PARSERS["harmony"](TOOLS)).whole(HARMONY_TURN)
    assert whole[0] == "Weather, so call the tool." and whole[1] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[2]] == [W]
    for step in (1, 3, 7):
        out = ChatOutput("harmony", "<|start|>assistant", TOOL_PARSERS["harmony"](TOOLS))
        reasoning, content, calls = "", "", {}
        pieces = [HARMONY_TURN[i:i + step] for i in range(0, len(HARMONY_TURN), step)]
        for piece in pieces + [None]:
            r, c, deltas = out.feed(piece, False) if piece is not None else out.finish()
            reasoning, content = reasoning + r, content + c
            for d in deltas:
                name = d["function"].get("name")
                calls.setdefault(d["index"], [name, ""])[1] += d["function"]["arguments"]
        assert reasoning == whole[0] and content == "" and out.called_tools
        assert [(n, json.loads(a)) for n, a in calls.values()] == [W]


# -- grammars ----------------------------------------------------------------------------------

RENDERED = {
    "gemma4": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
               '<|tool_call>call:now{tz:<|"|>UTC<|"|>}<tool_call|>'),
    "glm45": ('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days'
              '</arg_key>\n<arg_value>3</arg_value></tool_call>\n<tool_call>now\n<arg_key>tz</arg_key>\n'
              '<arg_value>UTC</arg_value></tool_call>'),
    "mistral3": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{"tz": "UTC"}',
}


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=49152)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_required_grammar_admits_the_format_and_parses_back(name, ll_tokenizer, tokenizer):
    parser = TOOL_PARSERS[name](TOOLS)
    text = RENDERED[name]
    assert matcher_accepts(ll_tokenizer, tokenizer, parser.grammar(TOOLS, True, json.dumps), text)
    assert not matcher_accepts(ll_tokenizer, tokenizer, parser.grammar(TOOLS, False, json.dumps), text)
    assert not matcher_accepts(ll_tokenizer, tokenizer, parser.grammar([TIME], False, json.dumps), text)
    _, calls = complete(name, text)
    assert [(n, json.loads(a)) for n, a in calls] == [W, N]


def test_harmony_grammar_admits_reasoning_then_one_call(ll_tokenizer, tokenizer):
    grammar = TOOL_PARSERS["harmony"](TOOLS).grammar(TOOLS, True, json.dumps)
    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris", "days": 3}<|call|>')
    assert matcher_accepts(ll_tokenizer, tokenizer, grammar, call)
    thought = "<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant"
    assert matcher_accepts(ll_tokenizer, tokenizer, grammar, thought + call)
    assert not matcher_accepts(ll_tokenizer, tokenizer, grammar, "<|channel|>final<|message|>Hi.")
    named = TOOL_PARSERS["harmony"](TOOLS).grammar([TIME], False, json.dumps)
    assert not matcher_accepts(ll_tokenizer, tokenizer, named, call)
    _, calls = complete("harmony", thought + call)
    assert [(n, json.loads(a)) for n, a in calls] == [W]


# -- choosing parsers from the chat template ---------------------------------------------------

# Fragments that name each template's markers the way the family's own template writes them.
TEMPLATES = [
    ("{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}", ("harmony", "harmony")),
    ("{{- '<|tool_call>call:' + f.name + '{' -}}...{{- '}<tool_call|>' -}}"
     "{{- '<|channel>thought\\n<channel|>' -}}", ("gemma4", "gemma4")),
    ("{{ '\\n<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>\\n<arg_value>{{ v }}</arg_value>"
     "{{ '\\n<think></think>' }}", ("glm45", "think")),
    ("{{ '[TOOL_CALLS]' + tc.name + '[ARGS]' + tc.arguments }}", ("mistral3", None)),
    ("{{ '[THINK]' + thought + '[/THINK]' }}{{ '[TOOL_CALLS]' + tc.name + '[ARGS]' }}", ("mistral3", "mistral")),
    ("{{ '[TOOL_CALLS][' + calls | tojson + ']' }}", ("mistral", None)),
    ("<tool_call>\\n<function={{ name }}>\\n<parameter={{ k }}>", ("qwen3_coder", None)),
    ("<|im_start|>assistant\\n<think>\\n<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>", ("hermes", "think")),
    ("{{ '<|start_header_id|>assistant<|end_header_id|>' }}", (None, None)),
]


@pytest.mark.parametrize("template,expected", TEMPLATES)
def test_parsers_are_picked_from_the_markers_a_template_writes(template, expected):
    assert template_parsers(template) == expected


def test_auto_flags_resolve_from_the_template_and_unset_flags_keep_their_meaning_but_for_harmony():
    harmony, qwen3, plain_template = (next(t for t, found in TEMPLATES if found == want)
                                      for want in (("harmony", "harmony"), ("hermes", "think"), (None, None)))
    assert choose_parsers("auto", "auto", harmony) == choose_parsers("harmony", "harmony", harmony)
    unset = choose_parsers(None, None, harmony)
    # Every gpt-oss reply is framed in channels: they are read without a flag.
    assert (unset.tool, unset.reasoning, unset.tool_format) == (None, "harmony", "harmony")
    qwen = choose_parsers(None, None, qwen3)
    assert (qwen.tool, qwen.reasoning, qwen.tool_format) == (None, None, "hermes")
    plain = choose_parsers("auto", "auto", plain_template)
    assert (plain.tool, plain.reasoning, plain.tool_format) == ("hermes", None, "hermes")
    named = choose_parsers("pythonic", None, harmony)
    assert (named.tool, named.tool_format) == ("pythonic", "pythonic")


def test_auto_is_a_parser_name_the_gateway_starts_with():
    from mlxd.gateway.server import build_app
    from mlxd.shared.serve_config import GatewayConfig

    app = build_app(GatewayConfig(enable_auto_tool_choice=True, tool_call_parser="auto", reasoning_parser="auto"))
    assert app.state.gw.default.parsers.tool == "hermes"  # until the model's template is known


def test_formats_spelled_in_special_tokens_keep_them_in_the_decoded_text():
    from mlxd.gateway.parsers import keeps_special_tokens

    assert keeps_special_tokens(None, "harmony") and keeps_special_tokens(None, "gemma4")
    assert keeps_special_tokens(TOOL_PARSERS["gemma4"](TOOLS), None)
    assert not keeps_special_tokens(TOOL_PARSERS["hermes"](TOOLS), "qwen3")
    assert not keeps_special_tokens(None, None)


def test_a_constraint_waits_for_the_end_of_the_reasoning_the_parser_names():
    from mlxd.gateway.structured import reasoning_aware
    from mlxd.shared.protocol import StructuredSpec

    spec = StructuredSpec("json_object")
    gemma = reasoning_aware(spec, "gemma4", "<|turn>model\n<|channel>thought\n", json.dumps)
    assert '/(?s:.*)/ "<channel|>"' in gemma.spec
    assert reasoning_aware(spec, "harmony", "<|start|>assistant", json.dumps) is spec  # the model picks its channel
