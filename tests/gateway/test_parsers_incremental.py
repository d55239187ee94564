"""Every parser reads incrementally: work linear in the text however finely it is streamed, same result as whole.

The parsers count the characters their scanners examine (``meter``); a long
tool call fed one character at a time must cost a small constant per
character (re-scanning the text on every delta, as the parsers once did,
costs about half the text per character: 10,000 per character for 20 KB).
Streaming on seeded random splits must give exactly the one-shot result for
every parser.
"""

from __future__ import annotations

import json
import random

import pytest

from mlxd.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, ReasoningStream, ToolStream, parse_complete
from tests.gateway import test_parsers, test_parsers_families

WRITE = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

# At most this many characters examined per character of text, fed one at a time.
PER_CHAR = 48


def payload(rng: random.Random, n: int) -> str:
    """Text of about ``n`` characters with the characters markup is made of (no complete marker)."""
    words = ["alpha", "beta", "{x}", "[y]", "a<b", "c>d", "e,f", "g:h", "'q'", "p(q)", "<tool", "[TOOL", "<|ch"]
    out, size = [], 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def long_call(name: str, text: str) -> str:
    """One call of ``write(text=...)`` in parser ``name``'s format."""
    js = json.dumps({"text": text})
    return {
        "hermes": f'<tool_call>\n{{"name": "write", "arguments": {js}}}\n</tool_call>',
        "llama3_json": f'{{"name": "write", "parameters": {js}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "write", "arguments": {js}}}]',
        "mistral3": f"[TOOL_CALLS]write[ARGS]{js}",
        "qwen3_coder": f"<tool_call>\n<function=write>\n<parameter=text>\n{text}\n</parameter>\n</function>\n"
                       "</tool_call>",
        "pythonic": f"[write(text={json.dumps(text)})]",
        "harmony": "<|channel|>analysis<|message|>Write it.<|end|><|start|>assistant<|channel|>commentary "
                   f"to=functions.write <|constrain|>json<|message|>{js}",
        "gemma4": f'<|tool_call>call:write{{text:<|"|>{text}<|"|>}}<tool_call|>',
        "glm45": f"<tool_call>write\n<arg_key>text</arg_key>\n<arg_value>{text}</arg_value></tool_call>",
    }[name]


FORMATS = sorted({cls.name for cls in TOOL_PARSERS.values()})


def test_every_registered_format_has_a_long_call():
    assert set(FORMATS) == {"hermes", "llama3_json", "mistral", "mistral3", "qwen3_coder", "pythonic", "harmony",
                            "gemma4", "glm45"}


def scanned_one_char_at_a_time(name: str, text: str) -> tuple[int, tuple]:
    parser = TOOL_PARSERS[name]([WRITE])
    content, args = "", ""
    for ch in text:
        got = parser.feed(ch)
        content += got.content
        args += "".join(c.arguments for c in got.calls)
    got = parser.feed("", final=True)
    content += got.content
    args += "".join(c.arguments for c in got.calls)
    return parser.meter.scanned, (content, args)


@pytest.mark.parametrize("name", FORMATS)
def test_a_20kb_call_fed_one_character_at_a_time_costs_linear_work(name):
    seed = 2026_12_01
    print(f"seed {seed}")
    rng = random.Random(seed)
    text = payload(rng, 20_000)
    call = long_call(name, text)
    scanned, (content, args) = scanned_one_char_at_a_time(name, call)
    print(f"{name}: {len(call)} characters, {scanned} examined ({scanned / len(call):.1f} per character)")
    assert content == "" and json.loads(args) == {"text": text}
    assert scanned <= PER_CHAR * len(call)
    # Linear, not quadratic: four times the text costs about four times the work.
    short = long_call(name, text[:5_000])
    short_scanned, _ = scanned_one_char_at_a_time(name, short)
    assert scanned / short_scanned < 1.25 * len(call) / len(short)


@pytest.mark.parametrize("name", sorted({cls.name for cls in REASONING_PARSERS.values()}))
def test_long_reasoning_fed_one_character_at_a_time_costs_linear_work(name):
    seed = 7
    print(f"seed {seed}")
    thought = payload(random.Random(seed), 20_000)
    parser = REASONING_PARSERS[name]()
    cls = type(parser)
    if name == "harmony":
        text = f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>final<|message|>Done."
    else:
        text = f"{cls.OPEN}{thought}{cls.CLOSE}Done."
    reasoning, content = "", ""
    for ch in text:
        r, c = parser.feed(ch)
        reasoning, content = reasoning + r, content + c
    r, c = parser.feed("", final=True)
    assert (reasoning + r, content + c) == (thought, "Done.")
    assert parser.meter.scanned <= PER_CHAR * len(text)


