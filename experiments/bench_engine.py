"""Benchmark of the generation engine (issue 5), each figure against its baseline in the same run.

1. Decode throughput against transformers ``generate`` (PyTorch CPU, greedy, same random weights), batch 32,
   on a small Qwen3 shape and on the Qwen3-0.6B shape. Goals: >= 3x (small), >= 1x (0.6B).
2. Batch-1 decode step of the 0.6B shape against the memory-bandwidth floor: parameter bytes / copy bandwidth
   (bytes read + written per second by a large ``np.copyto``), measured in the same run. Goal: <= 1.5x.
3. 64 multi-turn rollouts, each pausing 3 times for a simulated tool with log-normal latency (mean 0.3 s),
   on the engine (tools run while other slots decode) against a turn-synchronous static batch (each turn
   waits for the longest segment and the slowest tool), both on the same device code. Goal: >= 1.5x faster.
   Segment lengths are heavy-tailed like real responses (log-normal, median 24 tokens, clipped to 4..128);
   tool latencies log-normal with mean 0.3 s and log-space std 1.
   The model is a tiny Qwen3 shape whose batch-64 decode step on a CPU (a few ms) is in the range of a real
   policy's step on an accelerator, so decode and tool time keep the proportions of a real rollout; with a
   CPU-bound step 10x slower the tools would vanish from both timings.

Usage: ``python -m experiments.bench_engine [--new_tokens=256] [--new_tokens_06b=256] [--skip_06b]``.
Prints a table and, as the last line, a JSON object with the three ratios. The transformers side runs in a
subprocess (``--torch_worker``) so the two models never share memory.

``--scale`` measures the paged KV cache instead (issue 21), each figure against its baseline in the same run:

- ``long_cache_step_ratio``: decode step time of 64 sequences holding 640 tokens each on an engine configured
  for 8192-token sequences over the same on one configured for 640 (+ the 64 tokens of head room the
  measured steps need). Goal <= 1.3.
- ``kv_bytes_ratio``: KV bytes the pool holds for those sequences (pages allocated, look-ahead of the decode
  chunk included) over their tokens x the per-token KV size. Goal <= 1.25.
- ``group_prompt_kv_ratio``: KV bytes held by one 512-token prompt forked into 16 samples that generated 64
  tokens each, over (512 + 16 x 64) x the per-token KV size. Goal <= 1.2.
- ``multistep_speedup``: batch-1 decode tokens/s of the tiny model with 32 decode steps per device call over
  one step per call. Goal >= 2.
- ``decode_tokens_per_s``: tokens/s of ``generate`` (16-token prompts, greedy) for the tiny and the
  Qwen3-0.6B-shaped model at batch 1 and 64; ``batch1_step_over_floor``: the 0.6B batch-1 decode step over
  the memory-bandwidth floor (parameter bytes / copy bandwidth).

``--scale --gpu``: the same in bfloat16 with the Qwen3-1.7B shape for the ratios, plus tokens/s and the decode
step over the HBM floor ((parameter + KV bytes read per step) / measured device copy bandwidth) for 0.6B and
1.7B at batch 1/64/256 (``--gpu_batches``, ``--gpu_models``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import app, flags

from rstar2jax.engine import Engine, EngineConfig, EngineCore, SamplingParams, generate
from rstar2jax.engine.paged_attention import init_pages
from rstar2jax.engine.scheduler import engine_params
from rstar2jax.models import HF_CONFIGS_DIR, config_from_hf, init_params, load_pretrained

QWEN3_06B = HF_CONFIGS_DIR / "qwen3-0.6b.json"
QWEN3_17B = HF_CONFIGS_DIR / "qwen3-1.7b.json"
SMALL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
)
TINY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=4096,
)
PROMPT_LEN = 16
TOOL_MEAN_S, TOOL_SIGMA = 0.3, 1.0  # log-normal tool latency: mean 0.3 s, log-space std 1
SEGMENT_MEDIAN, SEGMENT_SIGMA, SEGMENT_RANGE = 24, 0.75, (4, 128)  # log-normal tokens per generation segment
TOOL_TOKENS = (4, 16)


def _hf_config(shape: str) -> dict:
    with open(QWEN3_17B if shape == "1.7b" else QWEN3_06B, encoding="utf-8") as f:
        config = json.load(f)
    config.update({"small": SMALL_SHAPE, "tiny": TINY_SHAPE}.get(shape, {}))
    config.update(eos_token_id=None, bos_token_id=None, torch_dtype="float32")
    return config


def _prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, vocab, (batch, PROMPT_LEN)).tolist()


def torch_worker(shape: str, path: str, batch: int, new_tokens: int) -> None:
    """Build the random HF model, save it to ``path`` for the JAX side, time greedy ``generate``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**_hf_config(shape))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    ids = torch.tensor(_prompts(batch, config.vocab_size))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        elapsed = time.perf_counter() - start
    print(json.dumps({"seconds": elapsed, "tokens": out[:, PROMPT_LEN:].tolist()}))


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def decode_throughput(shape: str, batch: int, new_tokens: int) -> dict:
    """Tokens/s of ours and of transformers on the same weights; also how many greedy tokens agree."""
    with tempfile.TemporaryDirectory() as path:
        worker = subprocess.run(
            [sys.executable, __file__, f"--torch_worker={shape},{path},{batch},{new_tokens}"],
            check=True,
            capture_output=True,
            text=True,
        )
        hf = json.loads(worker.stdout.strip().splitlines()[-1])
        config, params = load_pretrained(path)
    engine_config = EngineConfig(
        num_slots=batch,
        max_len=_round_up(PROMPT_LEN + new_tokens),
        decode_chunk=32,
        prefill_buckets=(PROMPT_LEN,),
        eos_token_ids=(),
    )
    EngineCore(params, config, engine_config).warmup()
    prompts = _prompts(batch, config.vocab_size)
    start = time.perf_counter()
    results = generate(params, config, prompts, max_new_tokens=new_tokens, engine_config=engine_config)
    elapsed = time.perf_counter() - start
    ours = np.array([r.tokens for r in results])
    # Greedy decoding of random weights amplifies float rounding: compare up to each row's first divergence.
    same = np.append(ours == np.array(hf["tokens"]), np.zeros((batch, 1), bool), axis=1)
    agree = np.mean(np.argmin(same, axis=1) / new_tokens)
    return dict(
        ours_tok_s=batch * new_tokens / elapsed,
        hf_tok_s=batch * new_tokens / hf["seconds"],
        agree=float(agree),
        params=int(sum(x.size for x in jax.tree.leaves(params))),
        config=config,
        params_tree=params,
    )


