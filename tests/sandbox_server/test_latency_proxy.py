"""The latency proxy (``sandbox_server.latency_proxy``): its delay distribution (drawn, never slept), and in
front of a real server: answers forwarded intact, concurrent calls held side by side, bad input refused."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import msgpack
import numpy as np
import pytest

from rstar2jax.agent.sandbox_client import SyncSandboxClient
from sandbox_server.latency_proxy import LognormalDelay, main, start_latency_proxy, tool_calls_in
from tests.sandbox_server.conftest import post


def test_lognormal_delay_has_the_asked_median_and_95th_percentile():
    delay = LognormalDelay(0.5, 2.0, seed=3)
    assert delay.mu == pytest.approx(math.log(0.5))
    assert delay.sigma == pytest.approx(math.log(4.0) / 1.6448536, rel=1e-6)
    assert delay.quantile(0.5) == pytest.approx(0.5) and delay.quantile(0.95) == pytest.approx(2.0)
    draws = np.array([delay.draw() for _ in range(100_000)])
    assert draws.min() > 0
    # Standard errors at this n: 0.3% of the median, 0.6% of the 95th percentile.
    assert np.quantile(draws, 0.5) == pytest.approx(0.5, rel=0.02)
    assert np.quantile(draws, 0.95) == pytest.approx(2.0, rel=0.03)
    assert draws.mean() == pytest.approx(0.5 * math.exp(delay.sigma**2 / 2), rel=0.02)


def test_lognormal_delay_is_seeded_and_degenerates_cleanly():
    draws = lambda seed: [delay.draw() for delay in [LognormalDelay(seed=seed)] for _ in range(5)]
    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert {LognormalDelay(0.0, 0.0).draw() for _ in range(10)} == {0.0}
    assert [LognormalDelay(0.3, 0.3, seed=1).draw() for _ in range(10)] == [pytest.approx(0.3)] * 10
    for median, p95 in [(1.0, 0.5), (-0.1, 1.0), (0.5, math.inf), (math.nan, 1.0)]:
        with pytest.raises(ValueError, match="median_s"):
            LognormalDelay(median, p95)


def test_tool_calls_are_counted_per_call():
    batch = {"requests": [{"code": "1"}, {"code": "2"}, {"code": "3"}]}
    assert tool_calls_in("/run", b"{}", "application/json") == 1
    assert tool_calls_in("/run/batch", json.dumps(batch).encode(), "application/json") == 3
    assert tool_calls_in("/run/batch", msgpack.packb(batch), "application/msgpack") == 3
    assert tool_calls_in("/run/batch", b"{not json", "application/json") == 0
    assert tool_calls_in("/run/batch", b'{"requests": 5}', "application/json") == 0
    assert tool_calls_in("/sessions", b"", "") == tool_calls_in("/health", b"", "") == 0


def test_answers_pass_through_unchanged(server):
    with start_latency_proxy(server.url, median_s=0.0, p95_s=0.0) as proxy:
        for path, payload in [
            ("/run", {"code": "print(6 * 7)"}),
            ("/run/batch", {"requests": [{"code": "print(1)"}, {"code": "1/0"}, {"code": "print(input())",
                                                                              "stdin": "x\n"}]}),
            ("/run", b"{not json"),
            ("/run", {"code": "print(1)", "timeout": -1}),
        ]:
            direct, proxied = post(server.url, payload, path=path), post(proxy.url, payload, path=path)
            assert proxied[0] == direct[0]
            strip = lambda body: {k: v for k, v in body.items() if k != "duration"}
            if "results" in direct[1]:
                assert [strip(r) for r in proxied[1]["results"]] == [strip(r) for r in direct[1]["results"]]
            else:
                assert strip(proxied[1]) == strip(direct[1])
        assert post(proxy.url, {"code": "print(6 * 7)"})[1]["stdout"] == "42\n"
        assert len(proxy.delays) == 1 + 3 + 1 + 1 + 1  # every /run and batch item, valid or not
        status, opened, _ = post(proxy.url, b"", path="/sessions")
        assert status == 200
        session = {"session": opened["session"], "session_token": opened["token"]}
        assert post(proxy.url, {"code": "x = 5", **session})[0] == 200
        assert post(proxy.url, {"code": "print(x)", **session})[1]["stdout"] == "5\n"
        assert post(proxy.url, {"code": "print(x)", **session, "session_token": "wrong"})[0] == 404
        # The client's default wire (msgpack batches) and its named sessions, through the proxy.
        with SyncSandboxClient(proxy.url) as client:
            assert client.run("print(2 ** 10)").stdout == "1024\n"
            assert client.run("y = 3", session="s").status == "ok"
            assert client.run("print(y + 1)", session="s").stdout == "4\n"
            assert client.health()["workers"] == server.get("/health")["workers"]


def test_concurrent_calls_wait_side_by_side(server):
    async def calls(url: str) -> list[dict]:
        async with aiohttp.ClientSession() as session:

            async def one(i):
                async with session.post(url + "/run", json={"code": f"print({i})"}) as answer:
                    return await answer.json()

            return await asyncio.gather(*(one(i) for i in range(8)))

    # A constant 1 s per call: eight calls sent at once are all held at the same time, not one after another.
    with start_latency_proxy(server.url, median_s=1.0, p95_s=1.0) as proxy:
        results = asyncio.run(calls(proxy.url))
        assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(8)]
        assert proxy.max_calls_in_flight == 8 and proxy.calls_in_flight == 0
        assert list(proxy.delays) == [pytest.approx(1.0)] * 8


def test_an_unreachable_upstream_is_a_502():
    with start_latency_proxy("http://127.0.0.1:9", median_s=0.0, p95_s=0.0) as proxy:
        status, body, _ = post(proxy.url, {"code": "print(1)"})
    assert status == 502 and "unreachable" in body["error"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--upstream", "localhost:8088"], "--upstream must be an http(s) URL"),
        (["--upstream", "http://127.0.0.1:8088", "--median", "3", "--p95", "1"], "median_s <= p95_s"),
        (["--upstream", "http://127.0.0.1:8088", "--port", "70000"], "--port must be in"),
    ],
)
def test_the_command_line_refuses_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
