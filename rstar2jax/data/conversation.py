"""The conversation format, in one place: what SFT data, rollouts and tokenizers agree on.

- the paper's prompt (Fig. 3): system prompt, user prefix, the ``<reason>`` assistant opener, the Python
  tool's schema (:class:`PromptConfig`, :func:`render_prompt_ids`);
- the tool-call syntax (Hermes ``<tool_call>`` JSON, parsed by ``rstar2jax.data.tool_parser``) and how a tool
  result is shown to the model (``data.tool_result.format_tool_result``, :func:`tool_response_ids`);
- the chat template use (``data.chat_template``: ``render_chat`` / ``encode_chat``, and the ChatML + Hermes
  tools template tiny tokenizers carry, ``CHATML_TOOLS_TEMPLATE``);
- tokenizing a whole conversation for SFT with the loss on exactly the tokens a rollout would sample
  (``data.chat_template.tokenize_conversation``);
- the format a policy was trained in, recorded in its folder beside ``config.json``
  (:data:`PROMPT_CONFIG_FILE`: :meth:`PromptConfig.save_pretrained`, :func:`load_prompt_config`), so that
  serving, evaluation, chat and further training prompt it as it was trained.

A trajectory is token in / token out: the prompt ids come from the chat template once
(:func:`render_prompt_ids`), the model's ids are kept as sampled, and after each model-written
``</tool_call>`` the rollout appends :func:`tool_response_ids` — the tokens that close the assistant turn,
a user turn of ``<tool_response>`` blocks and the next assistant opener. History is never re-tokenised.

The wrapper text around tool responses is not hard-coded: it is read off the tokenizer's own chat template
by rendering a probe conversation, so the concatenated trajectory is exactly the template's rendering of
the same conversation (with the assistant content starting at the opener ``<reason>``).

Rendering and encoding are two steps on purpose: the chat template already writes every special token
(``<|im_start|>`` …, or a BOS for templates that want one), so the rendered text is encoded with
``add_special_tokens=False`` (:func:`encode_text`) — otherwise tokenizers that add a BOS would add it twice.
The chat-template use (:func:`~rstar2jax.data.chat_template.render_chat`,
:func:`~rstar2jax.data.chat_template.tokenize_conversation`, …) lives in ``rstar2jax.data.chat_template``
and the tool-result rendering in ``rstar2jax.data.tool_result``: import their names from there.
Importing this module does not import transformers (tokenizers are passed in).
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rstar2jax.data.chat_template import encode_text, render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The paper's code tool (Fig. 3): run ``code`` with ``input`` as standard input.
PYTHON_TOOL_NAME = "execute_python_code_with_standard_io"

#: System prompt of the paper (Fig. 3 / the released chat template).
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> "
    "<answer> answer here </answer>."
)

#: User-turn prefix of the paper; the problem statement follows it directly.
DEFAULT_USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n"
)

#: Text the generation prompt ends with: every assistant turn opens with a reasoning block.
DEFAULT_ASSISTANT_OPENER = "<reason>"


def python_tool_schema(name: str = PYTHON_TOOL_NAME) -> dict[str, Any]:
    """The OpenAI/Hermes function schema of the Python tool, as listed in the system prompt's ``<tools>``."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": (
                "Execute Python code and return what it prints to standard output (and standard error). "
                "Use print() to see results. The code runs in a fresh process with a time limit."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The Python code to execute."},
                    "input": {
                        "type": "string",
                        "description": "Text passed to the program as standard input (may be empty).",
                    },
                },
                "required": ["code", "input"],
            },
        },
    }


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """What the model sees around a problem. Defaults are the paper's.

    Attributes:
      system_prompt: system turn text ('' renders no system text; with tools the template still writes
        the ``# Tools`` system turn).
      user_prefix: prepended to the problem statement in the user turn.
      assistant_opener: appended after the template's generation prompt and after each tool response.
      tools: the callable tools' function schemas (the tool-call parser accepts their names); empty for a
        tool-free prompt.
      list_tools: list ``tools`` in the template's ``# Tools`` system block. False leaves them callable but
        unlisted: a model taught the call format by SFT does not need the schema, and a tiny model saves its
        ~70 tokens in every sequence.
      chat_template_kwargs: extra variables for the chat template (e.g. ``enable_thinking``).
    """

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    user_prefix: str = DEFAULT_USER_PREFIX
    assistant_opener: str = DEFAULT_ASSISTANT_OPENER
    tools: tuple[Mapping[str, Any], ...] = dataclasses.field(default_factory=lambda: (python_tool_schema(),))
    list_tools: bool = True
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for field in ("system_prompt", "user_prefix", "assistant_opener"):
            if not isinstance(getattr(self, field), str):
                raise TypeError(
                    f"PromptConfig.{field} must be a str, got {type(getattr(self, field)).__name__}"
                )
        if not isinstance(self.tools, tuple):
            raise TypeError(f"PromptConfig.tools must be a tuple of schemas, got {type(self.tools).__name__}")

    def to_json_dict(self) -> dict[str, Any]:
        """The format as the JSON object of :data:`PROMPT_CONFIG_FILE` (``version`` first)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "version": PROMPT_CONFIG_VERSION,
            **fields,
            "tools": [dict(t) for t in self.tools],
            "chat_template_kwargs": dict(self.chat_template_kwargs),
        }

    @classmethod
    def from_json_dict(cls, record: Mapping[str, Any], where: str = "prompt config") -> PromptConfig:
        """The inverse of :meth:`to_json_dict`; ValueError naming ``where`` and the field for a version this
        code does not know, a missing or unknown field, or a value of the wrong type."""
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if record.get("version") != PROMPT_CONFIG_VERSION:
            raise ValueError(
                f"{where}: version {record.get('version')!r}; this rstar2jax reads version "
                f"{PROMPT_CONFIG_VERSION} (a newer rstar2jax wrote it?)"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in record]
        unknown = sorted(set(record) - {*names, "version"})
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; the fields are {names}")
        tools, kwargs = record["tools"], record["chat_template_kwargs"]
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise ValueError(f"{where}: 'tools' must be a list of function schemas, got {tools!r}")
        if not isinstance(kwargs, Mapping) or not isinstance(record["list_tools"], bool):
            raise ValueError(f"{where}: 'chat_template_kwargs' must be an object and 'list_tools' a bool")
        values = {n: record[n] for n in names} | {"tools": tuple(tools), "chat_template_kwargs": dict(kwargs)}
        try:
            cfg = cls(**values)
        except TypeError as error:
            raise ValueError(f"{where}: {error}") from None
        for tool in tools:
            function = tool.get("function", tool)
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where}: a tool schema names no function: {tool!r}")
        return cfg

    def save_pretrained(self, folder: str | os.PathLike) -> str:
        """Writes :data:`PROMPT_CONFIG_FILE` into ``folder`` (a policy folder: beside ``config.json``, as
        ``tokenizer.save_pretrained`` writes its files); returns the file's path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, PROMPT_CONFIG_FILE)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json_dict(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        return path

    @property
    def listed_tools(self) -> list[dict[str, Any]] | None:
        """The schemas the chat template lists (its ``tools`` argument), or None."""
        return [dict(t) for t in self.tools] if self.list_tools and self.tools else None

    @property
    def tool_names(self) -> tuple[str, ...]:
        """Names of the configured tools (what the tool-call parser accepts)."""
        return tuple(tool.get("function", tool)["name"] for tool in self.tools)


