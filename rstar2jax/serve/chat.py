"""A multi-turn chat with a policy whose Python calls really run, shown as they happen.

Each user turn continues the same token stream the policy was trained on: the first turn is the training
prompt (:func:`~rstar2jax.data.conversation.render_prompt_ids`), later turns append the chat template's user
turn (:func:`~rstar2jax.data.conversation.user_turn_text`) after the model's closed turn, and every assistant
turn is a training rollout turn (:func:`~rstar2jax.agent.multi_turn.converse_async`: same tool-call parser,
sandbox and tool-response format), observed live.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from rstar2jax.agent.multi_turn import Conversation, converse_async
from rstar2jax.agent.rollout_types import RolloutConfig, ToolSandbox
from rstar2jax.data.chat_template import encode_text
from rstar2jax.data.conversation import render_prompt_ids, user_turn_text
from rstar2jax.data.tool_parser import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    FunctionCall,
    ToolCall,
    ToolCallError,
    as_python_call,
)
from rstar2jax.engine import Engine


class TerminalObserver:
    """Prints a turn as it happens: the model's text (its reasoning) as it is sampled, each Python call's
    code instead of its JSON (another tool's call as its name and arguments), and the call's real output."""

    def __init__(
        self,
        out: TextIO = sys.stdout,
        color: bool | None = None,
        hide: tuple[str, ...] = (),
        opener: str = "",
    ):
        self.out = out
        self.opener = opener  # shown where each model turn starts (it is part of the prompt, not sampled)
        self.turn_start = True
        self.hide = hide  # e.g. the end-of-turn token
        self.color = out.isatty() if color is None else color
        self.in_call = False
        self.pending = ""  # text that may be the start of a tag

    def _style(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def on_text(self, text: str) -> None:
        for token in self.hide:
            text = text.replace(token, "")
        if self.turn_start:
            text, self.turn_start = self.opener + text, False
        self.pending += text
        shown = []
        while self.pending:
            tag = TOOL_CALL_CLOSE if self.in_call else TOOL_CALL_OPEN
            at = self.pending.find(tag)
            if at == -1:
                keep = next(
                    (
                        n
                        for n in range(min(len(tag) - 1, len(self.pending)), 0, -1)
                        if tag.startswith(self.pending[-n:])
                    ),
                    0,
                )
                if not self.in_call:
                    shown.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if not self.in_call:
                shown.append(self.pending[:at])
            self.pending = self.pending[at + len(tag) :]
            self.in_call = not self.in_call
        self.out.write("".join(shown))
        self.out.flush()

    def on_call(self, call: FunctionCall | ToolCallError) -> None:
        python = as_python_call(call) if isinstance(call, FunctionCall) else None
        if isinstance(python, ToolCall):
            text = f"\n[python]\n{python.code}" + (f"\n[stdin]\n{python.input}" if python.input else "")
        elif isinstance(call, FunctionCall):
            text = f"\n[{call.name}] {json.dumps(call.arguments, ensure_ascii=False)}"
        else:
            text = f"\n[invalid tool call] {call.message}"
        self.out.write(self._style(text.rstrip("\n") + "\n", "36"))
        self.out.flush()

    def on_result(self, call: FunctionCall | ToolCallError, outcome: str, response: str) -> None:
        if isinstance(call, FunctionCall):
            self.out.write(self._style(f"[output: {outcome}]\n{response.rstrip()}\n", "33"))
            self.out.flush()
        self.turn_start = True

    def new_turn(self) -> None:
        """The next text starts a model turn."""
        self.turn_start = True


@dataclasses.dataclass
class ChatSession:
    """A chat's state: the token stream so far (None before the first turn) and the rollout settings.

    ``engine`` must be running (``async with engine``); ``max_tokens`` bounds each assistant turn (tool
    output included); the context of the whole chat must fit the engine's ``max_len``. ``tools``: as
    :func:`~rstar2jax.agent.rollout_async`'s (None: the sandbox's Python tool).
    """

    engine: Engine
    tokenizer: object
    sandbox: ToolSandbox
    config: RolloutConfig
    max_len: int
    history: list[int] | None = None
    tools: Sequence[Any] | None = None

    async def turn(self, text: str, observer=None) -> Conversation:
        """Sends a user message, runs the assistant's turn (with its tool calls), returns it."""
        cfg = self.config.prompt
        if self.history is None:
            prompt_ids = render_prompt_ids(self.tokenizer, text, cfg)
        else:
            closed = bool(self.history) and self.history[-1] == self.tokenizer.eos_token_id
            prompt_ids = self.history + encode_text(
                self.tokenizer, user_turn_text(self.tokenizer, text, cfg, turn_closed=closed)
            )
        budget = min(self.config.max_response_length, self.max_len - len(prompt_ids))
        if budget < 1:
            raise ValueError(
                f"the chat is {len(prompt_ids)} tokens long: it no longer fits the context "
                f"({self.max_len} tokens); start a new chat"
            )
        if observer is not None and hasattr(observer, "new_turn"):
            observer.new_turn()
        (session,) = await self.engine.open(prompt_ids, 1, sampling=self.config.sampling, max_tokens=budget)
        try:
            conversation = await converse_async(
                session, sandbox=self.sandbox, tokenizer=self.tokenizer, config=self.config,
                observer=observer, tools=self.tools,
            )
        finally:
            with contextlib.suppress(RuntimeError):  # interrupted mid-generate: the engine is stopping
                session.close()
        self.history = prompt_ids + conversation.response_ids
        return conversation
