"""Tokenizer helpers on the real Qwen3 tokenizer and on a tiny locally trained one."""

import json

import pytest

from rstar2jax.data.chat_template import HERMES_TOOL_TOKENS, encode_chat, encode_text, render_chat
from rstar2jax.data.tokenizer import (
    CHATML_SPECIAL_TOKENS,
    load_tokenizer,
    single_token_id,
    train_tiny_tokenizer,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "execute_python_code_with_standard_io",
        "description": "Run Python.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "input": {"type": "string"}},
            "required": ["code", "input"],
        },
    },
}
TOOL_CALL = {"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(6*7)", "input": ""}}
# A tool conversation ending at a generation prompt (Qwen3 adds <think> only to a final assistant message).
CONVERSATION = [
    {"role": "system", "content": "Reason, then answer."},
    {"role": "user", "content": "What is 6*7?"},
    {
        "role": "assistant",
        "content": "<reason>Compute it.</reason>",
        "tool_calls": [{"type": "function", "function": TOOL_CALL}],
    },
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<reason>Both.</reason>\n<tool_call>\n{}\n</tool_call>"},
    {"role": "tool", "content": "first"},
    {"role": "tool", "content": "second"},
]
CORPUS = [
    "The answer is \\boxed{42}. def f(x):\n    return x ** 2\nprint(f(3))",
    "<reason>Let me compute 17 * 23 with Python.</reason> Unicode: é, 中文, ∑.",
] * 20


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer):
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return train_tiny_tokenizer(CORPUS, vocab_size=400, out_dir=tmp_path_factory.mktemp("tiny_tokenizer"))


def test_qwen3_loads_offline_with_chatml_and_tool_tokens(qwen3):
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
    }
    assert {token: single_token_id(qwen3, token) for token in expected} == expected
    assert qwen3.eos_token == "<|im_end|>"
    with pytest.raises(ValueError, match="not a single token"):
        single_token_id(qwen3, "<answer>")


def test_qwen3_renders_hermes_tools_block_and_encodes_it(qwen3):
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q"}]
    text = render_chat(qwen3, messages, tools=[TOOL], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nSYS\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in text
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>'
        in text
    )
    assert text.endswith("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_chat(qwen3, messages, tools=[TOOL], add_generation_prompt=True)
    # The template writes the special tokens; encoding adds none (Qwen has no BOS).
    assert ids == qwen3.apply_chat_template(messages, tools=[TOOL], add_generation_prompt=True)["input_ids"]
    # <tool_call> and </tool_call> appear twice: in "within <tool_call></tool_call> XML tags" and the example.
    assert ids[0] == 151644 and ids.count(151657) == ids.count(151658) == 2
    assert qwen3.decode(ids) == text


def test_qwen3_renders_tool_calls_and_tool_responses(qwen3):
    text = render_chat(qwen3, CONVERSATION, tools=[TOOL], add_generation_prompt=True)
    call = json.dumps(TOOL_CALL)
    assert (
        f"<|im_start|>assistant\n<reason>Compute it.</reason>\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text
    assert (
        "<|im_start|>user\n<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n</tool_response>"
        in text
    )


def test_tiny_tokenizer_round_trips_and_keeps_special_tokens(tiny, tmp_path):
    assert len(tiny) <= 400 + len(HERMES_TOOL_TOKENS)
    for index, token in enumerate(CHATML_SPECIAL_TOKENS):
        assert single_token_id(tiny, token) == index
    tool_ids = [single_token_id(tiny, token) for token in HERMES_TOOL_TOKENS]
    assert len(set(tool_ids)) == len(HERMES_TOOL_TOKENS)
    assert (tiny.eos_token, tiny.pad_token, tiny.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # Any text round-trips (byte-level), including bytes never seen in training and the tags.
    text = "<|im_start|>user\nNever seen: ß ☃ 𝔸 \t\x01<tool_call>\n{}\n</tool_call><|im_end|>\n"
    ids = encode_text(tiny, text)
    assert tiny.decode(ids) == text
    assert single_token_id(tiny, "<tool_call>") in ids
    # The tool tags are not special: skip_special_tokens strips only the ChatML control tokens.
    assert tiny.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    )
    # Merges were learned from the corpus: frequent words take fewer ids than bytes.
    assert len(encode_text(tiny, "return")) < len("return")
    reloaded = load_tokenizer(tiny.name_or_path)
    assert encode_text(reloaded, text) == ids


def test_tiny_chat_template_matches_qwen3_rendering(tiny, qwen3):
    for tools in (None, [TOOL]):
        for messages in (CONVERSATION[:2], CONVERSATION[1:2], CONVERSATION):
            expected = render_chat(qwen3, messages, tools=tools, add_generation_prompt=True)
            assert render_chat(tiny, messages, tools=tools, add_generation_prompt=True) == expected


def test_tokenizer_errors_name_the_problem(tmp_path, tiny):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_tiny_tokenizer(CORPUS, vocab_size=100, out_dir=tmp_path)
    a_file = tmp_path / "tokenizer.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(a_file)
    with pytest.raises(ValueError, match="messages is empty"):
        render_chat(tiny, [])
    no_template = load_tokenizer(tiny.name_or_path)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        render_chat(no_template, CONVERSATION[:2])


@pytest.mark.parametrize("group", [1, 2, 3])
def test_digit_groups_are_single_tokens_wherever_a_number_appears(tmp_path, group):
    tokenizer = train_tiny_tokenizer(CORPUS, vocab_size=1400, out_dir=tmp_path, digit_group=group)
    text = "Compute 4^97 mod 829: [9, 22, 1234567]\nx1 = 10**6"
    ids = encode_text(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    numbers = [p for p in pieces if p.isdigit()]
    # Every run of digits is cut into groups of `group` from the left, each group exactly one token.
    expected = []
    for run in ("4", "97", "829", "9", "22", "1234567", "1", "10", "6"):
        expected += [run[i : i + group] for i in range(0, len(run), group)]
    assert numbers == expected
    # A number is the same token(s) after a space or a bracket.
    alone = encode_text(tokenizer, "829")
    assert alone == encode_text(tokenizer, " 829")[1:] == encode_text(tokenizer, "[829")[1:]


def test_digit_group_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="digit_group must be a positive"):
        train_tiny_tokenizer(CORPUS, vocab_size=400, out_dir=tmp_path, digit_group=0)
    with pytest.raises(ValueError, match="cannot hold the 1110 digit groups"):
        train_tiny_tokenizer(CORPUS, vocab_size=1000, out_dir=tmp_path, digit_group=3)
