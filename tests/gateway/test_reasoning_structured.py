"""Reasoning-aware constraints: with a think block left open by the prompt, the grammar starts after it."""

from __future__ import annotations

import json

import pytest

from mlxd.gateway.structured import reasoning_aware, response_format_spec, structured_outputs_spec, tool_plan
from mlxd.shared.protocol import StructuredSpec

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>assistant\n"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=49152)


def accepts(ll_tokenizer, tokenizer, spec: StructuredSpec, text: str) -> bool:
    from llguidance import LLMatcher

    assert spec.kind == "grammar"
    m = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(spec.spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def aware(spec: StructuredSpec, prompt: str = OPEN_PROMPT) -> StructuredSpec:
    return reasoning_aware(spec, "qwen3", prompt, json.dumps)


def test_only_a_prompt_that_opens_a_think_block_changes_the_spec():
    spec = response_format_spec({"type": "json_object"})
    assert reasoning_aware(spec, "qwen3", CLOSED_PROMPT, json.dumps) is spec
    assert reasoning_aware(spec, None, OPEN_PROMPT, json.dumps) is spec
    assert reasoning_aware(None, "qwen3", OPEN_PROMPT, json.dumps) is None


CASES = [
    (response_format_spec({"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     '{"answer": "yes"}', '{"answer": "maybe"}'),
    (response_format_spec({"type": "json_object"}), '{"x": 1}', "[1]"),
    (structured_outputs_spec({"choice": ["red", "green"]}), "green", "blue"),
    (structured_outputs_spec({"regex": "[0-9]{3}"}), "123", "12a"),
    (structured_outputs_spec({"grammar": 'start: "a" b\nb: "b"+'}), "abbb", "ba"),
    (tool_plan(TOOLS, "required", False, None, False, json.dumps).spec,
     '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "no call"),
]


@pytest.mark.parametrize("spec,good,bad", CASES)
def test_the_reasoning_is_free_and_the_answer_is_held(spec, good, bad, ll_tokenizer, tokenizer):
    held = aware(spec)
    thought = "Let me think {not json} about it.\n</think>\n\n"
    assert accepts(ll_tokenizer, tokenizer, held, thought + good)
    assert accepts(ll_tokenizer, tokenizer, held, "</think>" + good)
    assert not accepts(ll_tokenizer, tokenizer, held, thought + bad)
    # The answer alone, without the reasoning closing first, is not what the model may write.
    assert not accepts(ll_tokenizer, tokenizer, held, good)
