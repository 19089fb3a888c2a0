"""The rStar2-Agent prompt and the token-level tool-response protocol (paper Fig. 3, §2.1).

A trajectory is token in / token out: the prompt ids come from the chat template once
(:func:`render_prompt_ids`), the model's ids are kept as sampled, and after each model-written
``</tool_call>`` the rollout appends :func:`tool_response_ids` — the tokens that close the assistant turn,
a user turn of ``<tool_response>`` blocks and the next assistant opener. History is never re-tokenised.

The wrapper text around tool responses is not hard-coded: it is read off the tokenizer's own chat template
by rendering a probe conversation, so the concatenated trajectory is exactly the template's rendering of
the same conversation (with the assistant content starting at the opener ``<reason>``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from rstar2jax.models.tokenizer import encode_text, render_chat

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

    @property
    def listed_tools(self) -> list[dict[str, Any]] | None:
        """The schemas the chat template lists (its ``tools`` argument), or None."""
        return [dict(t) for t in self.tools] if self.list_tools and self.tools else None

    @property
    def tool_names(self) -> tuple[str, ...]:
        """Names of the configured tools (what the tool-call parser accepts)."""
        return tuple(tool.get("function", tool)["name"] for tool in self.tools)


def _prompt_messages(problem: str, cfg: PromptConfig) -> list[dict[str, str]]:
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
        _prompt_messages(problem, cfg),
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
        eos = tokenizer.eos_token
        if not eos or not before.startswith(eos):
            raise ValueError(
                f"turn_closed=True but the template's turn end {before[:20]!r} does not start with the eos "
                f"token {eos!r}"
            )
        before = before[len(eos) :]
    return before + wrapping.between.join(texts) + wrapping.after_last + cfg.assistant_opener


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
      text: the formatted tool output (:func:`format_tool_result` or a parse-error message), or one per
        tool call when a turn made several calls.
      cfg: prompt configuration (the opener).
      turn_closed: the model already ended its turn with the eos token (``<|im_end|>``) after the call;
        the continuation then starts after it.
    """
    return encode_text(tokenizer, tool_response_text(tokenizer, text, cfg, turn_closed=turn_closed))


def truncate_middle(text: str, max_chars: int) -> str:
    """Keeps the head and the tail of ``text`` within ``max_chars`` characters, marking the cut."""
    if len(text) <= max_chars:
        return text
    omitted = len(text) - max_chars
    while True:  # the marker's length depends on the number it reports; settles in at most two steps
        marker = f"\n...[{omitted} characters truncated]...\n"
        keep = max_chars - len(marker)
        if keep < 2:
            raise ValueError(f"max_chars={max_chars} is too small to hold the truncation marker {marker!r}")
        if len(text) - keep == omitted:
            break
        omitted = len(text) - keep
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def format_tool_result(result: Mapping[str, Any] | Any, max_chars: int) -> str:
    """Renders a sandbox result for the model, at most ``max_chars`` characters (head and tail kept).

    ``result`` is the sandbox wire result (a mapping, or an object with the same attributes) with at least
    ``status``, ``stdout`` and ``stderr``. A clean run (status ``ok``, empty stderr) shows stdout as is;
    anything else is labelled so the model can tell the streams and the failure kind apart::

        status: timeout
        stdout:
        ...
        stderr:
        ...
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")

    def field(name: str) -> Any:
        value = result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)
        if value is None and name == "status":
            raise ValueError(f"tool result has no 'status': {result!r}")
        return value or ""

    status, stdout, stderr = str(field("status")), str(field("stdout")), str(field("stderr"))
    if status == "ok" and not stderr:
        text = stdout if stdout else "(no output)"
    else:
        parts = [f"status: {status}"]
        if stdout:
            parts.append(f"stdout:\n{stdout}")
        if stderr:
            parts.append(f"stderr:\n{stderr}")
        text = "\n".join(parts)
    return truncate_middle(text, max_chars)
