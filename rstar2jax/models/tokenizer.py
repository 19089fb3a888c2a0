"""Tokenizer helpers: load a Hugging Face tokenizer, render chat templates with tools, train a tiny one.

Everything here works offline. A local directory is loaded with ``local_files_only=True``; a hub name is
passed through to ``transformers.AutoTokenizer`` (and then needs the hub cache or network).

Rendering and encoding are two steps on purpose: the chat template already writes every special token
(``<|im_start|>`` …, or a BOS for templates that want one), so the rendered text is encoded with
``add_special_tokens=False`` — otherwise tokenizers that add a BOS would add it twice.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: ChatML control tokens (special: ``skip_special_tokens=True`` strips them), in Qwen's id order.
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Hermes tool-call delimiters. Added but not special, as in Qwen: decoding keeps them.
HERMES_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Times each digit group is fed to the BPE trainer (see ``train_tiny_tokenizer``).
_DIGIT_GROUP_REPEATS = 1000

#: A Qwen-style ChatML template with Hermes tools: the system turn carries the ``# Tools`` block, assistant
#: ``tool_calls`` render as ``<tool_call>`` JSON, consecutive ``tool`` messages share one user turn of
#: ``<tool_response>`` blocks. For these messages it renders the same text as the Qwen3 template (which
#: additionally handles ``<think>`` reasoning content; tiny models have no use for that).
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


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


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Renders ``messages`` (and Hermes ``tools`` schemas) with the tokenizer's chat template, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template "
            "(e.g. rstar2jax.models.tokenizer.CHATML_TOOLS_TEMPLATE)"
        )
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` as written: special-token strings map to their ids, nothing is added."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the chat-template rendering of ``messages`` (see :func:`render_chat`)."""
    text = render_chat(
        tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return encode_text(tokenizer, text)


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
