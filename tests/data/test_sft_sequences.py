"""SFT rows: chats (loss on assistant-written tokens only) and pre-tokenised rows; unusable rows counted."""

import json

import pytest

from rstar2jax.data.sft_data import load_sft_sequences
from rstar2jax.data.tokenizer import load_tokenizer


def test_chat_and_pretokenised_rows(tmp_path, shared_dir):
    tokenizer = load_tokenizer(shared_dir / "tokenizers" / "qwen3")
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
    with pytest.raises(ValueError, match="need config.tokenizer"):
        load_sft_sequences(path)
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="'messages' or 'input_ids'"):
        load_sft_sequences(path)
