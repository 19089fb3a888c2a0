"""Tokenizer helpers: load a Hugging Face tokenizer, look up single-token ids, train a tiny one.

Everything here works offline. A local directory is loaded with ``local_files_only=True``; a hub name is
passed through to ``transformers.AutoTokenizer`` (and then needs the hub cache or network). How a chat is
rendered and encoded is the conversation format's business (``rstar2jax.data.conversation``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rstar2jax.data.chat_template import CHATML_TOOLS_TEMPLATE, HERMES_TOOL_TOKENS, encode_text

#: ChatML control tokens (special: ``skip_special_tokens=True`` strips them), in Qwen's id order.
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Times each digit group is fed to the BPE trainer (see ``train_tiny_tokenizer``).
_DIGIT_GROUP_REPEATS = 1000



def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Loads a tokenizer from a local directory (offline) or a hub name via ``AutoTokenizer``.

    Extra keyword arguments go to ``AutoTokenizer.from_pretrained``.
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        kwargs.setdefault("local_files_only", True)
    elif os.path.exists(path):
        raise ValueError(f"tokenizer path {path!r} is a file; pass the directory that holds tokenizer.json")
    return AutoTokenizer.from_pretrained(path, **kwargs)


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of ``token`` when it encodes to exactly one id (stop tokens such as ``</tool_call>``)."""
    ids = encode_text(tokenizer, token)
    if len(ids) != 1:
        raise ValueError(f"{token!r} is not a single token in this tokenizer: it encodes to {ids}")
    return ids[0]


def train_tiny_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    chat_template: str = CHATML_TOOLS_TEMPLATE,
    digit_group: int | None = None,
) -> PreTrainedTokenizerBase:
    """Trains a byte-level BPE tokenizer on ``texts`` and saves it as a Hugging Face tokenizer directory.

    The vocabulary starts with the ChatML special tokens (ids 0, 1, 2), then the 256 byte symbols (so any
    text round-trips), then learned merges; the Hermes tool tags are appended as added tokens. ``vocab_size``
    bounds the trained part (special tokens + bytes + merges); the final ``len(tokenizer)`` is at most
    ``vocab_size + 4`` and smaller when the corpus runs out of merges. ``eos_token`` is ``<|im_end|>`` and
    ``pad_token`` is ``<|endoftext|>``, as in Qwen. Returns the tokenizer reloaded from ``out_dir``.

    ``digit_group=n`` splits every run of digits into groups of up to ``n`` from the left, apart from the
    text around it (Qwen splits single digits, n=1; Llama 3 and GPT-4 split groups of three), and makes
    every group of 1 to ``n`` digits one token, so a number reads the same wherever it appears: in a
    problem, in code, in a tool's output. The ``10 + ... + 10**n`` group tokens come out of ``vocab_size``
    (ValueError if it cannot hold them). None keeps byte-level BPE's own number handling.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(CHATML_SPECIAL_TOKENS) + len(byte_alphabet)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the special tokens and the {len(byte_alphabet)} byte "
            f"symbols alone need {minimum}"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    groups: list[str] = []
    if digit_group is not None:
        if digit_group < 1:
            raise ValueError(f"digit_group must be a positive number of digits, got {digit_group}")
        groups = [f"{i:0{width}d}" for width in range(1, digit_group + 1) for i in range(10**width)]
        if minimum + len(groups) - 10 > vocab_size:  # the 10 single digits are bytes already
            raise ValueError(
                f"vocab_size={vocab_size} cannot hold the {len(groups)} digit groups of digit_group="
                f"{digit_group} besides the {minimum} special and byte symbols"
            )
        digits = pre_tokenizers.Split(Regex(rf"\d{{1,{digit_group}}}"), behavior="isolated")
        bpe.pre_tokenizer = pre_tokenizers.Sequence([digits, bpe.pre_tokenizer])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=byte_alphabet,
        show_progress=False,
    )
    # Every digit group, often enough that its merges come before all but the commonest text merges.
    texts = itertools.chain(texts, [" ".join(groups)] * _DIGIT_GROUP_REPEATS if groups else [])
    bpe.train_from_iterator(texts, trainer)
    if groups:
        split = [g for g in groups if len(bpe.encode(g).ids) != 1]
        if split:
            raise ValueError(f"digit groups {split[:5]} did not become single tokens; raise vocab_size")
    bpe.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in HERMES_TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )
    tokenizer.save_pretrained(os.fspath(out_dir))
    return load_tokenizer(out_dir)
