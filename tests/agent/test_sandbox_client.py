"""The sandbox client against a real server and against small fake servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import subprocess
import sys
import threading

import msgpack
import pytest
from aiohttp import web

from rstar2jax.agent.sandbox_client import SandboxClient, SyncSandboxClient, run_code_sync
from rstar2jax.agent.sandbox_wire import SandboxResult
from sandbox_server import schema, start_local

GUARD_S = 60.0  # a test fails (instead of hanging) if the client ever blocks this long


@pytest.fixture(scope="module")
def server():
    with start_local(workers=1, slots=4) as running:
        yield running


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, GUARD_S))


def _ok_result(stdout: str) -> dict:
    return schema.make_result("ok", stdout=stdout, exit_code=0)


class FakeServer:
    """An in-process HTTP server on loopback whose /run/batch behaviour each test scripts."""

    def __init__(self, behaviour):
        self.behaviour = behaviour  # async (FakeServer, list of requests, request) -> web.Response
        self.batches: list[list[dict]] = []
        self.sessions_opened = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post(schema.PATH_BATCH, self._handle)
        app.router.add_post(schema.PATH_SESSIONS, self._open_session)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info):
        await self.runner.cleanup()

    async def _open_session(self, request):
        self.sessions_opened += 1
        opened = {schema.SESSION_KEY: f"fake-{self.sessions_opened}", schema.SESSION_TOKEN_KEY: "token"}
        return web.json_response(opened)

    async def _handle(self, request):
        body = await request.read()
        if request.content_type == schema.CONTENT_TYPE_MSGPACK:
            payload = msgpack.unpackb(body)
        else:
            payload = json.loads(body)
        requests = payload[schema.BATCH_REQUESTS_KEY]
        self.batches.append(requests)
        return await self.behaviour(self, requests, request)


async def _echo(fake, requests, request):
    """Answer every request with its own code as stdout, in the client's wire format."""
    results = [_ok_result(r["code"]) for r in requests]
    return web.Response(
        body=msgpack.packb({schema.BATCH_RESULTS_KEY: results}), content_type=schema.CONTENT_TYPE_MSGPACK
    )


def _free_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# --------------------------------------------------------------------------------------- real server
def test_run_and_run_many_against_real_server(server):
    async def main():
        async with SandboxClient(server.url) as client:
            single = await client.run("print(input()[::-1])", stdin="abc\n", timeout=5)
            many = await client.run_many(
                ["1 + 1", {"code": "import sys\nsys.exit(4)"}, {"code": "while True: pass", "timeout": 0.5}]
            )
            return single, many

    single, many = _run(main())
    assert single == SandboxResult("ok", "cba\n", "", 0, None, single.duration) and single.ok
    assert [r.status for r in many] == ["ok", "error", "timeout"]
    assert many[0].stdout == "2\n" and many[1].exit_code == 4


def test_concurrent_calls_are_micro_batched(server):
    async def main():
        async with SandboxClient(server.url, wire="json") as client:
            before = (await client.metrics())["http_requests"].get(schema.PATH_BATCH, 0)
            results = await asyncio.gather(*(client.run(f"print({i})") for i in range(200)))
            after = (await client.metrics())["http_requests"][schema.PATH_BATCH]
            return results, after - before

    results, batches = _run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(200)]
    assert batches <= 8  # 200 calls in batches of up to 64, not 200 requests


def test_sessions_through_the_client(server):
    async def main():
        async with SandboxClient(server.url) as client:
            await client.run("total = 40", session="client-s")
            value = await client.run("total + 2", session="client-s")
            closed = await client.close_session("client-s")
            closed_again = await client.close_session("client-s")
            return value, closed, closed_again

    value, closed, closed_again = _run(main())
    assert value.stdout == "42\n" and closed and not closed_again


