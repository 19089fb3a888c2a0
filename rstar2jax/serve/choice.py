"""One choice of a chat completion (:class:`ChoiceStream`): streams its engine session and turns the tokens
into what the client sees: content held back while it may be the start of a tag or stop string, Hermes
``<tool_call>`` blocks parsed into OpenAI ``tool_calls``, per-token log-probs and their alternatives."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from rstar2jax.data.tool_parser import TOOL_CALL_OPEN, FunctionCall, parse_function_calls
from rstar2jax.engine import Session
from rstar2jax.serve.protocol import ChatRequest

if TYPE_CHECKING:
    from rstar2jax.serve.server import ChatService

__all__ = ["ChoiceStream"]

#: The engine's reasons a session is done, as OpenAI's finish reasons.
_FINISH = {"eos": "stop", "budget": "length"}


class ChoiceStream:
    """One choice of a request: streams its engine session and turns tokens into the content, tool calls and
    log-probs a client sees."""

    def __init__(self, service: ChatService, request: ChatRequest, session: Session, prompt_ids: list[int]):
        self.service, self.request, self.session, self.prompt_ids = service, request, session, prompt_ids
        self.tokens: list[int] = []  # sampled, the end-of-turn token excluded
        self.logprobs: list[float] = []
        self.num_sampled = 0
        self.text = ""
        self.emitted = 0  # characters of self.text already given to the client
        self.emitted_tokens = 0  # tokens whose log-probs were given
        self.token_ends: list[int] = []  # len(decode(tokens[:i + 1])) when log-probs are asked for
        self.top: list[list[tuple[int, float]]] = []
        self.finished = False

    def close(self) -> None:
        """Free the session's slot (idempotent); a segment in flight stops with the engine's next step."""
        self.session.close()

    def _held_back(self, text: str) -> int:
        """How many trailing characters may be the start of a tag or stop string (or of a UTF-8 sequence)."""
        guards = list(self.request.stop) + ([TOOL_CALL_OPEN] if self.request.parse_tools else [])
        held = 0
        for guard in guards:
            for size in range(min(len(guard) - 1, len(text)), held, -1):
                if guard.startswith(text[-size:]):
                    held = size
                    break
        while held < len(text) and text[len(text) - held - 1] == "\ufffd":
            held += 1
        if self.request.parse_tools:  # whitespace before a call is not content (the template writes its own)
            while held < len(text) and text[len(text) - held - 1].isspace():
                held += 1
        return held

    async def run(self) -> AsyncIterator[tuple[str, Any]]:
        """Yields ``("content", text, logprob entries)`` deltas, then ``("tool_calls", calls)`` if any,
        then ``("finish", finish_reason)``."""
        service, request = self.service, self.request
        stop_ids = [service.tool_call_end] if request.parse_tools else []
        opener = service.format.assistant_opener
        if opener:
            yield "content", opener, []
        finish = None
        try:
            async for chunk in self.session.stream(stop=stop_ids):
                self.num_sampled += len(chunk.tokens)
                tokens, logprobs = list(chunk.tokens), list(chunk.logprobs)
                if chunk.finish_reason == "eos" and tokens and tokens[-1] in service.eos_ids:
                    tokens, logprobs = tokens[:-1], logprobs[:-1]
                start = len(self.tokens)
                self.tokens += tokens
                self.logprobs += logprobs
                self.text = service.decode(self.tokens)
                if request.logprobs:
                    await self._token_logprobs(start)
                finish = _FINISH.get(chunk.finish_reason)
                if chunk.finish_reason == "stop":  # after </tool_call>: the turn ends here, as in training
                    finish = "stop"
                cut = self._find_stop(start)
                if cut is not None:
                    self.text, finish = self.text[:cut], "stop"
                content_end = len(self.text)
                if request.parse_tools and TOOL_CALL_OPEN in self.text:
                    content_end = len(self.text[: self.text.index(TOOL_CALL_OPEN)].rstrip())
                if finish is None:
                    content_end = min(content_end, len(self.text) - self._held_back(self.text))
                if content_end > self.emitted:
                    delta = self.text[self.emitted : content_end]
                    yield "content", delta, self._logprob_entries(content_end)
                    self.emitted = content_end
                if finish is not None:
                    break  # a stop string: leaving the stream stops the session
        finally:
            service.stats["completion_tokens"] += self.num_sampled
            self.close()
        calls = self._tool_calls() if request.parse_tools else []
        if calls:
            yield "tool_calls", calls
            finish = "tool_calls"
        elif self.emitted < len(self.text):  # an unparsable call stays visible as text
            yield "content", self.text[self.emitted :], self._logprob_entries(len(self.text))
            self.emitted = len(self.text)
        self.finished = True
        yield "finish", finish

    def _find_stop(self, start_token: int) -> int | None:
        """Where the first stop string starts in the text (looking only where new tokens could make one)."""
        if not self.request.stop:
            return None
        first = max(0, len(self.service.decode(self.tokens[:start_token])) - max(map(len, self.request.stop)))
        hits = [i for i in (self.text.find(s, first) for s in self.request.stop) if i != -1]
        return min(hits) if hits else None

    def _tool_calls(self) -> list[dict[str, Any]]:
        """The turn's calls when every block parses as a call of a listed tool; else none (the text stays)."""
        calls = parse_function_calls(self.text, tool_names=self.request.tool_names)
        if not calls or not all(isinstance(c, FunctionCall) for c in calls):
            return []
        self.emitted = len(self.text)
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in calls
        ]

    async def _token_logprobs(self, start: int) -> None:
        """Extends the per-token text ends and, with ``top_logprobs``, the alternatives of the new tokens."""
        decode = self.service.decode
        for i in range(start, len(self.tokens)):
            self.token_ends.append(len(decode(self.tokens[: i + 1])))
        k = self.request.top_logprobs
        if k and len(self.tokens) > start:
            self.top += await asyncio.to_thread(
                self.service.top_logprobs, self.prompt_ids, self.tokens, start, k
            )

    def _logprob_entries(self, content_end: int) -> list[dict[str, Any]]:
        """OpenAI log-prob entries of the tokens that end within the first ``content_end`` characters and were
        not given yet."""
        if not self.request.logprobs:
            return []
        entries = []
        while self.emitted_tokens < len(self.tokens) and self.token_ends[self.emitted_tokens] <= content_end:
            i = self.emitted_tokens
            entry = self.service.logprob_entry(self.tokens[i], self.logprobs[i])
            if self.request.top_logprobs:
                entry["top_logprobs"] = [self.service.logprob_entry(t, lp) for t, lp in self.top[i]]
            entries.append(entry)
            self.emitted_tokens += 1
        return entries
