"""The server as operators run it: clients that go away leave nothing behind, a burst beyond ``max_waiting``
is answered 200 or 429, a drain (in process, and SIGTERM to ``python -m experiments.serve``) lets requests
finish and then ends the rest with a last chunk and ``data: [DONE]``, and ``/metrics`` speaks Prometheus."""

import asyncio
import collections
import contextlib
import dataclasses
import gc
import json
import logging
import pathlib
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from experiments.tiny_policy import HELLO, HELLO_ANSWER
from rstar2jax.serve import BackgroundServer
from rstar2jax.serve.metrics import METRICS
from tests.serve.conftest import SERVER_CONFIG

REPO = pathlib.Path(__file__).resolve().parents[2]
#: A prompt the policy answers with blank lines up to max_tokens (only a disconnect or a drain ends it early).
LONG = {"messages": [{"role": "user", "content": "<tool_response>"}], "max_tokens": 300, "temperature": 0}
SHORT = {"messages": [{"role": "user", "content": HELLO}], "temperature": 0}


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """Polls ``condition`` until true; fails naming ``what`` after ``timeout`` s (a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {timeout} s"
        time.sleep(0.02)


def metrics_json(live) -> dict:
    async def get():
        async with aiohttp.ClientSession() as http, http.get(
                live.url + "/metrics", headers={"Accept": "application/json"}) as response:
            assert response.status == 200 and response.content_type == "application/json"
            return await response.json()

    return asyncio.run(get())


def idle(live) -> bool:
    m = metrics_json(live)
    return m["requests_running"] == 0 and m["requests_waiting"] == 0 and m["kv_pages_used"] == 0


def events(text: str) -> list:
    """The decoded ``data:`` events of a server-sent event stream (``[DONE]`` as the string)."""
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def finishes(stream_events: list) -> dict[int, list[str]]:
    out = collections.defaultdict(list)
    for event in stream_events:
        for choice in event.get("choices", []) if isinstance(event, dict) else []:
            if choice["finish_reason"]:
                out[choice["index"]].append(choice["finish_reason"])
    return dict(out)


@contextlib.contextmanager
def slow_engine(live, seconds: float):
    """Each engine step of ``live`` takes ``seconds`` longer, so requests are surely in flight when a test
    acts (the tiny model decodes hundreds of tokens in a few milliseconds otherwise)."""
    core = live.service.engine.core
    step = core.step

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    core.step = slow
    try:
        yield
    finally:
        del core.step


def test_abandoned_streams_leave_no_task_behind_and_the_metrics_return_to_idle(server, caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    wait_until(lambda: idle(server), "idle before the test")
    before = metrics_json(server)

    async def tasks():
        return asyncio.all_tasks()

    tasks_before = len(server.call(tasks()))

    async def abandon(http):
        response = await http.post(server.url + "/v1/chat/completions", json={**LONG, "stream": True})
        assert response.status == 200
        await response.content.readline()  # the stream has started: the client goes away mid-body
        response.close()

    async def run():
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                await asyncio.gather(*(abandon(http) for _ in range(10)))

    asyncio.run(run())
    wait_until(lambda: server.service.admission.in_flight == 0, "every disconnect noticed")
    wait_until(lambda: idle(server), "idle again")
    gc.collect()  # a pending task nobody references is destroyed (and logged) here
    wait_until(lambda: len(server.call(tasks())) <= tasks_before, "back to the tasks before")  # none added
    assert "Task was destroyed" not in caplog.text
    after = metrics_json(server)
    assert after["kv_pages_used"] == before["kv_pages_used"] == 0
    assert after["finish_reasons"]["cancelled"] - before["finish_reasons"].get("cancelled", 0) == 50
    assert after["cancelled_choices"] - before.get("cancelled_choices", 0) == 50


def test_a_burst_beyond_max_waiting_is_answered_200_or_429(tiny_policy):
    config = dataclasses.replace(SERVER_CONFIG, max_waiting=3)
    burst = 40

    async def one(http, url, i):
        body = {**SHORT, "stream": bool(i % 2)}
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            return response.status, response.headers.get("Retry-After"), body["stream"], await response.text()

    with BackgroundServer(tiny_policy, config) as live:
        async def run():
            async with aiohttp.ClientSession() as http:
                return await asyncio.gather(*(one(http, live.url, i) for i in range(burst)))

        answers = asyncio.run(run())  # an exception (a dropped connection) fails the test here
        statuses = collections.Counter(status for status, *_ in answers)
        assert set(statuses) == {200, 429} and sum(statuses.values()) == burst, statuses
        for status, retry_after, streamed, text in answers:
            if status == 429:
                error = json.loads(text)["error"]
                assert error["code"] == "rate_limit_exceeded" and "max_waiting=3" in error["message"]
                assert int(retry_after) >= 1
            elif streamed:
                received = events(text)
                assert received[-1] == "[DONE]" and finishes(received) == {0: ["stop"]}
                content = "".join(e["choices"][0]["delta"].get("content") or "" for e in received[:-1])
                assert content == HELLO_ANSWER
            else:
                assert json.loads(text)["choices"][0]["message"]["content"] == HELLO_ANSWER
        wait_until(lambda: idle(live), "idle after the burst")
        counted = metrics_json(live)
        assert counted["rejected"] == {"queue_full": statuses[429]} and counted["requests"] == statuses[200]


def test_the_default_drain_ends_inside_the_termination_grace_period():
    """The default drain deadline leaves margin under the 30 s an orchestrator waits after SIGTERM before
    SIGKILL (the launcher's flag default is checked by its --help test, ``test_launchers.py``)."""
    from rstar2jax.serve import ServerConfig
    from rstar2jax.serve.server import DEFAULT_DRAIN_TIMEOUT_S, TERMINATION_GRACE_S

    assert ServerConfig().drain_timeout_s == DEFAULT_DRAIN_TIMEOUT_S <= TERMINATION_GRACE_S - 5
    assert TERMINATION_GRACE_S == 30


def test_a_drain_lets_the_requests_in_flight_finish_and_refuses_new_ones(tiny_policy):
    with BackgroundServer(tiny_policy, SERVER_CONFIG) as live, slow_engine(live, 0.01):
        async def run():
            async with aiohttp.ClientSession() as http:
                url = live.url + "/v1/chat/completions"
                streams = [await http.post(url, json={**LONG, "stream": True}) for _ in range(2)]
                for response in streams:
                    await response.content.readline()  # admitted: generating
                assert live.service.admission.in_flight == 2
                drain = asyncio.create_task(asyncio.to_thread(live.drain, 120))
                while not live.service.draining:
                    await asyncio.sleep(0.01)
                async with http.get(live.url + "/health") as health:
                    assert health.status == 503 and await health.json() == {"status": "draining"}
                async with http.post(url, json=SHORT) as refused:
                    error = (await refused.json())["error"]
                    assert refused.status == 503 and error["code"] == "server_shutting_down"
                texts = [await response.text() for response in streams]
                return texts, await drain

        texts, ended = asyncio.run(run())
    assert ended == 0
    for text in texts:
        received = events(text)
        assert received[-1] == "[DONE]" and finishes(received) == {0: ["length"]}


def test_a_drain_deadline_ends_streams_with_abort_and_done_and_waiting_requests_with_503(tiny_policy):
    with BackgroundServer(tiny_policy, SERVER_CONFIG) as live, slow_engine(live, 0.01):
        metrics = live.service.metrics

        async def run():
            async with aiohttp.ClientSession() as http:
                url = live.url + "/v1/chat/completions"
                streamed = await http.post(url, json={**LONG, "n": 2, "stream": True,
                                                      "stream_options": {"include_usage": True}})
                await streamed.content.readline()
                plain = asyncio.create_task(http.post(url, json={**LONG, "n": 2}))  # the other two slots
                while metrics.running < 2:
                    await asyncio.sleep(0.01)
                waiting = asyncio.create_task(http.post(url, json=SHORT))  # no slot left: it waits
                while metrics.waiting < 1:
                    await asyncio.sleep(0.01)
                ended = await asyncio.to_thread(live.drain, 0)
                answers = [await plain, await waiting]
                return ended, await streamed.text(), [(r.status, await r.json()) for r in answers]

        ended, text, answers = asyncio.run(run())
        wait_until(lambda: idle(live), "idle after the drain")
    assert ended == 3
    received = events(text)
    assert received[-1] == "[DONE]" and finishes(received) == {0: ["abort"], 1: ["abort"]}
    usage = received[-2]["usage"]  # asked for: after the last choice chunks
    assert received[-2]["choices"] == [] and usage["completion_tokens"] < 2 * LONG["max_tokens"]
    for status, body in answers:  # the non-streamed one ended mid-generation, the other never started
        assert status == 503 and body["error"]["code"] == "server_shutting_down"


def test_metrics_are_prometheus_text_by_default_and_json_on_request(server):
    import prometheus_client.parser

    asyncio.run(_one_request(server.url))

    async def get(query="", accept=None):
        headers = {"Accept": accept} if accept else {}
        async with aiohttp.ClientSession() as http, http.get(server.url + "/metrics" + query,
                                                            headers=headers) as response:
            return response.status, response.headers["Content-Type"], await response.text()

    scraper = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    for query, accept in (("", None), ("", scraper), ("?format=prometheus", "application/json")):
        status, kind, text = asyncio.run(get(query, accept))
        assert status == 200 and kind.startswith("text/plain") and "version=0.0.4" in kind
    families = {f.name: f for f in prometheus_client.parser.text_string_to_metric_families(text)}
    for name, (kind, _) in METRICS.items():
        family = families[f"rstar2jax_{name}"]
        assert family.type == kind, name
        assert all(s.labels.get("model_name") == server.service.model_name for s in family.samples)
    ttft = {s.name: s for s in families["rstar2jax_time_to_first_token_seconds"].samples if
            s.labels.get("le") in (None, "+Inf")}
    assert ttft["rstar2jax_time_to_first_token_seconds_count"].value >= 1
    assert ttft["rstar2jax_time_to_first_token_seconds_bucket"].value == \
        ttft["rstar2jax_time_to_first_token_seconds_count"].value
    generated = families["rstar2jax_generation_tokens"].samples[0].value
    assert generated >= 1 and families["rstar2jax_kv_pages_total"].samples[0].value > 0

    for query, accept in (("", "application/json"), ("?format=json", None)):
        status, kind, text = asyncio.run(get(query, accept))
        counted = json.loads(text)
        assert status == 200 and kind.startswith("application/json")
        for key in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                    "prefix_cache_hit_rate", "requests_running", "requests_waiting", "kv_pages_used",
                    "kv_pages_free", "kv_pages_cached"):
            assert key in counted, key
    status, _, text = asyncio.run(get("?format=xml"))
    assert status == 400 and json.loads(text)["error"]["param"] == "format"