def copy_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by the best of ``repeats`` copies of a large buffer."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def batch1_step(params, config, steps: int = 48, chunk: int = 16) -> float:
    """Seconds per decode step of one sequence (best full chunk after warm-up)."""
    engine_config = EngineConfig(
        num_slots=1,
        max_len=_round_up(PROMPT_LEN + steps + chunk),
        decode_chunk=chunk,
        prefill_buckets=(PROMPT_LEN,),
        eos_token_ids=(),
    )
    core = EngineCore(params, config, engine_config)
    core.warmup()
    ((record,),) = core.admit(
        [(_prompts(1, config.vocab_size)[0], 1, SamplingParams(temperature=0.0), steps + chunk, (0,))]
    )
    core.start(record, max_new_tokens=steps + chunk)
    core.step()  # the prefill and the first chunk
    times = []
    slot = record.slot
    while core.num_active:
        length, start = int(core.state.seq_len[slot]), time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - start
        if int(core.state.seq_len[slot]) - length == chunk:  # a last, partial chunk would flatter the minimum
            times.append(elapsed)
    return min(times) / chunk


def _multiturn_plan(num_rollouts: int, turns: int, vocab: int, seed: int = 0):
    """Per rollout: segment lengths (turns + 1), tool outputs (turns), tool latencies (turns)."""
    rng = np.random.default_rng(seed)
    mu = math.log(TOOL_MEAN_S) - TOOL_SIGMA**2 / 2  # so that the mean is TOOL_MEAN_S
    segment = lambda: int(np.clip(round(rng.lognormal(math.log(SEGMENT_MEDIAN), SEGMENT_SIGMA)),
                                  *SEGMENT_RANGE))
    tool = lambda: rng.integers(0, vocab, rng.integers(TOOL_TOKENS[0], TOOL_TOKENS[1] + 1)).tolist()
    return [
        dict(
            segments=[segment() for _ in range(turns + 1)],
            tools=[tool() for _ in range(turns)],
            latencies=rng.lognormal(mu, TOOL_SIGMA, turns).tolist(),
        )
        for _ in range(num_rollouts)
    ]


