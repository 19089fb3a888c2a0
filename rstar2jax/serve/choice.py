"""One choice of a chat completion (:class:`ChoiceStream`): streams its engine session and turns the tokens
into what the client sees: content held back while it may be the start of a tag or stop string, Hermes
``<tool_call>`` blocks parsed into OpenAI ``tool_calls``, per-token log-probs and their alternatives.

What a choice needs of its server is :class:`ChoiceContext` (the policy's :class:`TokenText`, the end-of-turn
ids, the opener, the metrics), so this module does not reach back into the server
(:mod:`rstar2jax.serve.server` builds the context).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax import models
from rstar2jax.data.tool_parser import TOOL_CALL_OPEN, FunctionCall, parse_function_calls
from rstar2jax.engine import Chunk, Session
from rstar2jax.serve.metrics import ServerMetrics
from rstar2jax.serve.protocol import ChatRequest

__all__ = ["ChoiceContext", "ChoiceStream", "TokenText"]

#: The engine's reasons a session is done, as OpenAI's finish reasons.
_FINISH = {"eos": "stop", "budget": "length"}
#: The finish reason of a choice a drain ended before it finished (vLLM's name).
ABORT = "abort"


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _top_logprobs(params, tokens, *, config: models.ModelConfig, k: int):
    """Top-``k`` next-token log-probs at each position of ``tokens [1, T]``: ids, logprobs ``[T, k]``."""
    logits, _ = models.forward(params, config, tokens)
    logprobs = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logprobs, k)
    return ids, values


class TokenText:
    """A policy's tokens as text: decoding, OpenAI log-prob entries and the top alternatives of tokens."""

    def __init__(self, tokenizer, params, model_config: models.ModelConfig):
        self.tokenizer, self.params, self.model_config = tokenizer, params, model_config
        self._token_text: dict[int, str] = {}

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.decode([token])
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    def top_logprobs(self, prompt_ids: list[int], tokens: list[int], start: int, k: int):
        """The ``k`` most likely tokens (raw model distribution) at each of ``tokens[start:]``."""
        sequence = prompt_ids + tokens
        size = 1 << max(len(sequence) - 1, 63).bit_length()  # a few padded lengths, a few programs
        padded = np.zeros((1, size), np.int32)
        padded[0, : len(sequence)] = sequence
        ids, values = jax.device_get(_top_logprobs(self.params, padded, config=self.model_config, k=k))
        first = len(prompt_ids) + start - 1  # the logits that predicted tokens[start]
        rows = range(first, len(sequence) - 1)
        return [list(zip(ids[r].tolist(), values[r].tolist(), strict=True)) for r in rows]


@dataclasses.dataclass(frozen=True)
class ChoiceContext:
    """What every choice of a server shares: the policy's text, the end-of-turn ids (not content), the
    ``</tool_call>`` token ids (the turn ends after them when tools are parsed), the assistant opener (the
    start of the content) and the metrics the choice reports its tokens and latencies to."""

    text: TokenText
    eos_ids: frozenset[int]
    tool_call_end: tuple[int, ...]
    opener: str
    metrics: ServerMetrics


