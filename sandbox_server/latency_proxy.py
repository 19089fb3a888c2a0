"""A reverse proxy that makes a sandbox server answer like a remote sandbox cluster: every tool call is
delayed by a lognormal draw (by default median 0.5 s, 95th percentile 2 s), everything else is forwarded as
it is. For benchmarks and tests of the rollout's waiting (``experiments/bench_async.py``); it never imports
``rstar2jax``.

    from sandbox_server import start_local
    from sandbox_server.latency_proxy import start_latency_proxy

    with start_local(workers=2) as server, start_latency_proxy(server.url, seed=0) as proxy:
        ...  # a SandboxClient on proxy.url

    python -m sandbox_server.latency_proxy --upstream http://127.0.0.1:8088 --port 8089   # stand-alone

Tool calls are ``POST /run`` (one call) and ``POST /run/batch`` (one call per item of ``requests``). Each call
gets its own draw, in arrival order from a seeded generator; the request is held for its calls' delay and
then forwarded, so a batch is answered once its slowest call's delay has passed (as a cluster answers a batch
when its last call is done; a client that wants independent latencies sends calls one by one). A body that
does not decode is forwarded at once (the server answers it 400). Other routes (``/health``, ``/metrics``,
``/sessions``) pass without delay. Bodies, statuses and headers (``Authorization``, ``Content-Type``,
``X-Session-Token``, ``Retry-After``) pass unchanged, compressed bodies included (the server refuses them);
an upstream that cannot be reached is answered 502.

The lognormal's parameters from its median m and 95th percentile q: mu = ln m, sigma = (ln q - ln m) / z,
z = Phi^-1(0.95) = 1.6449 (0.5 s and 2 s: mu = -0.693, sigma = 0.843, mean 0.71 s). ``median_s=0`` delays
nothing; ``p95_s == median_s`` delays every call by exactly the median.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import random
import statistics
import sys
import threading
from collections.abc import Iterator

import aiohttp
import msgpack
from aiohttp import web

#: How many recent draws ``LatencyProxy.delays`` keeps (a long-running proxy must not grow without bound).
MAX_KEPT_DELAYS = 100_000
#: Phi^-1(0.95): the standard normal's 95th percentile.
Z_95 = statistics.NormalDist().inv_cdf(0.95)
#: Tool-call routes: the number of calls a request carries is counted on these.
TOOL_ROUTES = ("/run", "/run/batch")
#: Headers that belong to one connection, not to the message: never forwarded.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer", "upgrade"}
)
#: The largest body the proxy reads: the server's own highest bound (``config.SANE_BOUNDS``), so the
#: upstream's ``--max-request-bytes`` decides (413), not the proxy.
_MAX_BODY_BYTES = 1 << 34


class LognormalDelay:
    """Seeded delays, lognormal with the given median and 95th percentile (seconds).

    Raises ValueError unless 0 <= median_s <= p95_s, both finite, and p95_s > 0 when median_s > 0.
    """

    def __init__(self, median_s: float = 0.5, p95_s: float = 2.0, *, seed: int = 0):
        if not (math.isfinite(median_s) and math.isfinite(p95_s) and 0 <= median_s <= p95_s):
            raise ValueError(f"need finite 0 <= median_s <= p95_s, got median_s={median_s}, p95_s={p95_s}")
        self.median_s, self.p95_s = float(median_s), float(p95_s)
        self.mu = math.log(median_s) if median_s > 0 else -math.inf
        self.sigma = (math.log(p95_s) - math.log(median_s)) / Z_95 if median_s > 0 else 0.0
        self._random = random.Random(seed)

    def quantile(self, q: float) -> float:
        """The distribution's q-quantile, exp(mu + sigma * Phi^-1(q)), for 0 < q < 1."""
        if self.median_s == 0:
            return 0.0
        return math.exp(self.mu + self.sigma * statistics.NormalDist().inv_cdf(q))

    def draw(self) -> float:
        """One delay in seconds."""
        if self.median_s == 0:
            return 0.0
        return self._random.lognormvariate(self.mu, self.sigma)


def tool_calls_in(path: str, body: bytes, content_type: str) -> int:
    """How many tool calls a request carries: 1 for ``/run``, the items of ``/run/batch``, 0 elsewhere or
    for a batch body that does not decode."""
    if path == "/run":
        return 1
    if path != "/run/batch":
        return 0
    try:
        if content_type.startswith("application/msgpack"):
            payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
        else:
            payload = json.loads(body)
        return len(payload["requests"])
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return 0