def multiturn(num_rollouts: int = 64, turns: int = 3) -> dict:
    """Wall time of the rollouts on the engine and on a turn-synchronous static batch (same device code)."""
    config = config_from_hf(_hf_config("tiny"))
    params = init_params(config, jax.random.key(0))
    plan = _multiturn_plan(num_rollouts, turns, config.vocab_size)
    prompts = _prompts(num_rollouts, config.vocab_size, seed=1)
    max_tokens = SEGMENT_RANGE[1] * (turns + 1) + TOOL_TOKENS[1] * turns
    engine_config = EngineConfig(
        num_slots=num_rollouts,
        max_len=_round_up(PROMPT_LEN + max_tokens),
        decode_chunk=8,
        prefill_buckets=(16,),
        eos_token_ids=(),
    )
    EngineCore(params, config, engine_config).warmup()
    greedy = SamplingParams(temperature=0.0)

    async def rollout(engine, prompt, item):
        (session,) = await engine.open(prompt, sampling=greedy, max_tokens=max_tokens)
        for turn in range(turns):
            await session.generate(max_new_tokens=item["segments"][turn])
            await asyncio.sleep(item["latencies"][turn])  # the tool call: other slots keep decoding
            session.append(item["tools"][turn])
        await session.generate(max_new_tokens=item["segments"][turns])
        session.close()
        return session.response_ids

    async def run_engine():
        async with Engine(params, config, engine_config) as engine:
            return await asyncio.gather(
                *[rollout(engine, prompt, item) for prompt, item in zip(prompts, plan, strict=True)]
            )

    start = time.perf_counter()
    engine_responses = asyncio.run(run_engine())
    engine_s = time.perf_counter() - start

    start = time.perf_counter()
    core = EngineCore(params, config, engine_config)
    groups = core.admit([(prompt, 1, greedy, max_tokens, (i,)) for i, prompt in enumerate(prompts)])
    records = [record for (record,) in groups]
    for turn in range(turns + 1):
        for record, item in zip(records, plan, strict=True):
            core.start(record, max_new_tokens=item["segments"][turn])
        while core.num_active:  # the whole batch waits for its longest segment
            core.step()
        if turn < turns:
            time.sleep(max(item["latencies"][turn] for item in plan))  # ... and for the slowest tool
            for record, item in zip(records, plan, strict=True):
                record.pending += item["tools"][turn]
    static_s = time.perf_counter() - start
    same = all(r.response_ids == e for r, e in zip(records, engine_responses, strict=True))
    return dict(engine_s=engine_s, static_s=static_s, same_tokens=same)


# ---- --scale: the paged KV cache


def _clock() -> float:
    """Process CPU seconds on a CPU backend (on this shared 2-core machine wall time varies 3x with other
    jobs' load while CPU time stays within 10%), wall seconds on an accelerator."""
    return time.process_time() if jax.default_backend() == "cpu" else time.perf_counter()


def _model(shape: str, dtype: str = "float32"):
    """Random weights of ``shape``, already in the layout the engine decodes from (so each engine built on
    them uses them as they are: one copy in memory)."""
    config = config_from_hf(_hf_config(shape), param_dtype=dtype, compute_dtype=dtype)
    params = init_params(config, jax.random.key(0))
    return config, engine_params(params, config, unstacked=True)  # unrolled layers slice nothing per step


