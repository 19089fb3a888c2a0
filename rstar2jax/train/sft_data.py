"""SFT examples from JSONL as ``TokenSequence``s.

A row is either a chat, ``{"messages": [...], "tools": [...]?, "assistant_opener": "<reason>"?}`` (tokenised
the way a rollout builds its token stream by ``rstar2jax.data.sft_data.tokenize_conversation``: loss on the
assistant-written tokens only), or pre-tokenised ``{"input_ids": [...], "loss_mask": [...]}``.
"""

from __future__ import annotations

import json
import os

from rstar2jax.train.batch import TokenSequence


def load_sft_sequences(path: str | os.PathLike, tokenizer=None) -> tuple[list[TokenSequence], int]:
    """Reads SFT examples; returns the sequences and the count of rows skipped for having nothing to train on
    (fewer than two tokens, or no loss token after the first)."""
    sequences, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                from rstar2jax.data.sft_data import tokenize_conversation  # imports transformers

                if tokenizer is None:
                    raise ValueError(f"{path}:{line_number}: chat rows need config.tokenizer")
                if not any(m.get("role") == "assistant" for m in row["messages"]):
                    skipped += 1
                    continue
                try:
                    tokenized = tokenize_conversation(
                        tokenizer,
                        row["messages"],
                        tools=row.get("tools"),
                        assistant_opener=row.get("assistant_opener", ""),
                    )
                except ValueError as error:
                    raise ValueError(f"{path}:{line_number}: {error}") from error
                ids, mask = tokenized.input_ids, tokenized.loss_mask
            elif "input_ids" in row:
                ids, mask = row["input_ids"], row.get("loss_mask")
                if mask is None or len(mask) != len(ids):
                    raise ValueError(f"{path}:{line_number}: input_ids needs a loss_mask of the same length")
            else:
                raise ValueError(f"{path}:{line_number}: a row needs 'messages' or 'input_ids'")
            if len(ids) < 2 or not any(mask[1:]):
                skipped += 1
                continue
            # The first token has no context to be predicted from.
            sequences.append(TokenSequence(tokens=list(ids), loss_mask=[0, *mask[1:]]))
    return sequences, skipped