#: The file in a policy folder that records the conversation format the policy was trained in: every
#: :class:`PromptConfig` field (system prompt, user prefix, assistant opener, tool schemas, whether they are
#: listed, chat-template variables) and a ``version``. A folder without it is a plain HF model.
PROMPT_CONFIG_FILE = "rstar2jax_prompt.json"
#: The layout version of :data:`PROMPT_CONFIG_FILE` this code writes and reads.
PROMPT_CONFIG_VERSION = 1


def load_prompt_config(folder: str | os.PathLike) -> PromptConfig | None:
    """The format recorded in a policy folder (:data:`PROMPT_CONFIG_FILE`), or None when it records none
    (a plain HF folder). A file that does not parse is a ValueError naming it."""
    path = os.path.join(folder, PROMPT_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None
    return PromptConfig.from_json_dict(record, where=path)


#: Named formats: ``paper`` (the paper's system prompt, user prefix, listed Python tool and ``<reason>``
#: opener), ``bare`` (no system prompt, no prefix, the tool callable but unlisted: the CPU demo's policies)
#: and ``plain`` (the paper's instructions and tool with nothing after the generation prompt: how a plain HF
#: model, which records no format, is evaluated and chatted with).
PROMPTS: dict[str, Callable[[], PromptConfig]] = {
    "paper": PromptConfig,
    "bare": lambda: PromptConfig(system_prompt="", user_prefix="", list_tools=False),
    "plain": lambda: PromptConfig(assistant_opener=""),
}


def prompt_format(
    policy, preset: str | None = None, *, system_prompt: str | None = None, user_prefix: str | None = None,
    assistant_opener: str | None = None,
) -> PromptConfig:  # fmt: skip
    """The format to prompt ``policy`` in: the named ``preset`` (:data:`PROMPTS`) when given, else the one it
    was trained in (``policy.prompt``: a loaded :class:`~rstar2jax.policy.loader.Policy` carries the format
    its folder records, None for a plain HF folder), else ``plain``; each field given here replaces that
    format's."""
    if preset is not None and preset not in PROMPTS:
        raise ValueError(f"prompt format {preset!r}: expected one of {sorted(PROMPTS)}")
    base = PROMPTS[preset]() if preset else policy.prompt or PROMPTS["plain"]()
    overrides = dict(system_prompt=system_prompt, user_prefix=user_prefix, assistant_opener=assistant_opener)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def prompt_messages(problem: str, cfg: PromptConfig | None = None) -> list[dict[str, str]]:
    """The chat messages before the first assistant turn: the system turn (when ``cfg.system_prompt``) and
    the user turn (``cfg.user_prefix`` + the problem). Rollout prompts (:func:`render_prompt_text`) and SFT
    conversations (``data.sft_data``) both start with them, so the two cannot drift apart."""
    cfg = cfg or PromptConfig()
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": cfg.user_prefix + problem})
    return messages


def render_prompt_text(
    tokenizer: PreTrainedTokenizerBase, problem: str, cfg: PromptConfig | None = None
) -> str:
    """The prompt as text: system (+ tools) and user turns, the generation prompt, then the opener."""
    cfg = cfg or PromptConfig()
    if not isinstance(problem, str) or not problem:
        raise ValueError(f"problem must be a non-empty str, got {problem!r}")
    text = render_chat(
        tokenizer,
        prompt_messages(problem, cfg),
        tools=cfg.listed_tools,
        add_generation_prompt=True,
        **cfg.chat_template_kwargs,
    )
    return text + cfg.assistant_opener


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, problem: str, cfg: PromptConfig | None = None
) -> list[int]:
    """Token ids of :func:`render_prompt_text`; the rollout starts generating right after them."""
    return encode_text(tokenizer, render_prompt_text(tokenizer, problem, cfg))


