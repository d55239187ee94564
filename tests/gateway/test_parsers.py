"""Tool-call and reasoning parsers on recorded outputs in each format.

Streaming a text cut at every character boundary (and at random multi-cuts)
must give exactly the non-streaming result, and no markup may ever reach the
content. Each format's required/named grammar must admit that format's own
calls and be read back by its parser.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, ReasoningStream, ToolStream, parse_complete
from mlxd.gateway.parsers.reasoning import ThinkReasoningParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]

W = ("get_weather", {"city": "Paris", "days": 3})
N = ("now", {"tz": "UTC"})

# (parser, recorded text, expected content, expected calls as (name, arguments object))
CORPUS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me check.\n", [W]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>', "", [W, N]),
    ("hermes", '<tool_call>{"arguments": {"tz": "UTC"}, "name": "now"}</tool_call>', "", [N]),
    ("hermes", 'No tools needed: 2 < 3 and <b>bold</b>.', 'No tools needed: 2 < 3 and <b>bold</b>.', []),
    ("hermes", 'Braces {"name": "x"} in prose, and a string with a brace: <tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "days": 3}}\n</tool_call>',
     'Braces {"name": "x"} in prose, and a string with a brace: ',
     [("get_weather", {"city": 'Pa}r"is', "days": 3})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "now", "parameters": {"tz": "UTC"}}', "", [W, N]),
    ("llama3_json", 'The weather is fine.', 'The weather is fine.', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "now", "arguments": {"tz": "UTC"}}]', "Sure. ", [W, N]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{"tz": "UTC"}',
     "", [W, N]),
    ("mistral", 'Just text [with brackets].', 'Just text [with brackets].', []),
    ("qwen3_coder", 'I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', "I will look.\n", [W]),
    ("qwen3_coder", '<tool_call>\n<function=get_weather>\n<parameter=city>\nSan <b> Jose\n</parameter>\n'
                    '<parameter=days>\n10\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n'
                    '<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>', "",
     [("get_weather", {"city": "San <b> Jose", "days": 10}), N]),
    ("pythonic", '[get_weather(city="Paris", days=3), now(tz="UTC")]', "", [W, N]),
    ("pythonic", "[get_weather(city='Pa)ris', days=3)]", "", [("get_weather", {"city": "Pa)ris", "days": 3})]),
    ("pythonic", '[1, 2] is a list.', '[1, 2] is a list.', []),
]

MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]", "[ARGS]", "<function=", "<parameter=", "<|python_tag|>",
          "<think>", "</think>")

# The families added later (harmony, Gemma 4, GLM-4.5, Mistral 3): the same checks.
FAMILY_CORPUS = [
    ("harmony", '<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>'
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
     "", [W]),
    ("harmony", '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>'
                'It is {sunny} <b>.', "It is {sunny} <b>.", []),
    ("harmony", '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>',
     "", [N]),
    ("harmony", '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>',
     "Checking.", [W]),
    ("harmony", "A reply without channels.", "A reply without channels.", []),
    ("gemma4", 'Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
     "Let me look.", [W]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>a {b}, "c" <|"|>,days:3}<tool_call|>'
               '<|tool_call>call:now{tz:<|"|>UTC<|"|>}<tool_call|>', "",
     [("get_weather", {"city": 'a {b}, "c" ', "days": 3}), N]),
    ("gemma4", '<|tool_call>call:get_weather{days:2,city:<|"|>Oslo<|"|>,extra:{deep:[1,{k:true}]}}<tool_call|>',
     "", [("get_weather", {"days": 2, "city": "Oslo", "extra": {"deep": [1, {"k": True}]}})]),
    ("gemma4", "Plain text with {braces}, call: and <tags>.", "Plain text with {braces}, call: and <tags>.", []),
    ("glm45", 'I will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
              '<arg_key>days</arg_key>\n<arg_value>3</arg_value></tool_call>', "I will check.\n", [W]),
    ("glm45", '<tool_call>get_weather<arg_key>city</arg_key><arg_value>San <b> Jose</arg_value><arg_key>days'
              '</arg_key><arg_value>10</arg_value></tool_call>\n<tool_call>now<arg_key>tz</arg_key>'
              '<arg_value>UTC</arg_value></tool_call>', "",
     [("get_weather", {"city": "San <b> Jose", "days": 10}), N]),
    ("glm45", "No tools: 2 < 3.", "No tools: 2 < 3.", []),
    ("mistral3", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]'
                 '{"tz": "UTC"}', "Sure. ", [W, N]),
    ("mistral3", '[TOOL_CALLS]get_weather[ARGS]{"city": "[ARGS]", "days": 3}', "",
     [("get_weather", {"city": "[ARGS]", "days": 3})]),
    ("mistral3", "Just [text].", "Just [text].", []),
]

FAMILY_MARKUP = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|tool_call>", "<tool_call|>",
          '<|"|>', "<tool_call>", "<arg_key>", "<arg_value>", "[TOOL_CALLS]", "[ARGS]")



def stream(parser_name: str, pieces: list[str]):
    s = ToolStream(TOOL_PARSERS[parser_name](TOOLS))
    content, calls = "", {}
    for piece in pieces:
        c, deltas = s.feed(piece)
        content += c
        absorb(calls, deltas)
    c, deltas = s.finish()
    content += c
    absorb(calls, deltas)
    return content, [calls[i] for i in sorted(calls)]


def absorb(calls: dict, deltas: list[dict]) -> None:
    """Accumulate deltas the way an OpenAI client does, checking their shape."""
    for d in deltas:
        i = d["index"]
        if i not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            assert d["function"]["arguments"] == ""  # the name comes first, on its own
            calls[i] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[i][1] += d["function"]["arguments"]


def complete(parser_name: str, text: str):
    content, calls = parse_complete(TOOL_PARSERS[parser_name](TOOLS), text)
    return content, [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


def cuts(text: str, points: list[int]) -> list[str]:
    points = sorted(set(p for p in points if 0 < p < len(text)))
    bounds = [0] + points + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name,text,content,expected", CORPUS + FAMILY_CORPUS)
def test_non_streaming_reads_the_recorded_calls(name, text, content, expected):
    got_content, got_calls = complete(name, text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == expected


@pytest.mark.parametrize("name,text,content,expected", CORPUS + FAMILY_CORPUS)
def test_streaming_split_at_every_boundary_equals_non_streaming(name, text, content, expected):
    whole = complete(name, text)
    for i in range(len(text) + 1):
        got = stream(name, cuts(text, [i]))
        assert got == whole, f"split at {i}"
        assert not any(m in got[0] for m in MARKUP + FAMILY_MARKUP if m not in text[: len(content)])
    # One character at a time: every intermediate content delta is markup-free too.
    s = ToolStream(TOOL_PARSERS[name](TOOLS))
    sent = ""
    for ch in text:
        sent += s.feed(ch)[0]
        assert not any(m in sent for m in MARKUP + FAMILY_MARKUP if m not in content)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CORPUS), data=st.data())
def test_streaming_random_multi_cuts_equal_non_streaming(case, data):
    name, text, content, _ = case
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert stream(name, cuts(text, points)) == complete(name, text)


def test_truncated_call_keeps_streamed_name_and_partial_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert stream("hermes", [text[:30], text[30:]]) == complete("hermes", text)
    assert complete("hermes", text)[1] == [["get_weather", '{"city": "Par']]


def test_unclosed_markup_without_a_call_ends_as_content():
    text = "Look: <tool_call> this is not JSON"
    assert complete("hermes", text) == (text, [])
    assert stream("hermes", cuts(text, [8, 12])) == (text, [])


# -- reasoning ---------------------------------------------------------------------------------

REASONING = [
    (False, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    (False, "It is 4, no thinking.", "", "It is 4, no thinking."),
    (True, "Started inside <b>.\n</think>\n\nAnswer.", "Started inside <b>.\n", "Answer."),
    (True, "Cut off while thinking", "Cut off while thinking", ""),
    (False, "<thinking is not the tag", "", "<thinking is not the tag"),
]


@pytest.mark.parametrize("inside,text,reasoning,content", REASONING)
def test_reasoning_split_streamed_at_every_boundary(inside, text, reasoning, content):
    parser = ThinkReasoningParser(starts_inside=inside)
    assert parser.split(text) == (reasoning or None, content)
    for i in range(len(text) + 1):
        s = ReasoningStream(parser)
        r1, c1 = s.feed(text[:i])
        r2, c2 = s.feed(text[i:])
        r3, c3 = s.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning, content), f"split at {i}"
        assert "<think>" not in c1 + c2 + c3 and "</think>" not in c1 + c2 + c3


def test_prompt_that_opens_a_think_block_starts_inside():
    assert ThinkReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not ThinkReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n")
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}


# -- grammars: each format's required/named grammar admits its own calls -----------------------

RENDERED = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
              '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "now", "parameters": {"tz": "UTC"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "now", "arguments": {"tz": "UTC"}}]',
    "qwen3_coder": '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                   '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n'
                   '<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>',
    "pythonic": '[get_weather(city="Paris", days=3), now(tz="UTC")]',
}


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=49152)


def matcher_accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_required_grammar_admits_the_format_and_parses_back(name, ll_tokenizer, tokenizer):
    parser = TOOL_PARSERS[name](TOOLS)
    text = RENDERED[name]
    parallel = parser.grammar(TOOLS, True, json.dumps)
    single = parser.grammar(TOOLS, False, json.dumps)
    assert matcher_accepts(ll_tokenizer, tokenizer, parallel, text)
    assert not matcher_accepts(ll_tokenizer, tokenizer, single, text)  # two calls where one is allowed
    named = parser.grammar([TIME], False, json.dumps)
    assert not matcher_accepts(ll_tokenizer, tokenizer, named, text)
    _, calls = complete(name, text)
    assert [(n, json.loads(a)) for n, a in calls] == [W, N]


def test_hermes_list_may_end_after_any_call_its_last_marker_optional(ll_tokenizer, tokenizer):
    # A model that never learned the format ends a call with its JSON; held to the closing marker it
    # went on to a newline, and the grammar then wanted another call.
    grammar = TOOL_PARSERS["hermes"](TOOLS).grammar(TOOLS, True, json.dumps)
    one = '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}'
    two = RENDERED["hermes"]
    for text in (one, one + "\n</tool_call>", two, two[: -len("\n</tool_call>")]):
        assert matcher_accepts(ll_tokenizer, tokenizer, grammar, text), text
        assert complete("hermes", text)[1][0][0] in ("now", "get_weather")
    assert not matcher_accepts(ll_tokenizer, tokenizer, grammar, one + "\n<tool_call>\n" + one[12:])
    single = TOOL_PARSERS["hermes"](TOOLS).grammar(TOOLS, False, json.dumps)
    assert matcher_accepts(ll_tokenizer, tokenizer, single, one)
    assert not matcher_accepts(ll_tokenizer, tokenizer, single, one + "\n</tool_call>\n" + one)


def test_an_unknown_parser_name_stops_the_gateway_before_it_serves():
    from mlxd.gateway.server import build_app
    from mlxd.shared.errors import InvalidRequestError
    from mlxd.shared.serve_config import GatewayConfig

    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(InvalidRequestError, match=field) as err:
            build_app(GatewayConfig(**{field: "nope"}))
        assert err.value.param == field


# A call list that repeats a call: each format's own spelling of W, N, W again (its keys in another
# order), then one more call that must never be read.
REPEATS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, "city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {"tz": "CET"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "now", "parameters": {"tz": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"days": 3, "city": "Paris"}}; '
                    '{"name": "now", "parameters": {"tz": "CET"}}'),
    ("mistral3", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{"tz": "UTC"}'
                 '[TOOL_CALLS]get_weather[ARGS]{"days": 3, "city": "Paris"}[TOOL_CALLS]now[ARGS]{"tz": "CET"}'),
    ("pythonic", '[get_weather(city="Paris", days=3), now(tz="UTC"), get_weather(days=3, city="Paris"), '
                 'now(tz="CET")]'),
]


@pytest.mark.parametrize("name,text", REPEATS, ids=[r[0] for r in REPEATS])
def test_a_repeated_call_ends_the_list_and_is_never_sent(name, text):
    whole = complete(name, text)
    assert [(n, json.loads(a)) for n, a in whole[1]] == [W, N]
    for i in range(len(text) + 1):
        assert stream(name, cuts(text, [i])) == whole, f"split at {i}"
    s = ToolStream(TOOL_PARSERS[name](TOOLS))
    sent, at = [], None
    for at, ch in enumerate(text):
        sent += s.feed(ch)[1]
        if s.ended:
            break
    # It ends as soon as the repeat is complete, before the call after it begins.
    assert s.ended and at < text.rindex("now") and s.num_calls == 2
    assert {d["index"] for d in sent} == {0, 1}