def _scale_core(params, config, *, slots: int, max_len: int, tokens_per_slot: int, chunk: int, bucket: int,
                **overrides) -> EngineCore:
    """An engine whose pool holds ``slots`` sequences of ``tokens_per_slot`` tokens, whatever ``max_len``."""
    engine_config = EngineConfig(
        num_slots=slots, max_len=max_len, decode_chunk=chunk, prefill_buckets=(bucket,), eos_token_ids=(),
        num_pages=slots * -(-tokens_per_slot // 16) + 1, page_size=16, return_on_stop=False,
        prefix_sharing=False, **overrides)
    return EngineCore(params, config, engine_config)


class _DecodeRun:
    """``slots`` sequences that hold ``prompt_len`` tokens, decoding greedily in chunks of ``chunk`` steps."""

    def __init__(self, params, config, *, slots: int, prompt_len: int, max_len: int, chunk: int = 8,
                 chunks: int = 7, bucket: int = 128):
        steps = chunk * (chunks + 1)  # a chunk more than run, so no sequence finishes (and frees its pages)
        self.chunk = chunk
        self.core = _scale_core(params, config, slots=slots, max_len=max_len,
                                tokens_per_slot=prompt_len + steps, chunk=chunk, bucket=bucket)
        rng = np.random.default_rng(0)
        greedy = SamplingParams(temperature=0.0)
        groups = self.core.admit([(rng.integers(0, config.vocab_size, prompt_len).tolist(), 1, greedy, steps,
                                   (i,)) for i in range(slots)])
        for (record,) in groups:
            self.core.start(record)
        self.core.step()  # the first chunk (and, once per shape, compiling)
        self.times, self.wall_times = [], []

    def time_chunk(self) -> None:
        start, wall = _clock(), time.perf_counter()
        self.core.step()  # synchronous: it reads the slots' statuses back
        self.times.append(_clock() - start)
        self.wall_times.append(time.perf_counter() - wall)

    @property
    def step_s(self) -> float:
        """Seconds per decode step (:func:`_clock`): the best timed chunk over its steps."""
        return min(self.times) / self.chunk

    @property
    def wall_step_s(self) -> float:
        """Wall seconds per decode step: the best timed chunk over its steps."""
        return min(self.wall_times) / self.chunk

    def kv(self) -> dict:
        """KV bytes the pool holds now, and the bytes of the tokens held."""
        held_tokens = int(self.core._lengths.sum())
        per_token = self.core.state.pages.nbytes_per_page / self.core.engine_config.page_size
        return dict(kv_bytes=self.core.kv_bytes_held, token_bytes=held_tokens * per_token,
                    held_tokens=held_tokens)


def decode_steps(runs: Sequence[_DecodeRun], rounds: int = 5) -> None:
    """Time chunks of ``runs`` interleaved (so load changes on a shared machine hit them alike)."""
    for _ in range(rounds):
        for run in runs:
            run.time_chunk()


def group_prompt_kv(params, config, *, prompt_len: int = 512, samples: int = 16,
                    new_tokens: int = 64) -> dict:
    """KV bytes held by one prompt forked into ``samples`` samples that generated ``new_tokens`` each."""
    engine_config = EngineConfig(num_slots=samples, max_len=prompt_len + 2 * new_tokens, decode_chunk=16,
                                 prefill_buckets=(128,), eos_token_ids=(), page_size=16)
    core = EngineCore(params, config, engine_config)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len).tolist()
    (group,) = core.admit([(prompt, samples, SamplingParams(temperature=1.0), 2 * new_tokens, (0,))])
    for record in group:
        core.start(record, max_new_tokens=new_tokens)  # they pause (holding their pages) after new_tokens
    while core.num_active:
        core.step()
    assert all(len(r.response_ids) == new_tokens for r in group)
    per_token = core.state.pages.nbytes_per_page / engine_config.page_size
    return dict(kv_bytes=core.kv_bytes_held, token_bytes=(prompt_len + samples * new_tokens) * per_token)