def random_cuts(rng: random.Random, text: str) -> list[str]:
    points = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 24))) if len(text) > 1 else []
    return test_parsers.cuts(text, points)


def tool_cases() -> list[tuple[str, str]]:
    rng = random.Random(11)
    cases = [(name, text) for name, text, _, _ in test_parsers.CORPUS + test_parsers.FAMILY_CORPUS]
    cases += [(name, long_call(name, payload(rng, 400))) for name in FORMATS]
    return cases


def test_every_parser_streamed_on_seeded_random_splits_equals_one_shot():
    seed = 424242
    print(f"seed {seed}")
    rng = random.Random(seed)
    cases = tool_cases()
    assert {name for name, _ in cases} >= set(FORMATS)
    for name, text in cases:
        whole = parse_complete(TOOL_PARSERS[name](test_parsers.TOOLS + [WRITE]), text)
        expect = (whole[0], [[c["function"]["name"], c["function"]["arguments"]] for c in whole[1]])
        for _ in range(20):
            pieces = random_cuts(rng, text)
            s = ToolStream(TOOL_PARSERS[name](test_parsers.TOOLS + [WRITE]))
            content, calls = "", {}
            for piece in pieces:
                c, deltas = s.feed(piece)
                content += c
                test_parsers.absorb(calls, deltas)
            c, deltas = s.finish()
            test_parsers.absorb(calls, deltas)
            assert (content + c, [calls[i] for i in sorted(calls)]) == expect, (name, pieces)


def test_every_reasoning_parser_streamed_on_seeded_random_splits_equals_one_shot():
    seed = 99
    print(f"seed {seed}")
    rng = random.Random(seed)
    cases = [(name, text) for name, text, _, _ in test_parsers_families.REASONING]
    cases += [("think", text) for _, text, _, _ in test_parsers.REASONING]
    for name, text in cases:
        parser = REASONING_PARSERS[name]()
        reasoning, content = parser.split(text)
        for _ in range(20):
            s = ReasoningStream(parser)
            got = [s.feed(p) for p in random_cuts(rng, text)] + [s.finish()]
            assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got)) == (reasoning, content)


# Pieces of every format's markup, and text that looks like it, for random texts.
FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", '{"name": "write", "arguments": ', '{"text": "x"}', "}", "{",
             "[", "]", '"', "\\", ",", ":", "[TOOL_CALLS]", "[ARGS]", "write", "<function=write>", "</function>",
             "<parameter=text>", "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
             "<|tool_call>", "<tool_call|>", "call:write", '<|"|>', "text:", "<|channel|>", "analysis", "final",
             "commentary to=functions.write ", "<|constrain|>json", "<|message|>", "<|end|>", "<|start|>assistant",
             "<|call|>", "<|python_tag|>", "write(", ")", "text='a'", "<think>", "</think>", "<|channel>thought\n",
             "<channel|>", "é", "ß", "7", "true", "<", "<|", "[[[[", "((((", "x" * 30]


def test_random_markup_never_raises_and_streams_as_one_shot():
    seed = 31337
    print(f"seed {seed}")
    rng = random.Random(seed)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40))) for _ in range(120)]
    for name in FORMATS:
        for text in texts:
            whole = parse_complete(TOOL_PARSERS[name]([WRITE]), text)
            expect = (whole[0], [[c["function"]["name"], c["function"]["arguments"]] for c in whole[1]])
            s = ToolStream(TOOL_PARSERS[name]([WRITE]))
            content, calls = "", {}
            for piece in random_cuts(rng, text) + [None]:
                c, deltas = s.feed(piece) if piece is not None else s.finish()
                content += c
                test_parsers.absorb(calls, deltas)
            assert (content, [calls[i] for i in sorted(calls)]) == expect, (name, text)
    for name in sorted({cls.name for cls in REASONING_PARSERS.values()}):
        for text in texts:
            parser = REASONING_PARSERS[name]()
            reasoning, content = parser.split(text)
            s = ReasoningStream(parser)
            got = [s.feed(p) for p in random_cuts(rng, text)] + [s.finish()]
            assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got)) == (reasoning, content)


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>{"name": "a\\x", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": ' + "[" * 50_000 + "]" * 50_000 + ', "name": "x"}</tool_call>'),
    ("pythonic", "[write(text=" + "[" * 50_000 + "]" * 50_000 + ")]"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n" + "[" * 50_000 + "]" * 50_000 +
     "\n</parameter>\n</function>\n</tool_call>"),
])
def test_pathological_calls_are_read_or_refused_never_raised(name, text):
    content, calls = parse_complete(TOOL_PARSERS[name]([WRITE]), text)
    assert content == text or calls
