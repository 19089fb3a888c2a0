"""The OpenAI-compatible server, driven by the official ``openai`` client against the tiny taught policy.

The policy was taught three conversations (``experiments.tiny_policy``), so greedy answers are known: a plain
reply, a ``get_weather`` tool call and, after the tool's result, an answer quoting it.
"""

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import openai
import pytest

from experiments.tiny_policy import HELLO, HELLO_ANSWER, WEATHER, WEATHER_ANSWER, WEATHER_RESULT, WEATHER_TOOL
from rstar2jax.engine import generate
from rstar2jax.serve import BackgroundServer
from rstar2jax.serve.protocol import parse_chat_request
from tests.serve.conftest import SERVER_CONFIG


def http(method, url, body=None, *, raw=None):
    """(status, decoded JSON or the text lines) of one plain HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text, kind = response.status, response.read().decode(), response.headers["Content-Type"]
    except urllib.error.HTTPError as error:
        status, text, kind = error.code, error.read().decode(), error.headers["Content-Type"]
    return status, json.loads(text) if kind.startswith("application/json") else text.splitlines()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def hello(**kwargs):
    return dict(messages=[{"role": "user", "content": HELLO}], temperature=0, **kwargs)


def test_health_and_models(server, client, tiny_policy):
    assert http("GET", server.url + "/health") == (200, {"status": "ok"})
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_policy.name]


def test_plain_completion_is_the_taught_answer(client, model):
    response = client.chat.completions.create(model=model, **hello())
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == HELLO_ANSWER
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    usage = response.usage
    assert usage.completion_tokens > 5 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_length_finish_and_max_completion_tokens(client, model):
    response = client.chat.completions.create(model=model, max_completion_tokens=3, **hello())
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    assert HELLO_ANSWER.startswith(response.choices[0].message.content)


def test_stream_matches_the_completion_and_reports_usage(client, model):
    whole = client.chat.completions.create(model=model, **hello())
    chunks = list(
        client.chat.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **hello()
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2  # really streamed


def test_stream_ends_with_done(server, model):
    body = {"model": model, "stream": True, **hello()}
    status, lines = http("POST", server.url + "/v1/chat/completions", body)
    events = [line for line in lines if line]
    assert status == 200 and events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def weather_request(**kwargs):
    return dict(
        messages=[{"role": "user", "content": WEATHER}], tools=[WEATHER_TOOL], temperature=0, **kwargs
    )


def test_tool_call_round_trip(client, model):
    first = client.chat.completions.create(model=model, **weather_request())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")
    messages = [
        {"role": "user", "content": WEATHER},
        {
            "role": "assistant",
            "content": choice.message.content,
            "tool_calls": [call.model_dump(include={"id", "type", "function"})],
        },
        {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0
    )
    assert second.choices[0].message.content == WEATHER_ANSWER
    assert second.choices[0].finish_reason == "stop"


def test_streamed_tool_call_never_shows_half_a_tag(client, model):
    chunks = list(client.chat.completions.create(model=model, stream=True, **weather_request()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "<" not in text.replace("<reason>", "").replace("</reason>", "")
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_leaves_the_call_as_text(client, model):
    response = client.chat.completions.create(model=model, tool_choice="none", **weather_request())
    assert not response.choices[0].message.tool_calls
    assert '"get_weather"' in response.choices[0].message.content


def test_logprobs_and_top_logprobs(client, model):
    response = client.chat.completions.create(model=model, logprobs=True, top_logprobs=3, **hello())
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content.removeprefix("<reason>")
    assert len(entries) == response.usage.completion_tokens - 1  # the end-of-turn token is not content
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token  # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(top[0].logprob, abs=1e-3) and entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token
    streamed = list(client.chat.completions.create(model=model, logprobs=True, stream=True, **hello()))
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in entries]


@pytest.fixture(scope="module")
def flat_client(tiny_policy):
    """A server on the tiny policy with its final norm scaled to almost zero: every token about equally
    likely, so choices that shared a random stream would agree and choices on streams of their own differ,
    whatever the trained model's confidence."""
    params = {**tiny_policy.params, "final_norm": tiny_policy.params["final_norm"] * 1e-3}
    with BackgroundServer(dataclasses.replace(tiny_policy, params=params), SERVER_CONFIG) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_n_choices_and_seed(flat_client):
    """What the API promises for ``n``: choices indexed 0..n-1, each on a random stream of its own (they
    differ), the same choices again for the same seed, other ones for another seed."""
    model = flat_client.models.list().data[0].id
    kwargs = dict(messages=[{"role": "user", "content": HELLO}], n=3, temperature=1.0, seed=7, max_tokens=12)
    first = flat_client.chat.completions.create(model=model, **kwargs)
    again = flat_client.chat.completions.create(model=model, **kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # distinct streams
    assert [c.message.content for c in again.choices] == texts
    other = flat_client.chat.completions.create(model=model, **{**kwargs, "seed": 8})
    assert not {c.message.content for c in other.choices} & set(texts)


def test_stop_strings(client, model):
    response = client.chat.completions.create(model=model, stop=["Hello", "zzz"], **hello())
    assert response.choices[0].message.content == HELLO_ANSWER[: HELLO_ANSWER.index("Hello")]
    assert response.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model=model, stop="there", stream=True, **hello()))
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert text == HELLO_ANSWER[: HELLO_ANSWER.index("there")]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": SERVER_CONFIG.num_slots + 1}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, "messages"),
    ],
)
def test_bad_requests_get_400_with_the_openai_error(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, **body) if body else client.post(
            "/chat/completions", body={"model": model}, cast_to=object
        )
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert client.chat.completions.create(model=model, **hello()).choices[0].message.content == HELLO_ANSWER