def generate_tokens_per_s(params, config, *, batches: Sequence[int], new_tokens: int, chunks: Sequence[int],
                          repeats: int = 3) -> dict:
    """Tokens/s of ``generate`` (16-token prompts, greedy) per (batch, decode chunk): the best of ``repeats``
    calls, the settings taking turns (so load changes on a shared machine hit them alike), after a warm-up
    call of each."""
    settings = [(batch, chunk) for batch in batches for chunk in chunks]
    best = dict.fromkeys(settings, 0.0)
    for repeat in range(repeats + 1):
        for batch, chunk in settings:
            engine_config = EngineConfig(num_slots=batch, max_len=_round_up(PROMPT_LEN + new_tokens, 16),
                                         decode_chunk=chunk, prefill_buckets=(PROMPT_LEN,), eos_token_ids=())
            prompts = _prompts(batch, config.vocab_size)
            start = _clock()
            generate(params, config, prompts, max_new_tokens=new_tokens, engine_config=engine_config)
            if repeat:  # the first round compiles
                rate = batch * new_tokens / (_clock() - start)
                best[batch, chunk] = max(best[batch, chunk], rate)
    return best


def device_copy_bandwidth(num_bytes: int = 2**30) -> float:
    """Bytes read + written per second by a jitted copy of a large device array (best of 5)."""
    x = jax.numpy.ones((num_bytes // 4,), jax.numpy.float32)
    copy = jax.jit(lambda a: a + 1)
    copy(x).block_until_ready()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def step_over_floor(params, config, *, batch: int, held: int, param_bytes: int, measure_bandwidth) -> dict:
    """Wall seconds per decode step (best chunk) of ``batch`` sequences holding ``held`` tokens, against the
    memory-bandwidth floor: (parameter bytes + the KV bytes of the held tokens) / the best of three
    ``measure_bandwidth()`` copies, timed between the steps so both see the same load. Also the KV the pool
    holds (``kv``: :meth:`_DecodeRun.kv`)."""
    run = _DecodeRun(params, config, slots=batch, prompt_len=held, max_len=2048, chunks=4)
    bandwidth = 0.0
    for _ in range(3):
        bandwidth = max(bandwidth, measure_bandwidth())
        decode_steps([run], rounds=1)
    kv = run.kv()
    return dict(step_s=run.wall_step_s, floor_s=(param_bytes + kv["token_bytes"]) / bandwidth,
                bandwidth=bandwidth, kv=kv)


def big_rollout(params, config, *, prompts: int = 64, prompt_len: int = 2048, samples: int = 16,
                new_tokens: int = 64, kv_gib: float = 40.0) -> dict:
    """``prompts`` prompts of ``prompt_len`` tokens x ``samples`` samples of ``new_tokens`` tokens at once, on
    a pool of ``kv_gib`` GiB (a dense cache would need every sequence's ``max_len`` tokens)."""
    probe = init_pages(config.num_layers, config.num_kv_heads, config.head_dim, 2, 16,
                       jax.numpy.dtype(config.compute_dtype))
    num_pages = int(kv_gib * 2**30 // probe.nbytes_per_page)
    engine_config = EngineConfig(num_slots=prompts * samples, max_len=_round_up(prompt_len + new_tokens, 16),
                                 decode_chunk=16, prefill_buckets=(512,), eos_token_ids=(),
                                 num_pages=num_pages)
    core = EngineCore(params, config, engine_config)
    rng = np.random.default_rng(2)
    start = time.perf_counter()
    groups = core.admit([(rng.integers(0, config.vocab_size, prompt_len).tolist(), samples,
                          SamplingParams(temperature=1.0), new_tokens, (i,)) for i in range(prompts)])
    for record in (r for group in groups for r in group):
        core.start(record)
    peak = core.kv_bytes_held
    while core.num_active:
        peak = max(peak, core.kv_bytes_held)
        core.step()
    dense = prompts * samples * engine_config.max_len * probe.nbytes_per_page / 16
    return dict(seconds=time.perf_counter() - start, peak_kv=peak, dense_kv=dense)


def scale(args, report) -> None:
    """The ``--scale`` measurements (see the module docstring)."""
    gpu = args.gpu
    dtype = "bfloat16" if gpu else "float32"
    ratio_shape = "1.7b" if gpu else "tiny"
    config, params = _model(ratio_shape, dtype)
    short = _DecodeRun(params, config, slots=64, prompt_len=640, max_len=640 + 64)
    long = _DecodeRun(params, config, slots=64, prompt_len=640, max_len=8192)
    decode_steps([short, long])
    report("long_cache_step_ratio", f"step ms, {ratio_shape}, 64 x 640 tok, max_len 8192 vs 704",
           long.step_s * 1e3, short.step_s * 1e3, long.step_s / short.step_s, "<= 1.3", "")
    kv = long.kv()
    report("kv_bytes_ratio", "KV MiB held vs tokens x per-token KV", kv["kv_bytes"] / 2**20,
           kv["token_bytes"] / 2**20, kv["kv_bytes"] / kv["token_bytes"], "<= 1.25",
           f"{kv['held_tokens']} tokens held, 8192 engine")
    del short, long
    group = group_prompt_kv(params, config)
    report("group_prompt_kv_ratio", "KV MiB, 512-tok prompt x 16 samples x 64 tok", group["kv_bytes"] / 2**20,
           group["token_bytes"] / 2**20, group["kv_bytes"] / group["token_bytes"], "<= 1.2",
           "vs (512 + 16 x 64) tokens")
    del params
    tiny_config, tiny_params = _model("tiny", dtype)
    rates = generate_tokens_per_s(tiny_params, tiny_config, batches=[1], new_tokens=128, chunks=[32, 1])
    many, one = rates[1, 32], rates[1, 1]
    report("multistep_speedup", "batch-1 tok/s, tiny, 32 steps per call vs 1", many, one, many / one, ">= 2",
           "best of 3 each")
    speeds = {}
    shapes = args.gpu_models if gpu else ["tiny", "0.6b"]
    batches = [int(b) for b in args.gpu_batches] if gpu else [1, 64]
    measure_bandwidth = device_copy_bandwidth if gpu else functools.partial(copy_bandwidth, repeats=2)
    for shape in shapes:
        config, params = (tiny_config, tiny_params) if shape == "tiny" else _model(shape, dtype)
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        new_tokens = 128 if shape == "tiny" or gpu else 8
        repeats = 3 if shape == "tiny" or gpu else 1
        rates = generate_tokens_per_s(params, config, batches=batches, new_tokens=new_tokens,
                                      chunks=[min(32, new_tokens)], repeats=repeats)
        for batch in batches:
            rate = rates[batch, min(32, new_tokens)]
            speeds[f"{shape}_batch{batch}"] = round(rate, 1)
            print(f"decode tok/s, {shape}, batch {batch}: {rate:.1f}", flush=True)
            if shape != "tiny" and (gpu or batch == 1):
                held = 512 if gpu else 64
                step = step_over_floor(params, config, batch=batch, held=held, param_bytes=param_bytes,
                                       measure_bandwidth=measure_bandwidth)
                report(f"step_over_floor_{shape}_batch{batch}",
                       f"decode step ms, {shape}, b{batch}, {held} tok",
                       step["step_s"] * 1e3, step["floor_s"] * 1e3, step["step_s"] / step["floor_s"],
                       "<= 1.5x" if batch == 1 else "<= 1.4x", f"floor at {step['bandwidth'] / 1e9:.0f} GB/s")
        del params
    report.figures["decode_tokens_per_s"] = speeds
    if gpu and args.big_rollout:
        config, params = _model("1.7b", dtype)
        big = big_rollout(params, config)
        report("big_rollout_kv_over_dense", "64 x 2048-tok prompts x 16 samples x 64 tok: KV GiB",
               big["peak_kv"] / 2**30, big["dense_kv"] / 2**30, big["peak_kv"] / big["dense_kv"], "fits",
               f"{big['seconds']:.0f} s, 1.7B, no OOM")


_BATCH = flags.DEFINE_integer("batch", 32, "sequences decoded at once")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "new tokens per sequence (small)")
_NEW_TOKENS_06B = flags.DEFINE_integer("new_tokens_06b", 256, "new tokens per sequence (0.6B)")
_SKIP_06B = flags.DEFINE_bool("skip_06b", False, "leave out the two 0.6B measurements")
_SCALE = flags.DEFINE_bool("scale", False, "measure the paged KV cache (issue 21)")
_GPU = flags.DEFINE_bool("gpu", False, "with --scale: bfloat16, 1.7B ratios, GPU table")
_GPU_MODELS = flags.DEFINE_list("gpu_models", ["0.6b", "1.7b"], "with --gpu: model shapes")
_GPU_BATCHES = flags.DEFINE_list("gpu_batches", ["1", "64", "256"], "with --gpu: batch sizes")
_BIG_ROLLOUT = flags.DEFINE_bool(
    "big_rollout", False, "with --scale --gpu: 64 prompts x 2048 tokens x 16 samples on one GPU"
)
_TORCH_WORKER = flags.DEFINE_list("torch_worker", None, "internal: SHAPE,PATH,BATCH,NEW of one PyTorch run")


def main(argv) -> None:
    del argv
    args = flags.FLAGS  # the flags by name (scale() reads the --gpu ones)
    if _TORCH_WORKER.value:
        shape, path, batch, new = _TORCH_WORKER.value
        torch_worker(shape, path, int(batch), int(new))
        return

    rows, figures = [], {}
    bench_start = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (shared machine: timings are noisy)", flush=True)

    def report(key, name, ours, base, ratio, goal, note):
        """Record one measurement and print it at once (the whole run takes minutes)."""
        figures[key] = ratio
        rows.append(f"{name:<44}{ours:>12.2f}{base:>12.2f}{ratio:>9.2f}  {goal:<9}{note}")
        print(rows[-1], flush=True)

    report.figures = figures
    if args.scale:
        scale(args, report)
        print(f"\n{'measurement':<44}{'ours':>12}{'baseline':>12}{'ratio':>9}  {'goal':<9}note")
        print("\n".join(rows))
        if jax.default_backend() == "cpu":
            print("(on CPU, step times and tokens/s are per process CPU second: the machine is shared)")
        print(f"whole benchmark: {time.perf_counter() - bench_start:.0f} s on "
              f"{jax.devices()[0].device_kind}; load average at end: {os.getloadavg()[0]:.2f}")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
        return
    small = decode_throughput("small", args.batch, args.new_tokens)
    report("decode_speedup_small", f"decode tok/s, small, batch {args.batch} x {args.new_tokens}",
           small["ours_tok_s"], small["hf_tok_s"], small["ours_tok_s"] / small["hf_tok_s"], ">= 3x",
           f"greedy agreement {small['agree']:.2f}")
    del small
    turns = multiturn()
    report("multiturn_speedup", "64 rollouts x 3 tool pauses, wall s", turns["engine_s"], turns["static_s"],
           turns["static_s"] / turns["engine_s"], ">= 1.5x",
           f"same tokens {turns['same_tokens']}")
    if not args.skip_06b:
        big = decode_throughput("0.6b", args.batch, args.new_tokens_06b)
        report("decode_speedup_0.6b", f"decode tok/s, 0.6B, batch {args.batch} x {args.new_tokens_06b}",
               big["ours_tok_s"], big["hf_tok_s"], big["ours_tok_s"] / big["hf_tok_s"], ">= 1x",
               f"greedy agreement {big['agree']:.2f}")
        step_s = batch1_step(big["params_tree"], big["config"])
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(big["params_tree"]))
        floor_s = param_bytes / copy_bandwidth()
        report("batch1_step_over_floor", "batch-1 decode step, 0.6B, ms", step_s * 1e3, floor_s * 1e3,
               step_s / floor_s, "<= 1.5x", f"{param_bytes / 2**30:.2f} GiB params")

    print(f"\n{'measurement':<44}{'ours':>12}{'baseline':>12}{'ratio':>9}  {'goal':<9}note")
    print("\n".join(rows))
    print("(baselines: transformers generate on PyTorch CPU; memory-bandwidth floor; turn-synchronous batch)")
    print(f"whole benchmark: {time.perf_counter() - bench_start:.0f} s; "
          f"load average at end: {os.getloadavg()[0]:.2f}")
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))

if __name__ == "__main__":
    app.run(main)