async def _one_request(url: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/chat/completions",
                                                          json={**SHORT, "stream": True}) as response:
        assert response.status == 200
        await response.text()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # 16-21 s on 2 cores: a server process; draining in-process: the tests above
def test_sigterm_drains_a_real_server_mid_stream_and_exits_0(tiny_policy_dir, compile_cache_env):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.serve", f"--model={tiny_policy_dir}", f"--port={port}",
         "--num_slots=4", "--max_len=512", "--nowarmup", "--drain_timeout_s=0"],
        cwd=REPO, env={**compile_cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        async def run():
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 300
                while True:  # up: the engine built (programs compile on the first request)
                    assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(url + "/health") as health:
                            if health.status == 200:
                                break
                    await asyncio.sleep(0.2)
                async with http.post(url + "/v1/chat/completions", json=SHORT) as warm:  # compiles
                    assert warm.status == 200
                response = await http.post(url + "/v1/chat/completions",
                                           json={**LONG, "max_tokens": 450, "n": 4, "stream": True})
                await response.content.readline()  # mid-stream: its four choices are generating
                process.send_signal(signal.SIGTERM)
                return await response.text()

        text = asyncio.run(run())
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-3000:]
    received = events(text)
    reasons = finishes(received)
    assert received[-1] == "[DONE]" and sorted(reasons) == [0, 1, 2, 3]
    assert all(len(r) == 1 and r[0] in ("abort", "length") for r in reasons.values())
    assert "abort" in {r[0] for r in reasons.values()}  # 450 tokens cannot all be sampled before the signal
    assert "SIGTERM: draining" in out and "drained: ended 1 requests at the deadline" in out
    assert out.rstrip().endswith("stopped")
