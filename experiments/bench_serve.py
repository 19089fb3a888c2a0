"""Serving benchmark: the OpenAI-compatible server under 1, 16 and 64 concurrent streaming clients, and its
prefix cache on a long chat.

  python -m experiments.bench_serve                       # tiny model, the Qwen3-0.6B shape, the chat
  python -m experiments.bench_serve --shapes=tiny --skip_prefix_cache

For each model shape (random weights; the tiny one, ``models.preset("tiny")``, over a small BPE vocabulary,
the other with Qwen3-0.6B's dimensions and vocabulary) it measures, through HTTP with streamed responses (an
aiohttp client in the same process):

* requests/s and output tokens/s with 1, 16 and 64 clients, each sending its next request as soon as the
  last one finished;
* time to first token (the first streamed text), p50 and p99 over the requests;
* ``batching_speedup`` (tiny model): the wall time of 16 requests sent one after another over that of the
  same 16 requests sent at once (goal >= 10). Request ``i`` is seeded by ``i`` in both runs, so both
  generate the same tokens.

``prefix_cache_speedup``: a chat of 8 turns whose 7 earlier turns hold about 2,000 tokens of history (fixed
texts), each turn resending the whole history, as chat clients do; the time to first token of the 8th turn
with the prefix cache on (its history's keys/values are still in the pool from turn 7) over cache off (a
server started with ``prefix_cache=False`` prefills the whole history). Goal >= 3. It runs on a 4-layer,
width-256 Qwen3 shape (``--prefix_shape``), whose 2,000-token prefill costs what a real model's does relative
to the HTTP round trip; with the tiny model both are round trips.

Prints a table, then (last line) one JSON object: ``batching_speedup``, ``tokens_per_s_64`` (tiny, 64
clients), ``qwen3_0p6b_tokens_per_s_1`` / ``_16`` / ``_64``, ``prefix_cache_speedup``, and per shape the
level figures.

``--soak_s=150`` runs a soak instead (tiny model): ``--soak_clients`` (48) clients send mixed traffic for that
long, each its next request as soon as the last one is answered, cycling through plain, streamed, ``n=3``,
with ``tools``, abandoned streams (the client leaves after the first event), ``max_tokens=1`` and bad requests
(400 expected); every answer is checked (status, body, ``[DONE]``, usage). The baseline is the process's
memory and the server's asyncio tasks after a warm-up round of every kind; after the soak it reports them
again, and whether the server is idle (no request running or waiting, no KV page held). JSON keys:
``soak_requests``, ``soak_errors``, ``soak_5xx``, ``rss_mib_before``, ``rss_mib_after``,
``server_tasks_before``, ``server_tasks_after``, ``idle_after``.

  python -m experiments.bench_serve --soak_s=150
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
import resource
import tempfile
import time

import aiohttp
import jax
import numpy as np
from absl import flags

from experiments import bench_record
from rstar2jax import models
from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.serve import BackgroundServer, Policy, ServerConfig

_SHAPES = flags.DEFINE_list("shapes", ["tiny", "qwen3_0.6b"], "Model shapes: tiny, qwen3_0.6b.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["1", "16", "64"], "Concurrent clients.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Output tokens per request (tiny model).")
_MAX_TOKENS_06B = flags.DEFINE_integer("max_tokens_06b", 8, "Output tokens per request (0.6B shape).")
_REQUESTS = flags.DEFINE_integer("requests", 64, "Requests per concurrency level (at least one per client).")
_REQUESTS_06B = flags.DEFINE_integer("requests_06b", 16, "Requests per concurrency level, 0.6B shape.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 64, "Engine slots.")
_DECODE_CHUNK = flags.DEFINE_integer("decode_chunk", 16, "Engine decode steps per device call.")
_SKIP_PREFIX = flags.DEFINE_bool("skip_prefix_cache", False, "Leave out the prefix-cache chat.")
_PREFIX_LAYERS = flags.DEFINE_integer("prefix_layers", 4, "Layers of the prefix-cache chat's model.")
_PREFIX_WIDTH = flags.DEFINE_integer("prefix_width", 256, "Width of the prefix-cache chat's model.")
_HISTORY_TOKENS = flags.DEFINE_integer("history_tokens", 2000, "Tokens of the chat history at its 8th turn.")
_SOAK_S = flags.DEFINE_float("soak_s", 0.0, "Run the soak instead (mixed traffic for this many seconds).")
_SOAK_CLIENTS = flags.DEFINE_integer("soak_clients", 48, "Concurrent clients of the soak.")
_BASELINE = 16  # batching_speedup: this many requests sequential vs at once

MESSAGES = [{"role": "user", "content": "Tell me a long story about numbers."}]
WORDS = ("alpha", "beta", "gamma", "delta", "seven", "eleven", "river", "stone", "cloud", "number", "story")


def make_policy(config: models.ModelConfig, tokenizer_dir: str, name: str) -> Policy:
    """Random weights of ``config`` (its vocabulary is the tokenizer's for the tiny shapes) with a small BPE
    tokenizer (its end-of-turn token as EOS)."""
    tokenizer = train_tiny_tokenizer([json.dumps(MESSAGES), " ".join(WORDS)] * 8, 400, tokenizer_dir)
    if config.vocab_size < len(tokenizer):
        config = dataclasses.replace(config, vocab_size=len(tokenizer))
    config = dataclasses.replace(config, eos_token_ids=(tokenizer.eos_token_id,))
    params = models.init_params(config, jax.random.key(0))
    return Policy(config, params, tokenizer, name=name, path="(random weights)", source="random")


def shape_config(shape: str) -> models.ModelConfig:
    if shape == "tiny":
        return models.preset("tiny", vocab_size=1)  # the tokenizer's vocabulary replaces it
    if shape == "qwen3_0.6b":
        return models.preset("qwen3-0.6b")
    raise ValueError(f"unknown shape {shape!r}; expected tiny or qwen3_0.6b")


async def stream_request(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, int]:
    """(time to first text, total time, completion tokens) of one streamed request."""
    start = time.perf_counter()
    first, tokens = None, 0
    async with http.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
    total = time.perf_counter() - start
    return (total if first is None else first), total, tokens


async def closed_loop(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` workers share ``requests`` requests, each sending its next when the last finished."""
    queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results = []

    async def worker(http):
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "messages": MESSAGES,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": i,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            results.append(await stream_request(http, url, body))

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(clients)))
        wall = time.perf_counter() - start
    ttft = np.array([r[0] for r in results]) * 1e3
    tokens = sum(r[2] for r in results)
    return {
        "clients": clients,
        "requests": requests,
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "output_tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
    }