def test_a_session_name_belongs_to_the_client_that_used_it(server):
    """Two clients using the same session name get separate sessions; the wire id and token the server
    gave one of them are needed to reach it, and once it is closed or expired the next call starts afresh."""

    async def main():
        async with SandboxClient(server.url) as owner, SandboxClient(server.url) as other:
            await owner.run("secret = 41", session="shared-name")
            seen_by_other = await other.run("print('secret' in globals())", session="shared-name")
            handle = owner._sessions.opened["shared-name"]
            guess = {"code": "secret", "session": handle.id}  # the id without the token
            http = await other.connection.session()
            async with http.post(server.url + schema.PATH_RUN, json=guess) as response:
                guessed = response.status, await response.json()
            still = await owner.run("secret + 1", session="shared-name")
            closed = await other.close_session("shared-name")
            after_other_closed = await owner.run("secret + 1", session="shared-name")
            await owner.close_session("shared-name")
            fresh = await owner.run("print('secret' in globals())", session="shared-name")
            await owner.close_session("shared-name")
            return seen_by_other, guessed, still, closed, after_other_closed, fresh

    seen_by_other, guessed, still, closed, after_other_closed, fresh = _run(main())
    assert seen_by_other.stdout == "False\n"
    assert guessed[0] == 404 and guessed[1]["error_type"] == schema.SESSION_NOT_FOUND, guessed
    assert still.stdout == "42\n" and closed
    assert after_other_closed.stdout == "42\n"
    assert fresh.stdout == "False\n"


def test_sync_client_works_inside_and_outside_an_event_loop(server):
    with SyncSandboxClient(server.url) as client:
        assert client.run("6 * 7").stdout == "42\n"
        assert [r.stdout for r in client.run_many(["1", "2"])] == ["1\n", "2\n"]

    async def inside_a_notebook_loop():
        return run_code_sync("print('sync')", url=server.url)

    assert _run(inside_a_notebook_loop()).stdout == "sync\n"


def _loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "sandbox-client"}


def test_a_closed_sync_client_stops_its_loop_and_a_new_one_works(server):
    before = _loop_threads()
    client = SyncSandboxClient(server.url)
    assert client.run("1").stdout == "1\n"
    client.close()
    client.close()  # idempotent
    assert _loop_threads() == before
    with pytest.raises(RuntimeError, match="SyncSandboxClient is closed"):
        client.run("1")
    with SyncSandboxClient(server.url) as again:  # a second run in the same process
        assert again.run("2").stdout == "2\n"
    with pytest.raises(ValueError, match="http://"):
        SyncSandboxClient("ftp://127.0.0.1:1")
    assert _loop_threads() == before  # neither the closed clients nor the rejected one left a loop running


# --------------------------------------------------------------------------------------- fake servers
def test_least_loaded_routing_spreads_batches_and_pins_sessions():
    async def slow_echo(fake, requests, request):
        await asyncio.sleep(0.05)
        return await _echo(fake, requests, request)

    async def main():
        async with FakeServer(slow_echo) as a, FakeServer(slow_echo) as b:
            async with SandboxClient([a.url, b.url], max_batch=8) as client:
                plain = await asyncio.gather(*(client.run(f"plain {i}") for i in range(64)))
                sessions = await asyncio.gather(*(client.run(f"s {i}", session="pinned") for i in range(20)))
            return a, b, plain, sessions

    a, b, plain, sessions = _run(main())
    assert [r.stdout for r in plain] == [f"plain {i}" for i in range(64)]
    assert [r.stdout for r in sessions] == [f"s {i}" for i in range(20)]
    plain_counts = [
        sum(1 for batch in fake.batches for r in batch if r["session"] is None) for fake in (a, b)
    ]
    assert min(plain_counts) >= 16, plain_counts  # both servers took a share
    session_counts = [sum(1 for batch in fake.batches for r in batch if r["session"]) for fake in (a, b)]
    assert sorted(session_counts) == [0, 20]  # a session stays on one server
    assert sorted(fake.sessions_opened for fake in (a, b)) == [0, 1]  # opened once, by the first call
    pinned = [r for fake in (a, b) for batch in fake.batches for r in batch if r["session"]]
    assert {(r["session"], r["session_token"]) for r in pinned} == {("fake-1", "token")}


