"""The HTTP side of a chat completion: one JSON body (:func:`complete`) or a server-sent event stream
(:func:`stream`) built from a request's :class:`~rstar2jax.serve.choice.ChoiceStream` events, the usage
block, and the middleware that turns errors into OpenAI error objects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from rstar2jax.agent.tasks import gather_or_cancel
from rstar2jax.serve.choice import ChoiceStream
from rstar2jax.serve.protocol import RequestError, error_body

__all__ = ["complete", "errors_middleware", "stream", "usage_block"]


def usage_block(prompt_tokens: int, cached: int, choices: list[ChoiceStream]) -> dict[str, Any]:
    """OpenAI's usage object of a request: its prompt tokens (``cached`` of them from the prefix cache) and
    every choice's sampled tokens."""
    completion = sum(c.num_sampled for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def complete(request, choices: list[ChoiceStream], meta: dict[str, Any], usage) -> dict[str, Any]:
    """The ``chat.completion`` body once every choice has finished; ``usage()`` gives its usage block."""
    async def collect(choice: ChoiceStream) -> dict[str, Any]:
        content, entries, calls, finish = [], [], None, None
        async for kind, *value in choice.run():
            if kind == "content":
                content.append(value[0])
                entries += value[1]
            elif kind == "tool_calls":
                calls = value[0]
            else:
                finish = value[0]
        text = "".join(content)
        message = {
            "role": "assistant",
            "content": text if (text.strip() or not calls) else None,
            "refusal": None,
        }
        if calls:
            message["tool_calls"] = calls
        return {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": {"content": entries, "refusal": None} if request.logprobs else None,
        }

    results = await gather_or_cancel([collect(c) for c in choices])
    for index, result in enumerate(results):
        result["index"] = index
    return {
        **meta,
        "object": "chat.completion",
        "choices": results,
        "usage": usage(),
    }


async def stream(http_request: web.Request, request, choices: list[ChoiceStream], meta: dict[str, Any],
                 usage) -> web.StreamResponse:
    """The choices as ``chat.completion.chunk`` events, interleaved as their tokens arrive; ``usage()`` gives
    the last event's usage block when the client asked for it."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(http_request)
    no_usage = {"usage": None} if request.include_usage else {}

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    def chunk(index: int, delta: dict[str, Any], finish=None, entries=None) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": {"content": entries, "refusal": None} if entries else None,
        }
        return {**meta, "object": "chat.completion.chunk", "choices": [choice], **no_usage}

    # One task per choice feeds the queue; this handler alone reads it (no reader task to leave behind when
    # the client goes away and the handler is cancelled: the finally cancels and awaits every pump).
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: ChoiceStream) -> None:
        try:
            async for event in choice.run():
                queue.put_nowait((index, event))
        except Exception as error:  # noqa: BLE001 - reported in the stream below
            queue.put_nowait((index, error))
        else:
            queue.put_nowait((index, None))

    for index in range(len(choices)):
        await send(chunk(index, {"role": "assistant", "content": ""}))
    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            if event is None:
                running -= 1
                continue
            kind, *value = event
            if kind == "content":
                await send(chunk(index, {"content": value[0]}, entries=value[1]))
            elif kind == "tool_calls":
                delta = [{"index": k, **call} for k, call in enumerate(value[0])]
                await send(chunk(index, {"tool_calls": delta}))
            else:
                await send(chunk(index, {}, finish=value[0]))
        if request.include_usage:
            await send({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage()})
    except ConnectionResetError:  # the client went away: nobody to answer
        return response
    except Exception as error:  # headers are sent: report in the stream, as OpenAI does
        await send(error_body(f"generation failed: {error}", type="server_error"))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(ConnectionResetError):  # the client left as the stream ended
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Client mistakes as OpenAI error objects (never a 500); unexpected failures as a 500 server_error."""
    try:
        return await handler(request)
    except RequestError as error:
        return web.json_response(error.body(), status=error.status, headers=error.headers)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        return web.json_response(error_body(error.reason, type=kind), status=error.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:  # noqa: BLE001 - a server bug or an engine failure
        return web.json_response(
            error_body(f"internal error: {type(error).__name__}: {error}", type="server_error"), status=500
        )
