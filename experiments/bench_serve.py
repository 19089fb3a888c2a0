"""Serving benchmark: the OpenAI-compatible server under 1, 16 and 64 concurrent streaming clients.

  python -m experiments.bench_serve                       # tiny model and the Qwen3-0.6B shape
  python -m experiments.bench_serve --shapes=tiny

For each model shape (random weights; the tiny one over a small BPE vocabulary, the other with Qwen3-0.6B's
dimensions and vocabulary) it measures, through HTTP with streamed responses:

* requests/s and output tokens/s with 1, 16 and 64 clients, each sending its next request as soon as the
  last one finished;
* time to first token (the first streamed text), p50 and p99 over the requests;
* ``batching_speedup``: the wall time of 16 requests sent one after another over that of the same 16
  requests sent at once (goal >= 4 for the tiny model on this CPU). Request ``i`` is seeded by ``i`` in both
  runs, so both generate the same tokens.

Prints a table, then (last line) one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import aiohttp
import jax
import numpy as np
from absl import app, flags

from rstar2jax import models
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.serve import BackgroundServer, Policy, ServerConfig

_SHAPES = flags.DEFINE_list("shapes", ["tiny", "qwen3_0.6b"], "Model shapes: tiny, qwen3_0.6b.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["1", "16", "64"], "Concurrent clients.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Output tokens per request (tiny model).")
_MAX_TOKENS_06B = flags.DEFINE_integer("max_tokens_06b", 8, "Output tokens per request (0.6B shape).")
_REQUESTS = flags.DEFINE_integer("requests", 64, "Requests per concurrency level (at least one per client).")
_REQUESTS_06B = flags.DEFINE_integer("requests_06b", 16, "Requests per concurrency level, 0.6B shape.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 64, "Engine slots.")
_SEGMENT = flags.DEFINE_integer("segment_tokens", 64, "Tokens per server segment (streamed chunk).")
_DECODE_CHUNK = flags.DEFINE_integer("decode_chunk", 16, "Engine decode steps per device call.")
_BASELINE = 16  # batching_speedup: this many requests sequential vs at once

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B, Apache-2.0).
QWEN3_06B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=40960,
)  # fmt: skip
TINY = dict(
    model_type="qwen3", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
MESSAGES = [{"role": "user", "content": "Tell me a long story about numbers."}]


def make_policy(shape: str, tokenizer_dir: str) -> Policy:
    """Random weights of ``shape`` with a small BPE tokenizer (its end-of-turn token as EOS)."""
    tokenizer = train_tiny_tokenizer([json.dumps(MESSAGES)] * 8, 400, tokenizer_dir)
    fields = dict(TINY, vocab_size=len(tokenizer)) if shape == "tiny" else dict(QWEN3_06B)
    config = models.ModelConfig(**fields, eos_token_ids=(tokenizer.eos_token_id,))
    params = models.init_params(config, jax.random.key(0))
    return Policy(config, params, tokenizer, name=shape, path="(random weights)", source="random")


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
        policy = make_policy(shape, tokenizer_dir)
    config = ServerConfig(
        num_slots=_NUM_SLOTS.value,
        max_len=256,
        segment_tokens=_SEGMENT.value,
        decode_chunk=_DECODE_CHUNK.value,
        assistant_opener="",
        warmup=True,
    )
    rows = {}
    with BackgroundServer(policy, config) as server:
        url = server.url + "/v1/chat/completions"
        levels = sorted({int(c) for c in _CONCURRENCY.value} | {_BASELINE})
        for clients in levels:  # compile each level's programs before timing
            asyncio.run(closed_loop(url, clients, clients, 2))
        asyncio.run(closed_loop(url, 1, 2, max_tokens))
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


def main(argv):
    del argv
    results = {}
    print("| model | clients | requests | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for shape in _SHAPES.value:
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
        summary["goal_met"] = results["tiny"]["batching_speedup"] >= 4
    print(json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