def test_retries_503_with_retry_after():
    async def busy_twice(fake, requests, request):
        if len(fake.batches) <= 2:
            return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "0"})
        return await _echo(fake, requests, request)

    async def main():
        async with FakeServer(busy_twice) as fake:
            async with SandboxClient(fake.url, backoff=(0.01, 0.05)) as client:
                return fake, await client.run_many(["a", "b"])

    fake, results = _run(main())
    assert [r.stdout for r in results] == ["a", "b"] and len(fake.batches) == 3


def test_connection_refused_fails_over_to_a_live_server():
    async def main():
        async with FakeServer(_echo) as live:
            async with SandboxClient([_free_port_url(), live.url], backoff=(0.01, 0.05)) as client:
                return await client.run_many([f"x{i}" for i in range(30)])

    assert [r.stdout for r in _run(main())] == [f"x{i}" for i in range(30)]


def test_no_server_at_all_is_reported_unreachable_at_once():
    async def main():
        async with SandboxClient(_free_port_url(), deadline_slack=60.0, backoff=(0.01, 0.05)) as client:
            start = asyncio.get_running_loop().time()
            result = await client.run("print(1)", timeout=30.0)
            return result, asyncio.get_running_loop().time() - start

    result, waited = _run(main())
    assert result.status == "internal" and result.error_type == "Unreachable", result
    assert "cannot connect" in result.stderr
    assert waited < 30.0  # not timeout + slack (90 s): a refused connection is final after a few attempts


def test_one_undecodable_result_fails_only_its_own_call():
    async def mixed(fake, requests, request):
        results = [_ok_result(r["code"]) for r in requests]
        results[1] = dict(results[1], stdout=b"\xff\xfe bad")  # raw bytes: a non-string field
        packed = msgpack.packb({schema.BATCH_RESULTS_KEY: results}, use_bin_type=False)  # as str type
        return web.Response(body=packed, content_type=schema.CONTENT_TYPE_MSGPACK)

    async def invalid(fake, requests, request):
        results = [_ok_result(r["code"]) for r in requests]
        results[0] = dict(results[0], status="great")
        return web.Response(
            body=msgpack.packb({schema.BATCH_RESULTS_KEY: results}), content_type=schema.CONTENT_TYPE_MSGPACK
        )

    async def main(behaviour):
        async with FakeServer(behaviour) as fake:
            async with SandboxClient(fake.url, batch_window=0.05) as client:
                return await client.run_many(["a", "b", "c"])

    a, b, c = _run(main(mixed))
    assert (a.stdout, c.stdout) == ("a", "c") and a.ok and c.ok
    assert b.ok and b.stdout == "\ufffd\ufffd bad"  # invalid UTF-8 in a str field: replaced, not a failure
    bad, b, c = _run(main(invalid))
    assert (bad.status, bad.error_type) == ("internal", "BadResponse") and "great" in bad.stderr
    assert (b.stdout, c.stdout) == ("b", "c") and b.ok and c.ok


def test_a_server_that_never_answers_cannot_hang_a_call():
    async def main():
        hold = asyncio.Event()

        async def never(fake, requests, request):
            await hold.wait()

        async with FakeServer(never) as fake:
            async with SandboxClient(fake.url, deadline_slack=0.3) as client:
                result = await client.run("print(1)", timeout=0.2)
            hold.set()
            return result

    result = _run(main())
    assert result.status == "internal" and result.error_type == "DeadlineExceeded"


def test_dropped_connection_retries_plain_calls_but_not_session_calls():
    dropped = set()

    async def drop_first(fake, requests, request):
        kind = requests[0]["session"]
        if kind not in dropped:  # the first batch of each kind was delivered, but its answer never comes
            dropped.add(kind)
            request.transport.close()
            await asyncio.sleep(1)
        return await _echo(fake, requests, request)

    async def main():
        async with FakeServer(drop_first) as fake:
            async with SandboxClient(fake.url, backoff=(0.01, 0.05)) as client:
                return await client.run_many(["plain", {"code": "stateful", "session": "s"}])

    plain, stateful = _run(main())
    assert plain.stdout == "plain"
    assert stateful.status == "internal" and stateful.error_type == "ConnectionError"
    assert "not retried" in stateful.stderr