@dataclasses.dataclass
class LatencyProxy:
    """A running proxy: ``url`` to call it. ``delays`` holds the calls' drawn delays in arrival order (the
    last ``MAX_KEPT_DELAYS``); ``calls_in_flight`` counts the tool calls being delayed or forwarded now,
    ``max_calls_in_flight`` the most there were at once (calls that overlap in time, as they must, raise it
    above 1)."""

    upstream: str
    delay: LognormalDelay
    url: str = ""
    delays: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_KEPT_DELAYS)
    )
    calls_in_flight: int = 0
    max_calls_in_flight: int = 0
    _client: aiohttp.ClientSession | None = dataclasses.field(default=None, repr=False)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Forward one request, after its tool calls' delay."""
        body = await request.read()
        calls = tool_calls_in(request.path, body, request.content_type) if request.method == "POST" else 0
        drawn = [self.delay.draw() for _ in range(calls)]
        self.delays.extend(drawn)
        self.calls_in_flight += calls
        self.max_calls_in_flight = max(self.max_calls_in_flight, self.calls_in_flight)
        try:
            if drawn:
                await asyncio.sleep(max(drawn))
            return await self._forward(request, body)
        finally:
            self.calls_in_flight -= calls

    async def _forward(self, request: web.Request, body: bytes) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            async with self._client.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers
            ) as answer:
                raw = await answer.read()
                kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
                return web.Response(body=raw, status=answer.status, headers=kept)
        except aiohttp.ClientError as error:
            return web.json_response({"error": f"upstream {self.upstream} unreachable: {error}"}, status=502)

    async def start(self, host: str, port: int) -> web.AppRunner:
        """Listen on (host, port; 0: a free one) and set ``url``; returns the runner to clean up."""
        # No pool limit and no client timeout: the server's own limits and deadlines apply, and calls held
        # here must not queue behind each other. auto_decompress off both ways: bytes pass as they came.
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None, auto_decompress=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await self.close(runner)
            raise
        bound_host, bound_port = runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return runner

    async def close(self, runner: web.AppRunner) -> None:
        await runner.cleanup()
        await self._client.close()


@contextlib.contextmanager
def start_latency_proxy(
    upstream: str, *, median_s: float = 0.5, p95_s: float = 2.0, seed: int = 0, host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[LatencyProxy]:
    """Run a :class:`LatencyProxy` in front of the server at ``upstream`` (e.g. ``start_local``'s ``url``) on
    its own event loop in a background thread; stopped on leaving the block. ``median_s`` / ``p95_s`` /
    ``seed``: the delays (:class:`LognormalDelay`); ``port`` 0 picks a free one."""
    proxy = LatencyProxy(upstream=upstream.rstrip("/"), delay=LognormalDelay(median_s, p95_s, seed=seed))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="latency-proxy", daemon=True)
    thread.start()
    try:
        runner = asyncio.run_coroutine_threadsafe(proxy.start(host, port), loop).result()
        try:
            yield proxy
        finally:
            asyncio.run_coroutine_threadsafe(proxy.close(runner), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox_server.latency_proxy",
        description="Delay every tool call to a sandbox server by a lognormal draw; forward the rest.",
    )
    parser.add_argument("--upstream", required=True, help="the sandbox server's URL, e.g. http://127.0.0.1:8088")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8089, help="port to listen on (0: a free one)")
    parser.add_argument("--median", type=float, default=0.5, help="median delay per call, seconds")
    parser.add_argument("--p95", type=float, default=2.0, help="95th percentile of the delay, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the delays")
    args = parser.parse_args(argv)
    if not args.upstream.startswith(("http://", "https://")):
        parser.exit(2, f"error: --upstream must be an http(s) URL, got {args.upstream!r}\n")
    if not 0 <= args.port <= 65535:
        parser.exit(2, f"error: --port must be in 0..65535, got {args.port}\n")
    try:
        with start_latency_proxy(
            args.upstream, median_s=args.median, p95_s=args.p95, seed=args.seed, host=args.host,
            port=args.port,
        ) as running:
            print(f"latency proxy listening on {running.url} -> {args.upstream} "
                  f"(median {args.median} s, p95 {args.p95} s)", flush=True)
            threading.Event().wait()
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    except OSError as error:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port}: {error}\n")
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