def bench_shape(shape: str) -> dict:
    tiny = shape == "tiny"
    max_tokens = _MAX_TOKENS.value if tiny else _MAX_TOKENS_06B.value
    requests = _REQUESTS.value if tiny else _REQUESTS_06B.value
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy = make_policy(shape_config(shape), tokenizer_dir, shape)
    config = ServerConfig(num_slots=_NUM_SLOTS.value, max_len=256, decode_chunk=_DECODE_CHUNK.value,
                          assistant_opener="", warmup=True)
    rows = {}
    with BackgroundServer(policy, config) as server:
        url = server.url + "/v1/chat/completions"
        levels = sorted({int(c) for c in _CONCURRENCY.value} | {_BASELINE})
        asyncio.run(closed_loop(url, 1, 2, max_tokens))  # the first requests' one-off costs
        for clients in levels:
            if clients in {int(c) for c in _CONCURRENCY.value}:
                rows[clients] = asyncio.run(closed_loop(url, clients, max(requests, clients), max_tokens))
        sequential = asyncio.run(closed_loop(url, 1, _BASELINE, max_tokens))
        concurrent = asyncio.run(closed_loop(url, _BASELINE, _BASELINE, max_tokens))
    if sequential["output_tokens"] != concurrent["output_tokens"]:
        raise RuntimeError("the sequential and concurrent runs generated different token counts")
    return {
        "levels": rows,
        "sequential_16_s": sequential["wall_s"],
        "concurrent_16_s": concurrent["wall_s"],
        "batching_speedup": sequential["wall_s"] / concurrent["wall_s"],
        "max_tokens": max_tokens,
        "params": int(sum(x.size for x in jax.tree.leaves(policy.params))),
    }


def chat_history(turns: int, words_per_message: int, seed: int = 0) -> list[dict]:
    """``turns`` user/assistant exchanges of random words (fixed by ``seed``)."""
    rng = np.random.default_rng(seed)
    text = lambda: " ".join(rng.choice(WORDS, words_per_message))  # noqa: E731
    messages = []
    for _ in range(turns):
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return messages


