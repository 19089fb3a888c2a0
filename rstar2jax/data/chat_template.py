"""Using a tokenizer's chat template: rendering and encoding chats, and tokenizing one for SFT.

- :func:`render_chat` / :func:`encode_chat` / :func:`encode_text`: a chat rendered by the template as text,
  then encoded as written (the template already writes every special token, so nothing is added);
- :data:`CHATML_TOOLS_TEMPLATE` and :data:`HERMES_TOOL_TOKENS`: the ChatML + Hermes tools template tiny
  tokenizers carry and the tool-call delimiters it writes;
- :func:`tokenize_conversation`: a whole conversation's ids with the SFT loss on exactly the tokens a
  rollout would sample.

Part of the conversation format (``rstar2jax.data.conversation`` re-exports every name here). Importing
this module does not import transformers (tokenizers are passed in).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Hermes tool-call delimiters. Added but not special, as in Qwen: decoding keeps them.
HERMES_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

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
            "(e.g. rstar2jax.data.conversation.CHATML_TOOLS_TEMPLATE)"
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


@dataclasses.dataclass(frozen=True)
class TokenizedConversation:
    """Token ids of a conversation and the SFT loss mask (1 on tokens the assistant wrote, 0 elsewhere)."""

    input_ids: list[int]
    loss_mask: list[int]


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A user turn appended after an assistant turn so that the template renders it as a finished, earlier turn.
_NEXT_TURN_PROBE = "\x00next-turn-probe\x00"


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    assistant_opener: str = "",
    end_of_turn: str | None = None,
    **template_kwargs: Any,
) -> TokenizedConversation:
    """Token ids and loss mask of a chat, with 1 exactly on the assistant-written tokens.

    Templates with ``{% generation %}`` tags and no ``assistant_opener`` use HF's
    ``apply_chat_template(return_assistant_tokens_mask=True)``. Otherwise (Qwen3's template,
    :data:`CHATML_TOOLS_TEMPLATE`, or with an opener, which a rollout encodes together with
    the inserted text while a whole-text tokenization may merge it into the assistant's first word) the chat
    is rendered incrementally, the way a rollout builds its token stream: for each assistant turn, the
    template's rendering of the history with the generation prompt (+ ``assistant_opener``) is inserted
    (mask 0), then the assistant's text up to and including ``end_of_turn`` (mask 1). Pieces are encoded
    separately, as a rollout encodes them, and each history rendering must extend the previous one (else
    ValueError). Rendering each assistant turn as a finished, earlier turn also keeps last-turn quirks
    (Qwen3's empty ``<think>`` block) out of the data.

    Args:
      tokenizer: a tokenizer with a chat template.
      messages: HF chat messages ending with an assistant turn (e.g. ``SFTExample.messages``).
      tools: tool schemas for the template's tools block (``PromptConfig.tools``).
      assistant_opener: text the rollout inserts at the start of every assistant turn (``"<reason>"``); it
        must start each assistant message's content and gets mask 0.
      end_of_turn: the text that ends an assistant turn (default ``tokenizer.eos_token``), incremental mode.
      **template_kwargs: extra chat-template variables (e.g. ``enable_thinking``).
    """
    roles = [m.get("role") for m in messages]
    if not roles or roles[-1] != "assistant":
        raise ValueError(
            f"messages must end with an assistant turn (nothing to train after it); roles {roles}"
        )
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        if message["role"] == "assistant" and not content.startswith(assistant_opener):
            raise ValueError(f"assistant message {i} does not start with the opener {assistant_opener!r}")
    tools = [dict(t) for t in tools] if tools else None
    if not assistant_opener and _GENERATION_TAG.search(tokenizer.get_chat_template(tools=tools)):
        return _tokenize_with_generation_tags(tokenizer, messages, tools, template_kwargs)
    end_of_turn = end_of_turn or tokenizer.eos_token
    if not end_of_turn:
        raise ValueError(
            "the tokenizer has no eos_token; pass end_of_turn (the text closing an assistant turn)"
        )
    return _tokenize_incrementally(tokenizer, messages, tools, assistant_opener, end_of_turn, template_kwargs)


def _tokenize_incrementally(tokenizer, messages, tools, assistant_opener: str, end_of_turn: str,
                            template_kwargs: Mapping[str, Any]) -> TokenizedConversation:
    """:func:`tokenize_conversation`'s incremental mode: each assistant turn's prompt (the history rendered
    with the generation prompt, + ``assistant_opener``; mask 0), then its text through ``end_of_turn`` (mask
    1), each piece encoded as a rollout encodes it."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    covered = ""  # the rendered text the ids encode so far
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        history = render_chat(
            tokenizer, messages[:i], tools=tools, add_generation_prompt=True, **template_kwargs
        )
        prompt = history + assistant_opener
        if not prompt.startswith(covered):
            raise ValueError(
                f"the chat template re-renders earlier turns differently once message {i} follows; it is not "
                "prefix-stable, so no rollout could have produced this token stream"
            )
        probe_messages = [*messages[: i + 1], {"role": "user", "content": _NEXT_TURN_PROBE}]
        rendered = render_chat(tokenizer, probe_messages, tools=tools, **template_kwargs)
        end = rendered.find(end_of_turn, len(prompt))
        if not rendered.startswith(prompt) or not 0 <= end < rendered.index(_NEXT_TURN_PROBE):
            raise ValueError(
                f"assistant message {i} is not rendered as generation prompt + content + {end_of_turn!r}: "
                f"{rendered[len(history) : rendered.index(_NEXT_TURN_PROBE)]!r}"
            )
        end += len(end_of_turn)
        for text, trainable in ((prompt[len(covered) :], 0), (rendered[len(prompt) : end], 1)):
            ids = encode_text(tokenizer, text)
            input_ids += ids
            loss_mask += [trainable] * len(ids)
        covered = rendered[:end]
    return TokenizedConversation(input_ids, loss_mask)


def _tokenize_with_generation_tags(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
) -> TokenizedConversation:
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **template_kwargs,
    )
    loss_mask = list(encoded["assistant_masks"])
    # Drop what the template writes after the last assistant turn (e.g. its newline): no rollout holds it.
    length = max(t + 1 for t, m in enumerate(loss_mask) if m)
    return TokenizedConversation(list(encoded["input_ids"])[:length], loss_mask[:length])