def max_prompt_tokens(tokenizer: PreTrainedTokenizerBase, problems: Iterable, cfg: PromptConfig) -> int:
    """The longest rendered prompt among ``problems`` (each with a ``.problem`` text): an engine's prompt
    budget must cover it."""
    return max(len(render_prompt_ids(tokenizer, p.problem, cfg)) for p in problems)


# Probe strings for reading the template's tool-response wrapping; chosen so no template produces them.
# The tool probes carry outer whitespace so that a template which trims tool content is detected.
_PROBE_ASSISTANT = "\x00assistant-probe\x00"
_PROBE_TOOL = ("\n \x00tool-probe-1\x00 \n", "\n \x00tool-probe-2\x00 \n")


@dataclasses.dataclass(frozen=True)
class _ToolResponseWrapping:
    """The template's text around tool responses, after the assistant content and up to the next turn."""

    before_first: str  # closes the assistant turn and opens the tool turn
    between: str  # separates consecutive tool responses
    after_last: str  # closes the tool turn and writes the generation prompt


# Per tokenizer, keyed by (chat template, template kwargs): probing renders the whole system prompt.
_WRAPPING_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tool_response_wrapping(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any]
) -> _ToolResponseWrapping:
    key = (tokenizer.chat_template, tuple(sorted(template_kwargs.items())))
    per_tokenizer = _WRAPPING_CACHE.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        per_tokenizer[key] = _probe_tool_response_wrapping(tokenizer, template_kwargs)
    return per_tokenizer[key]