async def chat_ttft(url: str, history: list[dict], turns: int) -> float:
    """Time to first token of turn ``turns`` (milliseconds), turns 1..turns sent one after another, each
    resending the history so far."""
    async with aiohttp.ClientSession() as http:
        for turn in range(1, turns + 1):
            body = {"messages": history[: 2 * turn - 1], "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            ttft, _, _ = await stream_request(http, url, body)
    return ttft * 1e3


def bench_prefix_cache() -> dict:
    """TTFT of a long chat's 8th turn, the prefix cache on and off (module docstring)."""
    width = _PREFIX_WIDTH.value
    shape = models.preset("tiny", vocab_size=1, num_layers=_PREFIX_LAYERS.value, hidden_size=width,
                          intermediate_size=3 * width, num_heads=4, num_kv_heads=2, head_dim=width // 4)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy = make_policy(shape, tokenizer_dir, "prefix")
    count = lambda messages: len(encode_text(policy.tokenizer, render_chat(  # noqa: E731
        policy.tokenizer, messages, add_generation_prompt=True)))
    words = round(60 * _HISTORY_TOKENS.value / count(chat_history(8, 60)[:15]))  # about 2,000 tokens
    history = chat_history(8, words)
    result = {"history_tokens": count(history[:15])}
    for cache in (True, False):
        config = ServerConfig(num_slots=4, max_len=4096, assistant_opener="", prefix_cache=cache, warmup=True)
        with BackgroundServer(policy, config) as server:
            url = server.url + "/v1/chat/completions"
            asyncio.run(chat_ttft(url, chat_history(8, words, seed=1), 8))  # a first chat's one-off costs
            result["ttft_ms_cache_" + ("on" if cache else "off")] = asyncio.run(chat_ttft(url, history, 8))
            result["hit_rate_" + ("on" if cache else "off")] = server.service.stats["cached_tokens"] / max(
                server.service.stats["prompt_tokens"], 1)
    result["prefix_cache_speedup"] = result["ttft_ms_cache_off"] / result["ttft_ms_cache_on"]
    return result


SOAK_KINDS = ("plain", "stream", "n3", "tools", "abandon", "one_token", "bad")
_CODE = {"type": "object", "properties": {"code": {"type": "string"}}}
_TOOL = {"type": "function",
         "function": {"name": "python", "description": "Runs Python code.", "parameters": _CODE}}


def _soak_body(kind: str, i: int) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 1.0, "seed": i}
    extra = {"stream": {"stream": True, "stream_options": {"include_usage": True}}, "n3": {"n": 3},
             "tools": {"tools": [_TOOL]}, "abandon": {"stream": True}, "one_token": {"max_tokens": 1},
             "bad": {"temperature": 5}}
    return {**body, **extra.get(kind, {})}


async def soak_request(http: aiohttp.ClientSession, url: str, kind: str, i: int) -> tuple[int, str | None]:
    """(HTTP status, what was wrong with the answer or None) of one soak request of ``kind``."""
    async with http.post(url, json=_soak_body(kind, i)) as response:
        if kind == "abandon":
            await response.content.readline()
            response.close()  # the client leaves mid-stream
            return response.status, None if response.status == 200 else "not 200"
        text = await response.text()
    if kind == "bad":
        ok = response.status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
        return response.status, None if ok else "not a 400 invalid_request_error"
    if response.status != 200:
        return response.status, f"HTTP {response.status}: {text[:200]}"
    if kind == "stream":
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        ok = events and events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] > 0
        return 200, None if ok else "a stream without usage or [DONE]"
    body = json.loads(text)
    want = 3 if kind == "n3" else 1
    ok = len(body["choices"]) == want and all(c["finish_reason"] for c in body["choices"])
    if kind == "one_token":
        ok = ok and body["usage"]["completion_tokens"] == 1
    return 200, None if ok else f"an unexpected body: {text[:200]}"


def _rss_mib() -> float:
    """Resident memory of this process (server and clients), MiB."""
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    except OSError:  # not Linux: the peak instead
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def soak_traffic(url: str, clients: int, seconds: float) -> dict:
    """``clients`` closed-loop clients cycling through :data:`SOAK_KINDS` for ``seconds``."""
    counts, errors, statuses = collections.Counter(), collections.Counter(), collections.Counter()
    failures: list[str] = []
    end = time.monotonic() + seconds

    async def client(http, index):
        i = index
        while time.monotonic() < end:
            kind = SOAK_KINDS[i % len(SOAK_KINDS)]
            try:
                status, problem = await soak_request(http, url, kind, i)
            except (aiohttp.ClientError, ValueError, KeyError) as error:
                status, problem = 0, f"{type(error).__name__}: {error}"
            counts[kind] += 1
            statuses[status] += 1
            if problem:
                errors[kind] += 1
                failures.append(f"{kind}: {problem}")
            i += clients

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(client(http, i) for i in range(clients)))
    return {"counts": counts, "errors": errors, "statuses": statuses, "failures": failures}