def test_413_splits_the_batch():
    async def one_at_a_time(fake, requests, request):
        if len(requests) > 1:
            return web.json_response({"error": "too large"}, status=413)
        return await _echo(fake, requests, request)

    async def main():
        async with FakeServer(one_at_a_time) as fake:
            async with SandboxClient(fake.url) as client:
                return await client.run_many(["a", "b", "c"])

    assert [r.stdout for r in _run(main())] == ["a", "b", "c"]


def test_malformed_server_answers_become_internal_results():
    async def wrong(fake, requests, request):
        if requests[0]["code"] == "short":
            return web.json_response({schema.BATCH_RESULTS_KEY: []})
        if requests[0]["code"] == "bad-status":
            return web.json_response({schema.BATCH_RESULTS_KEY: [dict(_ok_result(""), status="great")]})
        return web.json_response({"error": "nope"}, status=400)

    async def main():
        async with FakeServer(wrong) as fake:
            async with SandboxClient(fake.url, max_batch=1) as client:
                return await client.run_many(["short", "bad-status", "rejected"])

    short, bad_status, rejected = _run(main())
    assert (short.status, short.error_type) == ("internal", "BadResponse")
    assert (bad_status.status, bad_status.error_type) == ("internal", "BadResponse")
    assert (rejected.status, rejected.error_type) == ("internal", "HTTP400") and "nope" in rejected.stderr


def test_batch_window_flushes_partial_batches():
    async def main():
        async with FakeServer(_echo) as fake:
            async with SandboxClient(fake.url, max_batch=64, batch_window=0.001) as client:
                for i in range(3):
                    await client.run(f"seq {i}")
                return fake

    fake = _run(main())
    assert collections.Counter(len(b) for b in fake.batches) == {1: 3}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(urls=[]), "at least one"),
        (dict(urls="localhost:1"), "http://"),
        (dict(urls="http://x", max_batch=0), "max_batch"),
        (dict(urls="http://x", wire="xml"), "wire"),
        (dict(urls="http://x", backoff=(1.0, 0.5)), "backoff"),
    ],
)
def test_client_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxClient(**kwargs)


def test_bad_call_arguments_raise():
    async def main():
        async with SandboxClient("http://127.0.0.1:9") as client:
            with pytest.raises(TypeError, match="strings"):
                await client.run(b"print(1)")
            with pytest.raises(ValueError, match="timeout"):
                await client.run("1", timeout=0)
            with pytest.raises(ValueError, match="'code'"):
                await client.run_many([{"stdin": "x"}])

    _run(main())


def _printed_by_fresh_python(*lines: str) -> list[str]:
    """What a fresh interpreter running ``lines`` prints, line by line (imports seen from a clean start)."""
    probe = "".join(line + "\n" for line in lines)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_importing_the_client_leaves_jax_and_transformers_unloaded():
    """The agent package loads names lazily: a client-only process keeps a small heap (short full GCs)."""
    assert _printed_by_fresh_python(
        "import sys",
        "from rstar2jax.agent.sandbox_client import SandboxClient",
        "print(sorted(m for m in ('jax', 'transformers', 'torch') if m in sys.modules))",
        "from rstar2jax.agent import rollout, SandboxClient as Same",
        "print(Same is SandboxClient, 'jax' in sys.modules)",
    )[:2] == ["[]", "True True"]


def test_the_client_module_and_the_package_offer_the_same_client_names():
    """The documented path (``agent.sandbox_client``) and the lazy package give the same objects."""
    assert _printed_by_fresh_python(
        "from rstar2jax.agent import SyncSandboxClient, run_code_sync, SandboxResult",
        "from rstar2jax.agent import sandbox_client, sandbox_wire",
        "print(sandbox_client.SyncSandboxClient is SyncSandboxClient,"
        " sandbox_client.run_code_sync is run_code_sync,"
        " sandbox_wire.SandboxResult is SandboxResult)",
        "from rstar2jax.agent.sandbox_client import *",
        "bound = dir()",
        "print(sorted(set(sandbox_client.__all__) - set(bound)))",
    ) == ["True True True", "[]"]
