"""Hermes tool-call parsing: valid calls, structured failures with model-facing messages, several calls."""

import json

import pytest

from rstar2jax.data.chat_template import render_chat
from rstar2jax.data.conversation import PYTHON_TOOL_NAME, python_tool_schema
from rstar2jax.data.tool_parser import (
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    parse_tool_call,
    parse_tool_calls,
)

Kind = ToolCallErrorKind


def call_json(arguments, name=PYTHON_TOOL_NAME, **extra):
    return json.dumps({"name": name, "arguments": arguments, **extra})


@pytest.mark.parametrize(
    "body, expected",
    [
        (call_json({"code": "print(1)", "input": ""}), ToolCall(PYTHON_TOOL_NAME, "print(1)", "")),
        (
            call_json({"code": "print(input())", "input": "7\n"}),
            ToolCall(PYTHON_TOOL_NAME, "print(input())", "7\n"),
        ),
        # "arguments" as a JSON string holding the object, as some models and servers write it.
        (
            call_json(json.dumps({"code": "x = 1\nprint(x)"})),
            ToolCall(PYTHON_TOOL_NAME, "x = 1\nprint(x)", ""),
        ),
        ("\n  " + call_json({"code": "print('é')"}) + "  \n", ToolCall(PYTHON_TOOL_NAME, "print('é')", "")),
    ],
)
def test_valid_calls(body, expected):
    assert parse_tool_call(body) == expected


@pytest.mark.parametrize(
    "body, kind, message_part",
    [
        (
            '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1)"}',
            Kind.MALFORMED_JSON,
            "not valid JSON",
        ),
        ("", Kind.MALFORMED_JSON, "not valid JSON"),
        (
            '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "a\nb"}}',
            Kind.MALFORMED_JSON,
            "write newlines inside JSON strings as \\n",
        ),
        ("[1, 2]", Kind.BAD_STRUCTURE, "expected a JSON object"),
        (json.dumps({"arguments": {"code": "1"}}), Kind.BAD_STRUCTURE, "missing string 'name'"),
        (json.dumps({"name": 3, "arguments": {"code": "1"}}), Kind.BAD_STRUCTURE, "missing string 'name'"),
        (json.dumps({"name": PYTHON_TOOL_NAME}), Kind.BAD_STRUCTURE, "missing 'arguments'"),
        (call_json({"code": "1"}, id="call_0"), Kind.BAD_STRUCTURE, "unexpected key(s) ['id']"),
        (call_json({"code": "1"}, name="python"), Kind.UNKNOWN_TOOL, "unknown tool 'python'"),
        (call_json("not json"), Kind.BAD_ARGUMENTS, "the 'arguments' string is not valid JSON"),
        (call_json(["print(1)"]), Kind.BAD_ARGUMENTS, "'arguments' must be a JSON object"),
        (call_json(json.dumps("print(1)")), Kind.BAD_ARGUMENTS, "'arguments' must be a JSON object"),
        (call_json({"input": "1"}), Kind.BAD_ARGUMENTS, "'code' must be a non-empty string"),
        (call_json({"code": 5}), Kind.BAD_ARGUMENTS, "'code' must be a non-empty string"),
        (call_json({"code": "  \n"}), Kind.BAD_ARGUMENTS, "'code' must be a non-empty string"),
        (call_json({"code": "1", "input": 5}), Kind.BAD_ARGUMENTS, "'input' must be a string"),
        (call_json({"code": "1", "timeout": 9}), Kind.BAD_ARGUMENTS, "unexpected argument(s) ['timeout']"),
    ],
)
def test_failures_are_structured_with_a_message_for_the_model(body, kind, message_part):
    result = parse_tool_call(body)
    assert isinstance(result, ToolCallError)
    assert result.kind is kind
    assert result.message.startswith("Error: invalid tool call: ")
    assert message_part in result.message


def test_unknown_tool_message_lists_the_available_tools():
    result = parse_tool_call(call_json({"code": "1"}, name="bash"), tool_names=("a_tool", "b_tool"))
    assert result.message.endswith("available tools: ['a_tool', 'b_tool']")
    assert parse_tool_call(
        call_json({"code": "1"}, name="b_tool"), tool_names=("a_tool", "b_tool")
    ) == ToolCall("b_tool", "1", "")


def test_several_calls_per_turn_in_order():
    good = call_json({"code": "print(1)"})
    text = (
        f"<reason>First.</reason>\n<tool_call>\n{good}\n</tool_call>\n"
        "<tool_call>\n{not json}\n</tool_call>\n"
        f"<tool_call>{call_json({'code': 'print(2)', 'input': 'x'})}</tool_call>"
    )
    first, second, third = parse_tool_calls(text)
    assert first == ToolCall(PYTHON_TOOL_NAME, "print(1)", "")
    assert second.kind is Kind.MALFORMED_JSON
    assert third == ToolCall(PYTHON_TOOL_NAME, "print(2)", "x")
    assert parse_tool_calls("<reason>No tool needed.</reason><answer>\\boxed{3}</answer>") == []


def test_unbalanced_tags_are_reported_not_guessed():
    good = call_json({"code": "print(1)"})
    assert [r.kind for r in parse_tool_calls(f"<tool_call>\n{good}")] == [Kind.UNTERMINATED]
    assert [r.kind for r in parse_tool_calls(f"{good}\n</tool_call>")] == [Kind.UNOPENED]
    # A block re-opened before it closes: the first is unterminated, the second still parses.
    results = parse_tool_calls(f"<tool_call>{{'half': <tool_call>{good}</tool_call> trailing </tool_call>")
    assert [getattr(r, "kind", None) for r in results] == [Kind.UNTERMINATED, None, Kind.UNOPENED]
    assert results[1] == ToolCall(PYTHON_TOOL_NAME, "print(1)", "")


def test_parses_what_the_qwen3_template_renders(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    arguments = {"code": 'import sys\nprint("{}".format(sys.stdin.read()[::-1]))', "input": "abc"}
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "<reason>r</reason>",
            "tool_calls": [
                {"type": "function", "function": {"name": PYTHON_TOOL_NAME, "arguments": arguments}},
                {
                    "type": "function",
                    "function": {"name": PYTHON_TOOL_NAME, "arguments": json.dumps(arguments)},
                },
            ],
        },
        {"role": "tool", "content": "cba"},
    ]
    # Only the assistant turn: the system turn's # Tools block shows the tags too.
    text = render_chat(tokenizer, messages, tools=[python_tool_schema()]).split("<|im_start|>assistant")[1]
    expected = ToolCall(PYTHON_TOOL_NAME, arguments["code"], "abc")
    assert parse_tool_calls(text) == [expected, expected]