def soak() -> dict:
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy = make_policy(shape_config("tiny"), tokenizer_dir, "tiny")
    config = ServerConfig(num_slots=16, max_len=1024, assistant_opener="", warmup=True)  # tools: ~460 tokens

    async def server_tasks():
        return len(asyncio.all_tasks())

    with BackgroundServer(policy, config) as server:
        url = server.url + "/v1/chat/completions"
        asyncio.run(soak_traffic(url, len(SOAK_KINDS), 5.0))  # every kind once at least: one-off costs
        gc.collect()
        before = {"rss": _rss_mib(), "tasks": server.call(server_tasks())}
        start = time.perf_counter()
        result = asyncio.run(soak_traffic(url, _SOAK_CLIENTS.value, _SOAK_S.value))
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 30
        while server.service.admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the engine's last steps release the pages of the last sessions
        gc.collect()
        gauges = {**server.service.engine_gauges(), "running": server.service.metrics.running,
                  "waiting": server.service.metrics.waiting}
        after = {"rss": _rss_mib(), "tasks": server.call(server_tasks())}
    return {**result, "wall_s": wall, "before": before, "after": after, "gauges": gauges}


def print_soak(result: dict) -> None:
    print("| kind | requests | errors |")
    print("|---|---|---|")
    for kind in SOAK_KINDS:
        print(f"| {kind} | {result['counts'][kind]} | {result['errors'][kind]} |")
    for failure in result["failures"][:10]:
        print(f"  {failure}")
    total, gauges = sum(result["counts"].values()), result["gauges"]
    idle = gauges["running"] == gauges["waiting"] == gauges["kv_pages_used"] == 0
    fivexx = sum(n for status, n in result["statuses"].items() if status >= 500)
    print(f"soak: {total} requests in {result['wall_s']:.0f} s from {_SOAK_CLIENTS.value} clients, "
          f"{sum(result['errors'].values())} errors, {fivexx} 5xx, statuses {dict(result['statuses'])}; "
          f"memory {result['before']['rss']:.0f} -> {result['after']['rss']:.0f} MiB; server tasks "
          f"{result['before']['tasks']} -> {result['after']['tasks']}; after: {gauges}", flush=True)
    print(json.dumps({
        "soak_s": _SOAK_S.value, "soak_clients": _SOAK_CLIENTS.value, "soak_requests": total,
        "soak_errors": sum(result["errors"].values()), "soak_5xx": fivexx,
        "requests_per_s": round(total / result["wall_s"], 2),
        "rss_mib_before": round(result["before"]["rss"], 1),
        "rss_mib_after": round(result["after"]["rss"], 1),
        "server_tasks_before": result["before"]["tasks"], "server_tasks_after": result["after"]["tasks"],
        "idle_after": idle,
    }))


def main(argv):
    del argv
    if _SOAK_S.value > 0:
        print_soak(soak())
        return
    results = {}
    print("| model | clients | requests | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for shape in filter(None, _SHAPES.value):
        result = results[shape] = bench_shape(shape)
        for clients, row in result["levels"].items():
            print(
                f"| {shape} | {clients} | {row['requests']} | {row['requests_per_s']:.2f} | "
                f"{row['output_tokens_per_s']:.1f} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} |",
                flush=True,
            )
        print(
            f"{shape}: 16 requests one after another {result['sequential_16_s']:.2f} s, at once "
            f"{result['concurrent_16_s']:.2f} s: batching_speedup {result['batching_speedup']:.2f}x "
            f"({result['max_tokens']} tokens each, {result['params'] / 1e6:.1f}M parameters)",
            flush=True,
        )
    summary = {
        shape: {
            "batching_speedup": r["batching_speedup"],
            **{
                f"c{c}_{k}": round(v, 3)
                for c, row in r["levels"].items()
                for k, v in row.items()
                if k in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
            },
        }
        for shape, r in results.items()
    }
    if "tiny" in results:
        summary["batching_speedup"] = results["tiny"]["batching_speedup"]
        if 64 in results["tiny"]["levels"]:
            summary["tokens_per_s_64"] = results["tiny"]["levels"][64]["output_tokens_per_s"]
    if "qwen3_0.6b" in results:
        for clients, row in results["qwen3_0.6b"]["levels"].items():
            summary[f"qwen3_0p6b_tokens_per_s_{clients}"] = row["output_tokens_per_s"]
    if not _SKIP_PREFIX.value:
        prefix = bench_prefix_cache()
        print(f"prefix cache: 8th turn of a chat with {prefix['history_tokens']} tokens of history, time to "
              f"first token {prefix['ttft_ms_cache_on']:.1f} ms with the cache (hit rate "
              f"{prefix['hit_rate_on']:.2f}) vs {prefix['ttft_ms_cache_off']:.1f} ms without: "
              f"prefix_cache_speedup {prefix['prefix_cache_speedup']:.2f}x", flush=True)
        summary.update(prefix)
    print(json.dumps(summary))


if __name__ == "__main__":
    bench_record.run(main)