class ChoiceStream:
    """One choice of a request: streams its engine session and turns tokens into the content, tool calls and
    log-probs a client sees."""

    def __init__(self, context: ChoiceContext, request: ChatRequest, session: Session, prompt_ids: list[int],
                 arrived: float):
        """``arrived``: when the request arrived (``time.perf_counter()``), for the time to first token."""
        self.context, self.request, self.session, self.prompt_ids = context, request, session, prompt_ids
        self.arrived, self.last_arrival = arrived, None
        self.tokens: list[int] = []  # sampled, the end-of-turn token excluded
        self.logprobs: list[float] = []
        self.num_sampled = 0
        self.text = ""
        self.emitted = 0  # characters of self.text already given to the client
        self.emitted_tokens = 0  # tokens whose log-probs were given
        self.token_ends: list[int] = []  # len(decode(tokens[:i + 1])) when log-probs are asked for
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None  # set once the choice has finished (ABORT: a drain ended it)
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def close(self) -> None:
        """Free the session's slot (idempotent); a segment in flight stops with the engine's next step."""
        self.session.close()

    def abort(self) -> None:
        """End the choice now, as finished with :data:`ABORT` (a drain's deadline): its stream ends with what
        it has."""
        self.aborted = True
        self.close()

    def _observe(self, chunk: Chunk) -> None:
        """Latency metrics of an arriving chunk: the time to first token, then the wait per token."""
        now = time.perf_counter()
        metrics = self.context.metrics
        if self.last_arrival is None:
            metrics.observe("time_to_first_token_seconds", now - self.arrived)
        elif chunk.tokens:
            metrics.observe("inter_token_latency_seconds", (now - self.last_arrival) / len(chunk.tokens),
                            len(chunk.tokens))
        self.last_arrival = now

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
        then ``("finish", finish_reason)`` (:data:`ABORT` when :meth:`abort` ended it)."""
        context, request = self.context, self.request
        stop_ids = [list(context.tool_call_end)] if request.parse_tools else []
        if context.opener:
            yield "content", context.opener, []
        finish = None
        try:
            async for chunk in self.session.stream(stop=stop_ids):
                finish = await self._receive(chunk)
                content_end = self._content_end(finish)
                if content_end > self.emitted:
                    delta = self.text[self.emitted : content_end]
                    yield "content", delta, self._logprob_entries(content_end)
                    self.emitted = content_end
                if finish is not None:
                    break  # a stop string: leaving the stream stops the session
        except RuntimeError:  # the session was closed under the stream: by abort(), else a failure
            if not self.aborted:
                raise
            finish = ABORT
        finally:
            context.metrics.counts["completion_tokens"] += self.num_sampled
            self.close()
        calls = self._tool_calls() if request.parse_tools and finish != ABORT else []
        if calls:
            yield "tool_calls", calls
            finish = "tool_calls"
        elif self.emitted < len(self.text):  # an unparsable call stays visible as text
            yield "content", self.text[self.emitted :], self._logprob_entries(len(self.text))
            self.emitted = len(self.text)
        self.finish_reason = finish
        yield "finish", finish

    async def _receive(self, chunk: Chunk) -> str | None:
        """Takes in a chunk of sampled tokens; the finish reason it brings (a stop string counts), or None."""
        self._observe(chunk)
        self.num_sampled += len(chunk.tokens)
        tokens, logprobs = list(chunk.tokens), list(chunk.logprobs)
        if chunk.finish_reason == "eos" and tokens and tokens[-1] in self.context.eos_ids:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        start = len(self.tokens)
        self.tokens += tokens
        self.logprobs += logprobs
        self.text = self.context.text.decode(self.tokens)
        if self.request.logprobs:
            await self._token_logprobs(start)
        finish = _FINISH.get(chunk.finish_reason)
        if chunk.finish_reason == "stop":  # after </tool_call>: the turn ends here, as in training
            finish = "stop"
        cut = self._find_stop(start)
        if cut is not None:
            self.text, finish = self.text[:cut], "stop"
        return finish

    def _content_end(self, finish: str | None) -> int:
        """How much of the text is content the client may see now: not a tool call, and (before the end) not
        what may be the start of a tag or stop string."""
        content_end = len(self.text)
        if self.request.parse_tools and TOOL_CALL_OPEN in self.text:
            content_end = len(self.text[: self.text.index(TOOL_CALL_OPEN)].rstrip())
        if finish is None:
            content_end = min(content_end, len(self.text) - self._held_back(self.text))
        return content_end

    def _find_stop(self, start_token: int) -> int | None:
        """Where the first stop string starts in the text (looking only where new tokens could make one)."""
        if not self.request.stop:
            return None
        before = self.context.text.decode(self.tokens[:start_token])
        first = max(0, len(before) - max(map(len, self.request.stop)))
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
        decode = self.context.text.decode
        for i in range(start, len(self.tokens)):
            self.token_ends.append(len(decode(self.tokens[: i + 1])))
        k = self.request.top_logprobs
        if k and len(self.tokens) > start:
            self.top += await asyncio.to_thread(
                self.context.text.top_logprobs, self.prompt_ids, self.tokens, start, k
            )

    def _logprob_entries(self, content_end: int) -> list[dict[str, Any]]:
        """OpenAI log-prob entries of the tokens that end within the first ``content_end`` characters and were
        not given yet."""
        if not self.request.logprobs:
            return []
        entries = []
        while self.emitted_tokens < len(self.tokens) and self.token_ends[self.emitted_tokens] <= content_end:
            i = self.emitted_tokens
            entry = self.context.text.logprob_entry(self.tokens[i], self.logprobs[i])
            if self.request.top_logprobs:
                entry["top_logprobs"] = [self.context.text.logprob_entry(t, lp) for t, lp in self.top[i]]
            entries.append(entry)
            self.emitted_tokens += 1
        return entries