def _probe_tool_response_wrapping(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any]
) -> _ToolResponseWrapping:
    def continuation(tool_texts: Sequence[str]) -> str:
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ] + [{"role": "tool", "content": text} for text in tool_texts]
        rendered = render_chat(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
        if rendered.count(_PROBE_ASSISTANT) != 1:
            raise ValueError("the chat template does not render assistant content verbatim")
        return rendered.split(_PROBE_ASSISTANT, 1)[1]

    one, two = continuation(_PROBE_TOOL[:1]), continuation(_PROBE_TOOL)
    if one.count(_PROBE_TOOL[0]) != 1 or two.count(_PROBE_TOOL[1]) != 1:
        raise ValueError(
            "the chat template does not render tool messages verbatim (no 'tool' role, or it trims the "
            "content); token-in/token-out tool responses need the content inserted as is"
        )
    before_first, after_last = one.split(_PROBE_TOOL[0])
    between = two.split(_PROBE_TOOL[0])[1].split(_PROBE_TOOL[1])[0]
    if two != before_first + _PROBE_TOOL[0] + between + _PROBE_TOOL[1] + after_last:
        raise ValueError("the chat template wraps the first and later tool messages inconsistently")
    return _ToolResponseWrapping(before_first, between, after_last)


def tool_response_text(
    tokenizer: PreTrainedTokenizerBase,
    text: str | Sequence[str],
    cfg: PromptConfig | None = None,
    *,
    turn_closed: bool = False,
) -> str:
    """The text appended after a model-written ``</tool_call>``; see :func:`tool_response_ids`."""
    cfg = cfg or PromptConfig()
    texts = [text] if isinstance(text, str) else list(text)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("text must be a str or a non-empty sequence of str (one per tool call)")
    wrapping = _tool_response_wrapping(tokenizer, cfg.chat_template_kwargs)
    before = wrapping.before_first
    if turn_closed:
        before = _strip_turn_end(tokenizer, before)
    return before + wrapping.between.join(texts) + wrapping.after_last + cfg.assistant_opener


def _strip_turn_end(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """``text`` without the eos token it starts with (the model wrote it); ValueError if it does not."""
    eos = tokenizer.eos_token
    if not eos or not text.startswith(eos):
        raise ValueError(
            f"turn_closed=True but the template's turn end {text[:20]!r} does not start with the eos "
            f"token {eos!r}"
        )
    return text[len(eos) :]


_PROBE_USER = "\x00user-probe\x00"


def user_turn_text(
    tokenizer: PreTrainedTokenizerBase, text: str, cfg: PromptConfig | None = None, *, turn_closed: bool
) -> str:
    """The text that follows a finished assistant turn for a new user message (a chat's next turn): the
    template's turn end (left out with ``turn_closed``: the model wrote it), the user turn, the generation
    prompt and the opener, read off the chat template by rendering a probe conversation."""
    cfg = cfg or PromptConfig()
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _PROBE_ASSISTANT},
        {"role": "user", "content": _PROBE_USER},
    ]
    rendered = render_chat(tokenizer, messages, add_generation_prompt=True, **cfg.chat_template_kwargs)
    after = rendered.split(_PROBE_ASSISTANT, 1)[1]
    if after.count(_PROBE_USER) != 1:
        raise ValueError("the chat template does not render user messages verbatim")
    if turn_closed:
        after = _strip_turn_end(tokenizer, after)
    return after.replace(_PROBE_USER, text) + cfg.assistant_opener


def tool_response_ids(
    tokenizer: PreTrainedTokenizerBase,
    text: str | Sequence[str],
    cfg: PromptConfig | None = None,
    *,
    turn_closed: bool = False,
) -> list[int]:
    """Token ids to append after a model-written ``</tool_call>`` (loss mask 0).

    For Qwen's ChatML they encode (newlines shown as ``\\n``)::

        <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n
        <|im_start|>assistant\\n<reason>

    The assistant turn is closed, the tool output(s) form one user turn exactly as the chat template renders
    ``tool`` messages, and the next assistant turn is opened.

    Args:
      tokenizer: the policy's tokenizer (its chat template defines the wrapping).
      text: the formatted tool output (``data.tool_result.format_tool_result`` or a parse-error message), or
        one per tool call when a turn made several calls.
      cfg: prompt configuration (the opener).
      turn_closed: the model already ended its turn with the eos token (``<|im_end|>``) after the call;
        the continuation then starts after it.
    """
    return encode_text(tokenizer, tool_response_text(tokenizer, text, cfg, turn_closed=turn_closed))