def test_malformed_json_and_unknown_model(server, model):
    url = server.url + "/v1/chat/completions"
    status, error = http("POST", url, raw=b"{not json")
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert http("POST", url, ["a list"])[0] == 400
    status, error = http("POST", url, {"model": "gpt-9", **hello()})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error = http("GET", server.url + "/v1/nothing")
    assert status == 404 and error["error"]["message"]


def test_concurrent_requests_beyond_the_slots_all_finish(server, model):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with client:
            jobs = [
                client.chat.completions.create(model=model, **hello())
                for _ in range(3 * SERVER_CONFIG.num_slots)
            ]
            return await asyncio.gather(*jobs)

    responses = asyncio.run(run())
    assert [r.choices[0].message.content for r in responses] == [HELLO_ANSWER] * 3 * SERVER_CONFIG.num_slots


def test_a_client_that_disconnects_frees_its_slots(server, client, model):
    # A prompt the policy answers with blank lines up to max_tokens: only a disconnect can end it early.
    body = {"model": model, "messages": [{"role": "user", "content": "<tool_response>"}], "max_tokens": 300,
            "n": SERVER_CONFIG.num_slots, "temperature": 0}
    full = client.chat.completions.create(**body)
    assert {c.finish_reason for c in full.choices} == {"length"}
    stats = dict(server.service.stats)

    async def disconnect_mid_stream():
        async with aiohttp.ClientSession() as session:
            request = {**body, "stream": True}
            response = await session.post(server.url + "/v1/chat/completions", json=request)
            await response.content.readline()  # every slot is now taken by this request
            response.close()  # the client goes away mid-stream

    asyncio.run(disconnect_mid_stream())
    # Needs every slot:
    again = client.chat.completions.create(model=model, n=SERVER_CONFIG.num_slots, **hello())
    assert [c.message.content for c in again.choices] == [HELLO_ANSWER] * SERVER_CONFIG.num_slots
    after = server.service.stats
    assert after["cancelled_choices"] - stats.get("cancelled_choices", 0) == SERVER_CONFIG.num_slots
    generated = after["completion_tokens"] - stats["completion_tokens"]
    assert generated - again.usage.completion_tokens < full.usage.completion_tokens


def test_concurrent_streams_equal_direct_generate(server, tiny_policy, model):
    """Six streamed requests at once on four slots (some wait, all decode side by side, each streamed as the
    engine's steps sample it): every completion's tokens and log-probs are what one ``engine.generate`` call
    on the same prompts gives."""
    questions = [HELLO, WEATHER, "Say goodbye.", "What is 2 + 2?", "Hello?", "Name a color."]
    max_tokens = 24

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with client:
            async def one(question):
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                    temperature=0, logprobs=True, stream=True)
                return [(e.token, e.logprob) for c in [c async for c in stream]
                        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            return await asyncio.gather(*(one(q) for q in questions))

    served = asyncio.run(run())
    service = server.service
    prompts = [service.prompt_ids(parse_chat_request({"messages": [{"role": "user", "content": q}]}, max_n=1))
               for q in questions]
    direct = generate(tiny_policy.params, tiny_policy.model_config, prompts, max_new_tokens=max_tokens,
                      engine_config=service.engine_config)
    for entries, expected in zip(served, direct, strict=True):
        tokens = [t for t in expected.tokens if t not in service.eos_ids]  # the end of turn is not content
        assert [text for text, _ in entries] == [service.decode([t]) for t in tokens]
        np.testing.assert_allclose([lp for _, lp in entries], expected.logprobs[: len(tokens)], atol=1e-5)
