"""SFT rows: chats (loss on assistant-written tokens only) and pre-tokenised rows; unusable rows counted;
function-calling chat sets as users bring them (JSONL, JSON, parquet, a datasets.Dataset)."""

import json

import datasets
import pytest

from rstar2jax.data.sft_data import assistant_openers, load_sft_sequences


def test_chat_and_pretokenised_rows(tmp_path, qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    chat = {
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<reason>easy</reason><answer>\\boxed{4}</answer>"},
        ]
    }
    rows = [
        chat,
        {"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 1]},
        {"input_ids": [5, 6], "loss_mask": [0, 0]},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sequences, skipped = load_sft_sequences(path, tokenizer)
    assert skipped == 2 and len(sequences) == 2
    chat_seq, ids_seq = sequences
    trained = tokenizer.decode([t for t, m in zip(chat_seq.tokens, chat_seq.loss_mask, strict=True) if m])
    assert trained == "<reason>easy</reason><answer>\\boxed{4}</answer><|im_end|>"
    context = tokenizer.decode([t for t, m in zip(chat_seq.tokens, chat_seq.loss_mask, strict=True) if not m])
    assert "What is 2+2?" in context and "<answer>" not in context
    assert list(ids_seq.tokens) == [5, 6, 7, 8] and list(ids_seq.loss_mask) == [0, 0, 1, 1]

    path.write_text(json.dumps(chat) + "\n")
    with pytest.raises(ValueError, match="need a tokenizer"):
        load_sft_sequences(path)
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="'messages' or 'input_ids'"):
        load_sft_sequences(path)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# An OpenAI-style function-calling row: tool schemas as a JSON string, arguments as a JSON string, content
# None beside the call, ids on the call and the tool turn.
FUNCTION_CALLING_ROW = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "How warm is it in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "tools": json.dumps([WEATHER_TOOL]),
}


def test_function_calling_chat_sets_from_every_source(tmp_path, qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    jsonl, as_json, parquet = tmp_path / "a.jsonl", tmp_path / "a.json", tmp_path / "a.parquet"
    jsonl.write_text(json.dumps(FUNCTION_CALLING_ROW) + "\n")
    as_json.write_text(json.dumps([FUNCTION_CALLING_ROW]))
    datasets.Dataset.from_list([FUNCTION_CALLING_ROW]).to_parquet(parquet)
    in_memory = datasets.Dataset.from_list([FUNCTION_CALLING_ROW])
    loaded = [load_sft_sequences(source, tokenizer) for source in (jsonl, as_json, parquet, in_memory)]
    (sequence,), skipped = loaded[0]
    assert skipped == 0
    for other in loaded[1:]:  # the same tokens and mask whatever the source
        assert [(list(s.tokens), list(s.loss_mask)) for s in other[0]] == [
            (list(sequence.tokens), list(sequence.loss_mask))
        ]
    pairs = list(zip(sequence.tokens, sequence.loss_mask, strict=True))
    trained = tokenizer.decode([t for t, m in pairs if m])
    assert trained == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "It is 21 degrees in Paris.<|im_end|>"
    )
    context = tokenizer.decode([t for t, m in pairs if not m])
    # The template's tools block and the tool turn are context, never trained on.
    assert '"name": "get_weather"' in context
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in context
    assert context.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_bad_function_calling_rows_name_the_row(tmp_path, qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    broken = json.loads(json.dumps(FUNCTION_CALLING_ROW))
    broken["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"city": Paris}'
    with pytest.raises(ValueError, match=r"row 1: message 2: tool call arguments are not JSON"):
        load_sft_sequences([FUNCTION_CALLING_ROW, broken], tokenizer)
    renamed = json.loads(json.dumps(FUNCTION_CALLING_ROW))
    renamed["messages"][3]["role"] = "function"
    with pytest.raises(ValueError, match=r"row 0: message 3 has role 'function'"):
        load_sft_sequences([renamed], tokenizer)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_sft_sequences(tmp_path / "missing.jsonl", tokenizer)


def test_assistant_openers_of_the_chat_rows(tmp_path):
    """What an SFT export records as the policy's opener: the one its chat rows share."""
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<reason>x"}]}
    rows = [{**chat, "assistant_opener": "<reason>"}, {"input_ids": [1, 2], "loss_mask": [0, 1]}]
    assert assistant_openers(rows) == {"<reason>"}  # pre-tokenised rows say nothing
    assert assistant_openers([*rows, chat]) == {"<reason>", ""}  # a row without one opens with nothing
    assert assistant_openers(rows[1:]) == set()
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert assistant_openers(path) == {"<reason>"}
