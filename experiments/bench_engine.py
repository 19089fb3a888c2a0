"""Benchmark of the generation engine, each figure against its baseline in the same run. Three modes.

Default (issue 5): decode throughput against transformers ``generate`` (PyTorch CPU, greedy, same random
weights), batch 32, on a small Qwen3 shape and on the Qwen3-0.6B shape (goals >= 3x, >= 1x); the batch-1
decode step of the 0.6B shape against the memory-bandwidth floor (parameter bytes / copy bandwidth, goal <=
1.5x); and 64 multi-turn rollouts, each pausing 3 times for a simulated tool with log-normal latency (mean
0.3 s), on the engine (tools run while other slots decode) against a turn-synchronous static batch (each turn
waits for the longest segment and the slowest tool), both on the same device code (goal >= 1.5x). Segment
lengths are heavy-tailed like real responses (log-normal, median 24 tokens, clipped to 4..128). The
transformers side runs in a subprocess (``--torch_worker``) so the two models never share memory.

``--scale`` (issue 21), the paged KV cache:

- ``long_cache_step_ratio``: decode step time of 64 sequences holding 640 tokens each on an engine configured
  for 8192-token sequences over the same on one configured for 720. Goal <= 1.3.
- ``kv_bytes_ratio``: KV bytes the pool holds for those sequences (pages held, look-ahead included) over
  their tokens x the per-token KV size. Goal <= 1.25.
- ``group_prompt_kv_ratio``: KV bytes held by one 512-token prompt forked into 16 samples that generated 64
  tokens each, over (512 + 16 x 64) x the per-token KV size. Goal <= 1.2.
- ``multistep_speedup``: batch-1 decode tokens/s of the tiny model with 32 decode steps per device call over
  one step per call. Goal >= 2.
- ``decode_tokens_per_s``: tokens/s of ``generate`` for the tiny and the Qwen3-0.6B shape at batch 1 and 64.

``--scale --gpu``: the same in bfloat16 with the Qwen3-1.7B shape for the ratios, plus the decode step over
the HBM floor for 0.6B and 1.7B at batch 1/64/256 (``--gpu_batches``, ``--gpu_models``).

``--startup`` (issue 31), how fast the engine is ready, each in a fresh process:

- ``programs_compiled``: programs compiled by a 64-slot engine (tiny model, ``max_len`` 4096) from its
  construction through a mixed workload: 24 groups of 1 or 4 sessions on prompts of 20 to 3,000 tokens
  (several share a system prompt), tool outputs appended between turns, stop sequences, decodes. Counted with
  a ``jax.monitoring`` listener. Goal <= 8.
- ``warmup_s_qwen3_0p6b``: seconds from starting ``python -m experiments.serve`` on a folder of random
  Qwen3-0.6B weights (64 slots, ``max_len`` 8192, ``--kv_pool_gib=4``) to its ``/health`` answering 200, with
  an empty JAX compilation cache; ``warmup_s_qwen3_0p6b_cached``: the same again with the cache the first
  start wrote (the folder is written before either start: its random weights are no part of start-up; the
  server's own ``start-up`` line, printed here, says where the seconds went). Goals <= 180 and <= 10
  (issue 43).
- ``decode_step_over_floor_b1`` (issue 43): the batch-1 decode step of the comparison shape below (best
  16-token chunk on a warm engine) over the time to read its head and layers' weights once at the copy
  bandwidth measured in the same process, best of ``--repeats`` processes. Goal <= 1.2.
- ``tunix_decode_ratio_b1`` / ``_b16``: decode tokens/s of :func:`rstar2jax.engine.generate` over google-tunix
  0.1.7's ``Sampler`` on the same random Qwen3 shape (2 layers, width 256, the real vocabulary 151,936,
  float32 both), 128 greedy tokens after a 32-token prompt, batch 1 and 16: each side's second call in its
  own fresh process (the first one compiles), best of ``--repeats`` processes each, taking turns;
  ``tunix_compile_ratio``: our first call's extra time over the second's, over theirs (batch 1). Goals
  >= 1.1, >= 1.1, <= 1.5 (issue 43). Tunix is a bench-only dependency that does not install beside this
  project (it pins transformers 5.12): install it into a folder of its own,
  ``pip install --no-deps --target DIR google-tunix==0.1.7 google-metrax clu wrapt sentencepiece perfetto``,
  and pass ``--tunix_path=DIR`` (without it the tunix keys are left out).

``--exact`` (issue 52): exact numerics (``ModelConfig.numerics="exact"``) against the default ones, by
``experiments.bench_exact`` (its docstring says what each key measures): ``exact_mismatch_max_fp32``,
``exact_mismatch_max_bf16``, ``exact_decode_ratio``, ``exact_train_ratio``.

``--precision`` (issue 41), the low-precision engine (``EngineConfig.weight_dtype`` / ``kv_dtype`` = "fp8"):

- ``kv_tokens_per_gib_ratio_fp8``: tokens a page pool of fixed bytes holds, FP8 over bfloat16, from the bytes
  of one page of each engine's real state (Qwen3-1.7B shape, ``jax.eval_shape``: nothing allocated). Goal
  >= 1.9.
- ``weight_bytes_ratio_fp8``: bytes of the engine's weights (``engine_params``: linear layers FP8 in 128 x
  128 blocks, embedding and norms bfloat16) over the bfloat16 engine's, Qwen3-1.7B shape. Goal <= 0.6.
- ``logprob_mismatch_fp8``: mean |delta log p| between an FP8 engine's (weights and KV pages) sampled-token
  log-probs and the trainer's (``models.sequence_logprobs``, teacher-forced, the policy's weights in
  bfloat16 compute), over held-out prompts (``--precision_samples`` samples each at temperature 1);
  ``logprob_mismatch_bf16``: the same for the bfloat16 engine, beside it; ``_fp8_weights`` / ``_fp8_kv``:
  each half alone. The policy: ``--policy_dir`` (e.g. the demo's SFT export ``<workdir>/policies/sft``) with
  ``--problems`` (its held-out split ``<workdir>/data/eval.jsonl``), by default the tiny taught policy of
  ``experiments.tiny_policy`` built here (its three taught questions and five it was not taught).
- ``--precision --gpu``: ``fp8_decode_speedup``, decode tokens/s of 64 sequences holding 512 tokens, FP8
  engine (weights and KV) over bfloat16, Qwen3-1.7B shape (``--precision_shape``), random weights. Goal
  >= 1.2.

Usage: ``python -m experiments.bench_engine [--scale | --startup | --precision]``. Prints a table and, as the
last line, a JSON object with the figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence

import jax
import numpy as np
from absl import flags

from experiments import bench_record
from rstar2jax import models
from rstar2jax.engine import Engine, EngineConfig, EngineCore, SamplingParams, generate, page_rounded
from rstar2jax.engine.programs import engine_params
from rstar2jax.engine.state import init_state
from rstar2jax.models import init_params, load_pretrained

# Shapes (random weights), all from the presets.
SHAPES = {
    "tiny": models.preset("tiny", vocab_size=4096, hidden_size=128, intermediate_size=384, num_heads=2,
                          num_kv_heads=1, head_dim=64),
    "small": models.preset("tiny", vocab_size=32000, hidden_size=256, intermediate_size=768, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=64),
    # Tunix's comparison: a 2-layer Qwen3 of width 256 with the real vocabulary.
    "tunix": models.preset("qwen3-0.6b", num_layers=2, hidden_size=256, intermediate_size=768, num_heads=4,
                           num_kv_heads=2, head_dim=64),
    "0.6b": models.preset("qwen3-0.6b"),
    "1.7b": models.preset("qwen3-1.7b"),
}
PROMPT_LEN = 16
TOOL_MEAN_S, TOOL_SIGMA = 0.3, 1.0  # log-normal tool latency: mean 0.3 s, log-space std 1
SEGMENT_MEDIAN, SEGMENT_SIGMA, SEGMENT_RANGE = 24, 0.75, (4, 128)  # log-normal tokens per generation segment
TOOL_TOKENS = (4, 16)
TUNIX_PROMPT, TUNIX_NEW = 32, 128


def _config(shape: str, dtype: str = "float32") -> models.ModelConfig:
    return dataclasses.replace(SHAPES[shape], eos_token_ids=(), bos_token_id=None, param_dtype=dtype,
                               compute_dtype=dtype)


def _prompts(batch: int, vocab: int, seed: int = 0, length: int = PROMPT_LEN) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).tolist()


def _drain(core: EngineCore) -> None:
    """Step ``core`` until it is idle, handing the chunks to their records."""
    while core.num_active:
        for record, chunk in core.step():
            record.receive(chunk)


def _worker(flag: str, *args, env: dict | None = None) -> dict:
    """Run one of this script's workers in a fresh process; its last stdout line is a JSON object."""
    command = [sys.executable, "-m", "experiments.bench_engine", f"--{flag}={','.join(map(str, args))}"]
    done = subprocess.run(command, check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=pathlib.Path(__file__).parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- default mode: against transformers


def torch_worker(shape: str, path: str, batch: int, new_tokens: int) -> None:
    """Build the random HF model, save it to ``path`` for the JAX side, time greedy ``generate``."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = models.config_to_hf(_config(shape))
    config = transformers.Qwen3Config(**hf, eos_token_id=None, bos_token_id=None)
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


def decode_throughput(shape: str, batch: int, new_tokens: int) -> dict:
    """Tokens/s of ours and of transformers on the same weights; also how many greedy tokens agree."""
    with tempfile.TemporaryDirectory() as path:
        hf = _worker("torch_worker", shape, path, batch, new_tokens)
        config, params = load_pretrained(path)
    engine_config = EngineConfig(num_slots=batch, max_len=page_rounded(PROMPT_LEN + new_tokens),
                                 decode_chunk=32, eos_token_ids=())
    EngineCore(params, config, engine_config).warmup()
    prompts = _prompts(batch, config.vocab_size)
    start = time.perf_counter()
    results = generate(params, config, prompts, max_new_tokens=new_tokens, engine_config=engine_config)
    elapsed = time.perf_counter() - start
    ours = np.array([r.tokens for r in results])
    # Greedy decoding of random weights amplifies float rounding: compare up to each row's first divergence.
    same = np.append(ours == np.array(hf["tokens"]), np.zeros((batch, 1), bool), axis=1)
    agree = np.mean(np.argmin(same, axis=1) / new_tokens)
    return dict(ours_tok_s=batch * new_tokens / elapsed, hf_tok_s=batch * new_tokens / hf["seconds"],
                agree=float(agree), config=config, params_tree=params)


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
    """Seconds per decode step of one sequence (the best full chunk after warm-up)."""
    run = _DecodeRun(params, config, slots=1, prompt_len=PROMPT_LEN,
                     max_len=page_rounded(PROMPT_LEN + 2 * steps), chunk=chunk, chunks=steps // chunk)
    decode_steps([run], rounds=steps // chunk - 1)
    return run.wall_step_s


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
    config = _config("tiny")
    params = init_params(config, jax.random.key(0))
    plan = _multiturn_plan(num_rollouts, turns, config.vocab_size)
    prompts = _prompts(num_rollouts, config.vocab_size, seed=1)
    max_tokens = SEGMENT_RANGE[1] * (turns + 1) + TOOL_TOKENS[1] * turns
    engine_config = EngineConfig(num_slots=num_rollouts, max_len=page_rounded(PROMPT_LEN + max_tokens),
                                 decode_chunk=8, eos_token_ids=())
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
            appended = item["tools"][turn - 1] if turn else []
            record.add(appended, None)
            core.start(record, max_new_tokens=item["segments"][turn], appended=appended)
        _drain(core)  # the whole batch waits for its longest segment
        if turn < turns:
            time.sleep(max(item["latencies"][turn] for item in plan))  # ... and for the slowest tool
    static_s = time.perf_counter() - start
    same = all(r.response_ids == e for r, e in zip(records, engine_responses, strict=True))
    return dict(engine_s=engine_s, static_s=static_s, same_tokens=same)


# ---- --scale: the paged KV cache


def _model(shape: str, dtype: str = "float32"):
    """Random weights of ``shape``, already in the layout the engine decodes from (so each engine built on
    them uses them as they are: one copy in memory)."""
    config = _config(shape, dtype)
    params = init_params(config, jax.random.key(0))
    return config, engine_params(params, config, unstacked=True)  # unrolled layers slice nothing per step


class _DecodeRun:
    """``slots`` sequences that hold ``prompt_len`` tokens, decoding greedily in chunks of ``chunk`` steps on
    an engine whose pool holds just them, whatever ``max_len``."""

    def __init__(self, params, config, *, slots: int, prompt_len: int, max_len: int, chunk: int = 8,
                 chunks: int = 7, **precision):
        steps = chunk * (chunks + 2)  # more than run, so no sequence finishes (and frees its pages)
        self.chunk = chunk
        engine_config = EngineConfig(
            num_slots=slots, max_len=max_len, decode_chunk=chunk, eos_token_ids=(), page_size=16,
            num_pages=slots * page_rounded(prompt_len + steps, 16) // 16 + 1, return_on_stop=False,
            prefix_sharing=False, **precision)
        self.core = EngineCore(params, config, engine_config)
        rng = np.random.default_rng(0)
        greedy = SamplingParams(temperature=0.0)
        groups = self.core.admit([(rng.integers(0, config.vocab_size, prompt_len).tolist(), 1, greedy, steps,
                                   (i,)) for i in range(slots)])
        self.records = [record for (record,) in groups]
        _drain(self.core)  # every prompt prefilled (and, once per shape, compiled) before any decodes
        for record in self.records:
            self.core.start(record)
        while not all(record.response_ids for record in self.records):  # all decoding, in step
            for record, chunk in self.core.step():
                record.receive(chunk)
        self.wall_times = []

    def time_chunk(self) -> None:
        """One step of ``chunk`` tokens per sequence, from dispatch to its outputs read (nothing else queued
        on the device: the runs take turns)."""
        start = time.perf_counter()
        for record, chunk in self.core.step() + self.core.flush():
            record.receive(chunk)
        self.wall_times.append(time.perf_counter() - start)

    @property
    def wall_step_s(self) -> float:
        """Wall seconds per decode step: the best timed chunk over its steps."""
        return min(self.wall_times) / self.chunk

    def kv(self) -> dict:
        """KV bytes the pool holds now, and the bytes of the tokens held."""
        held_tokens = sum(r.length for r in self.records)
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
                                 eos_token_ids=(), page_size=16)
    core = EngineCore(params, config, engine_config)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len).tolist()
    (group,) = core.admit([(prompt, samples, SamplingParams(temperature=1.0), 2 * new_tokens, (0,))])
    for record in group:
        core.start(record, max_new_tokens=new_tokens)  # they pause (holding their pages) after new_tokens
    _drain(core)
    assert all(len(r.response_ids) == new_tokens for r in group)
    per_token = core.state.pages.nbytes_per_page / engine_config.page_size
    return dict(kv_bytes=core.kv_bytes_held, token_bytes=(prompt_len + samples * new_tokens) * per_token)


def generate_tokens_per_s(params, config, *, batches: Sequence[int], new_tokens: int, chunks: Sequence[int],
                          repeats: int = 3) -> dict:
    """Tokens/s of ``generate`` (16-token prompts, greedy, wall time) per (batch, decode chunk): the best of
    ``repeats`` calls, the settings taking turns (so load changes on a shared machine hit them alike), after
    a warm-up call of each."""
    settings = [(batch, chunk) for batch in batches for chunk in chunks]
    best = dict.fromkeys(settings, 0.0)
    for repeat in range(repeats + 1):
        for batch, chunk in settings:
            engine_config = EngineConfig(num_slots=batch, max_len=page_rounded(PROMPT_LEN + new_tokens),
                                         decode_chunk=chunk, eos_token_ids=())
            prompts = _prompts(batch, config.vocab_size)
            start = time.perf_counter()
            generate(params, config, prompts, max_new_tokens=new_tokens, engine_config=engine_config)
            if repeat:  # the first round compiles
                rate = batch * new_tokens / (time.perf_counter() - start)
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


def kv_bytes_per_page(config: models.ModelConfig, page_size: int = 16) -> int:
    itemsize = np.dtype(config.compute_dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * page_size * itemsize


def big_rollout(params, config, *, prompts: int = 64, prompt_len: int = 2048, samples: int = 16,
                new_tokens: int = 64, kv_gib: float = 40.0) -> dict:
    """``prompts`` prompts of ``prompt_len`` tokens x ``samples`` samples of ``new_tokens`` tokens at once, on
    a pool of ``kv_gib`` GiB (a dense cache would need every sequence's ``max_len`` tokens)."""
    per_page = kv_bytes_per_page(config)
    engine_config = EngineConfig(num_slots=prompts * samples, max_len=page_rounded(prompt_len + new_tokens),
                                 decode_chunk=16, eos_token_ids=(), num_pages=int(kv_gib * 2**30 // per_page))
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
    dense = prompts * samples * engine_config.max_len * per_page / 16
    return dict(seconds=time.perf_counter() - start, peak_kv=peak, dense_kv=dense)


def scale(args, report) -> None:
    """The ``--scale`` measurements (see the module docstring)."""
    gpu = args.gpu
    dtype = "bfloat16" if gpu else "float32"
    ratio_shape = "1.7b" if gpu else "tiny"
    config, params = _model(ratio_shape, dtype)
    short = _DecodeRun(params, config, slots=64, prompt_len=640, max_len=640 + 80)  # the 72 tokens it decodes
    long = _DecodeRun(params, config, slots=64, prompt_len=640, max_len=8192)
    decode_steps([short, long])
    report("long_cache_step_ratio", f"step ms, {ratio_shape}, 64 x 640 tok, max_len 8192 vs 720",
           long.wall_step_s * 1e3, short.wall_step_s * 1e3, long.wall_step_s / short.wall_step_s, "<= 1.3",
           "")
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


# ---- --precision: FP8 weights and KV pages

TINY_HELD_OUT = ("What is 5 times 8?", "What is 6 plus 7?", "Say goodbye.", "What is the weather in Rome?",
                 "What is 9 times 9?")


def _tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def precision_bytes(shape: models.ModelConfig) -> dict:
    """KV page bytes and engine weight bytes of ``shape``, bfloat16 and FP8, from abstract shapes."""
    page = {}
    for kv in (None, "fp8"):
        engine_config = EngineConfig(num_slots=1, max_len=16, num_pages=2, kv_dtype=kv)
        page[kv] = jax.eval_shape(lambda c=engine_config: init_state(shape, c)).pages.nbytes_per_page
    abstract = jax.eval_shape(lambda: init_params(shape, jax.random.key(0)))
    weights = {}
    for kind in (None, "fp8"):
        prepare = lambda p, kind=kind: engine_params(p, shape, False, weight_dtype=kind,
                                                     fp8_matmul="reference")
        weights[kind] = _tree_bytes(jax.eval_shape(prepare, abstract))
    return dict(page=page, weights=weights)


def _held_out_prompts(args, policy) -> tuple[list[list[int]], str]:
    """Prompt ids of the held-out problems (``--problems``, else the tiny policy's), and where from."""
    from rstar2jax.data.conversation import render_prompt_ids
    from rstar2jax.data.problems import load_problems

    if args.problems:
        problems = [p.problem for p in load_problems(args.problems).problems][: args.precision_prompts]
        source = args.problems
    else:
        from experiments.tiny_policy import ARITHMETIC, HELLO, WEATHER

        problems = [HELLO, WEATHER, ARITHMETIC, *TINY_HELD_OUT]
        source = "the tiny taught policy: its 3 questions and 5 others"
    return [render_prompt_ids(policy.tokenizer, p, policy.prompt) for p in problems], source


def logprob_mismatch(args) -> dict:
    """Mean |delta log p| of each engine precision's sampled tokens against the trainer (module docstring)."""
    from rstar2jax import algo
    from rstar2jax.serve import load_policy

    with tempfile.TemporaryDirectory() as tmp:
        if args.policy_dir:
            policy_dir = args.policy_dir
        else:
            from experiments.tiny_policy import build_tiny_policy

            policy_dir = build_tiny_policy(pathlib.Path(tmp) / "tiny-policy")
        policy = load_policy(policy_dir)
    config = dataclasses.replace(policy.model_config, compute_dtype="bfloat16")  # the trainer's compute
    prompts, source = _held_out_prompts(args, policy)
    new, samples = args.precision_tokens, args.precision_samples
    repeated = [p for p in prompts for _ in range(samples)]
    width = page_rounded(max(map(len, prompts)) + new)
    base = EngineConfig(num_slots=min(64, samples * len(prompts)), max_len=width, decode_chunk=16,
                        weight_block=args.weight_block)
    block = base.weight_block
    variants = {"bf16": {}, "fp8": dict(weight_dtype="fp8", kv_dtype="fp8"),
                "fp8_weights": dict(weight_dtype="fp8"), "fp8_kv": dict(kv_dtype="fp8")}
    logprobs = jax.jit(lambda p, tokens, targets: models.sequence_logprobs(p, config, tokens, targets)[0])
    out = {"source": source, "prompts": len(prompts), "samples": samples, "block": block}
    for name, fields in variants.items():
        engine_config = dataclasses.replace(base, **fields)
        results = generate(policy.params, config, repeated, max_new_tokens=new, temperature=1.0, seed=0,
                           engine_config=engine_config)
        tokens = np.zeros((len(results), width), np.int32)
        rollout, mask = np.zeros((len(results), width - 1), np.float32), np.zeros((len(results), width - 1))
        for row, (prompt, result) in enumerate(zip(repeated, results, strict=True)):
            sequence = prompt + result.tokens
            tokens[row, : len(sequence)] = sequence
            start, end = len(prompt) - 1, len(sequence) - 1
            rollout[row, start:end], mask[row, start:end] = result.logprobs, 1
        train = logprobs(policy.params, tokens[:, :-1], tokens[:, 1:])
        metrics = algo.rollout_mismatch(train, rollout, mask)
        out[name] = {k: float(v) for k, v in metrics.items()}
        print(f"{name}: {out[name]}", flush=True)
    return out


def precision(args, report) -> None:
    """The ``--precision`` measurements (see the module docstring)."""
    shape = dataclasses.replace(SHAPES["1.7b"], param_dtype="bfloat16", compute_dtype="bfloat16")
    sizes = precision_bytes(shape)
    gib = 2**30
    tokens = {kv: gib // sizes["page"][kv] * 16 for kv in (None, "fp8")}
    report("kv_tokens_per_gib_ratio_fp8", "KV tokens per GiB of pool, 1.7B shape", tokens["fp8"],
           tokens[None], tokens["fp8"] / tokens[None], ">= 1.9",
           f"page {sizes['page']['fp8']} vs {sizes['page'][None]} bytes")
    weights = sizes["weights"]
    report("weight_bytes_ratio_fp8", "engine weights GiB, 1.7B shape", weights["fp8"] / gib,
           weights[None] / gib, weights["fp8"] / weights[None], "<= 0.6",
           "embedding (tied head) stays bfloat16")
    mismatch = logprob_mismatch(args)
    low, high = mismatch["fp8"]["mismatch_abs_log_ratio"], mismatch["bf16"]["mismatch_abs_log_ratio"]
    report("logprob_mismatch_fp8", "mean |delta log p| vs trainer, FP8 vs bf16 engine", low, high,
           low, "report", f"{mismatch['prompts']} prompts x {mismatch['samples']}: {mismatch['source']}")
    report.figures["logprob_mismatch_bf16"] = high
    for half in ("fp8_weights", "fp8_kv"):
        report.figures[f"logprob_mismatch_{half}"] = mismatch[half]["mismatch_abs_log_ratio"]
    for name in ("fp8", "bf16"):
        report.figures[f"k3_kl_{name}"] = mismatch[name]["mismatch_k3_kl"]
        report.figures[f"outside_band_{name}"] = mismatch[name]["mismatch_outside_band"]
    if args.gpu:
        rates = fp8_decode_rates(args.precision_shape)
        report("fp8_decode_speedup", f"decode tok/s, {args.precision_shape}, 64 slots x 512 tok, FP8 vs bf16",
               rates["fp8"], rates["bf16"], rates["fp8"] / rates["bf16"], ">= 1.2",
               f"FP8 weights alone {rates['fp8_weights']:.0f}, FP8 KV alone {rates['fp8_kv']:.0f} tok/s")


def fp8_decode_rates(shape: str, slots: int = 64, prompt_len: int = 512) -> dict:
    """Decode tokens/s of ``slots`` sequences holding ``prompt_len`` tokens, bfloat16 engine and FP8 ones
    (weights and KV, each alone), timed in turns on the same random weights."""
    config = _config(shape, "bfloat16")
    params = init_params(config, jax.random.key(0))
    weights = dict(weight_dtype="fp8", weight_block=64 if shape == "tiny" else 128)
    kinds = {"bf16": {}, "fp8": dict(weights, kv_dtype="fp8"), "fp8_weights": weights,
             "fp8_kv": dict(kv_dtype="fp8")}
    runs = {name: _DecodeRun(params, config, slots=slots, prompt_len=prompt_len, max_len=prompt_len + 128,
                             **fields) for name, fields in kinds.items()}
    decode_steps(list(runs.values()))
    return {name: slots / run.wall_step_s for name, run in runs.items()}


# ---- --startup: ready in seconds


def programs_worker() -> None:
    """Count the programs a 64-slot engine compiles, from its construction through a mixed workload."""
    from jax._src import monitoring

    config = dataclasses.replace(models.preset("tiny"), eos_token_ids=())
    params = init_params(config, jax.random.key(0))
    jax.block_until_ready(params)
    compiled = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.append(kw.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    rng = np.random.default_rng(0)
    system = rng.integers(0, config.vocab_size, 300).tolist()
    plans = []
    for i, length in enumerate(np.geomspace(20, 3000, 24).astype(int)):
        prompt = (system if i % 3 == 0 else []) + rng.integers(0, config.vocab_size, length).tolist()
        plans.append((prompt[:3000], 4 if i % 4 == 0 else 1, [int(t) for t in rng.integers(1, 40, 2)]))

    async def rollout(session, turns):
        for turn, length in enumerate(turns):
            await session.generate(stop=[[7, 7]], max_new_tokens=length)
            session.append(rng.integers(0, config.vocab_size, 3 + 20 * turn).tolist())
        await session.generate(max_new_tokens=16)
        session.close()

    async def group(engine, prompt, n, turns):
        sessions = await engine.open(prompt, n, sampling=SamplingParams(temperature=1.0), max_tokens=256)
        await asyncio.gather(*(rollout(s, turns) for s in sessions))

    async def run():
        engine = Engine(params, config, EngineConfig(num_slots=64, max_len=4096))
        async with engine:
            await asyncio.gather(*(group(engine, *plan) for plan in plans))
        return engine.core

    start = time.perf_counter()
    core = asyncio.run(run())
    print(json.dumps({"programs_compiled": len(compiled), "programs": compiled, "steps": core.stats["steps"],
                      "seconds": time.perf_counter() - start}))


def _random_policy_folder(path: pathlib.Path) -> None:
    """Random Qwen3-0.6B weights (float32) with the bundled Qwen3 tokenizer, as an HF folder."""
    from transformers import AutoTokenizer

    config = models.preset("qwen3-0.6b")
    params = init_params(config, jax.random.key(0))
    models.save_pretrained(params, config, path, tokenizer=AutoTokenizer.from_pretrained(
        models.QWEN3_TOKENIZER_DIR))


def serve_until_healthy(model_dir: pathlib.Path, cache_dir: pathlib.Path, port: int,
                        timeout: float = 1800.0) -> float:
    """Seconds from starting ``experiments.serve`` (64 slots, max_len 8192, a 4 GiB KV pool) to ``/health``
    answering 200, with JAX's persistent compilation cache in ``cache_dir``; prints the server's own
    ``start-up`` line (where its seconds went)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "experiments.serve", f"--model={model_dir}", "--num_slots=64",
               "--max_len=8192", "--kv_pool_gib=4", f"--port={port}"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        server = subprocess.Popen(command, env=env, cwd=pathlib.Path(__file__).parents[1], stdout=out,
                                  stderr=subprocess.PIPE, text=True)
        def startup_line() -> str | None:
            out.seek(0)
            return next((line.strip() for line in out if line.startswith("start-up")), None)

        try:
            while time.perf_counter() - start < timeout:
                if server.poll() is not None:
                    raise RuntimeError(f"experiments.serve exited with {server.returncode}: "
                                       f"{server.stderr.read()}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                        if response.status == 200:
                            healthy = time.perf_counter() - start
                            break
                except OSError:
                    pass
                time.sleep(0.2)
            else:
                raise TimeoutError(f"experiments.serve was not healthy after {timeout:.0f} s")
            for _ in range(50):  # it prints the line as it starts answering
                if startup_line() is not None:
                    break
                time.sleep(0.1)
        finally:
            server.terminate()
            server.wait(60)
        print(f"  server: {startup_line()}", flush=True)
    return healthy


def _tunix_prompt_strings(tokenizer, batch: int) -> list[str]:
    """Texts that tokenize to exactly ``TUNIX_PROMPT`` tokens (and back)."""
    rng = np.random.default_rng(0)
    texts = []
    while len(texts) < batch:
        text = tokenizer.decode(rng.integers(1000, 100_000, TUNIX_PROMPT).tolist())
        if len(tokenizer.encode(text)) == TUNIX_PROMPT:
            texts.append(text)
    return texts


def tunix_worker(batch: int) -> None:
    """google-tunix's Sampler on the comparison shape: first and second call of 128 greedy tokens."""
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import model as qwen3

    shape = SHAPES["tunix"]
    tokenizer = AutoTokenizer.from_pretrained(models.QWEN3_TOKENIZER_DIR)
    config = qwen3.ModelConfig(num_layers=shape.num_layers, vocab_size=shape.vocab_size,
                               embed_dim=shape.hidden_size, hidden_dim=shape.intermediate_size,
                               num_heads=shape.num_heads, head_dim=shape.head_dim,
                               num_kv_heads=shape.num_kv_heads, rope_theta=int(shape.rope_theta),
                               norm_eps=shape.rms_norm_eps, use_tied_embedding=shape.tie_word_embeddings)
    model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
    cache = sampler_lib.CacheConfig(cache_size=TUNIX_PROMPT + TUNIX_NEW + 32, num_layers=shape.num_layers,
                                    num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    sampler = sampler_lib.Sampler(model, tokenizer, cache)
    prompts = _tunix_prompt_strings(tokenizer, batch)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        out = sampler(prompts, max_generation_steps=TUNIX_NEW, max_prompt_length=TUNIX_PROMPT,
                      temperature=0.0, eos_tokens=[-1])
        times.append(time.perf_counter() - start)
    print(json.dumps({"first_s": times[0], "second_s": times[1], "tokens": len(out.tokens[0])}))


def ours_worker(batch: int) -> None:
    """:func:`generate` on the comparison shape, as :func:`tunix_worker` does it."""
    from transformers import AutoTokenizer

    config = _config("tunix")
    params = init_params(config, jax.random.key(0))
    jax.block_until_ready(params)
    tokenizer = AutoTokenizer.from_pretrained(models.QWEN3_TOKENIZER_DIR)
    prompts = [tokenizer.encode(text) for text in _tunix_prompt_strings(tokenizer, batch)]
    engine_config = EngineConfig(num_slots=batch, max_len=page_rounded(TUNIX_PROMPT + TUNIX_NEW),
                                 eos_token_ids=())
    times = []
    for _ in range(2):
        start = time.perf_counter()
        out = generate(params, config, prompts, max_new_tokens=TUNIX_NEW, engine_config=engine_config)
        times.append(time.perf_counter() - start)
    print(json.dumps({"first_s": times[0], "second_s": times[1], "tokens": len(out[0].tokens)}))


def floor_worker() -> None:
    """The batch-1 decode step of the comparison shape, the bytes it must read (head and layers) and this
    process's copy bandwidth."""
    config = _config("tunix")
    params = init_params(config, jax.random.key(0))
    jax.block_until_ready(params)
    run = _DecodeRun(params, config, slots=1, prompt_len=TUNIX_PROMPT,
                     max_len=page_rounded(TUNIX_PROMPT + 160), chunk=16, chunks=6)
    decode_steps([run], rounds=5)
    embedding_only = 0 if config.tie_word_embeddings else params["embed"].nbytes  # read one row per token
    read = sum(leaf.nbytes for leaf in jax.tree.leaves(params)) - embedding_only
    print(json.dumps({"step_s": run.wall_step_s, "read_bytes": read, "bandwidth": copy_bandwidth()}))


def startup(args, report) -> None:
    """The ``--startup`` measurements (see the module docstring)."""
    programs = _worker("startup_worker", "programs")
    report("programs_compiled", "programs compiled, 64 slots, mixed workload", programs["programs_compiled"],
           8, programs["programs_compiled"], "<= 8", f"{programs['steps']} steps")
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = pathlib.Path(tmp) / "qwen3-0.6b-random", pathlib.Path(tmp) / "jax-cache"
        _random_policy_folder(folder)
        cold = serve_until_healthy(folder, cache, args.port)
        report("warmup_s_qwen3_0p6b", "experiments.serve to healthy, 0.6B, empty cache (s)", cold, 180,
               cold, "<= 180", "64 slots, max_len 8192, 4 GiB KV pool")
        warm = serve_until_healthy(folder, cache, args.port)
        cache_files = [f for f in cache.rglob("*") if f.is_file()]
        cache_mib = sum(f.stat().st_size for f in cache_files) / 2**20
        report("warmup_s_qwen3_0p6b_cached", "the same with the first start's cache (s)", warm, 10, warm,
               "<= 10", f"{len(cache_files)} files, {cache_mib:.1f} MiB cache")
        shutil.rmtree(folder)
    floors = [_worker("startup_worker", "floor") for _ in range(args.repeats)]
    best = min(floors, key=lambda f: f["step_s"] * f["bandwidth"] / f["read_bytes"])
    floor_s = best["read_bytes"] / best["bandwidth"]
    report("decode_step_over_floor_b1", "batch-1 decode step, 2 layers, 152k vocab (ms)",
           best["step_s"] * 1e3, floor_s * 1e3, best["step_s"] / floor_s, "<= 1.2",
           f"{best['read_bytes'] / 2**20:.0f} MiB at {best['bandwidth'] / 1e9:.1f} GB/s copy")
    if not args.tunix_path:
        print("tunix comparison left out: pass --tunix_path (see the module docstring)", flush=True)
        return
    tunix_env = {"PYTHONPATH": os.pathsep.join([args.tunix_path, os.environ.get("PYTHONPATH", "")])}
    compile_s = {}
    for batch in (1, 16):
        runs = {"ours": [], "tunix": []}
        for _ in range(args.repeats):  # taking turns, so load changes on a shared machine hit both alike
            runs["ours"].append(_worker("startup_worker", "ours", batch))
            runs["tunix"].append(_worker("startup_worker", "tunix", batch, env=tunix_env))
        rate = {side: batch * TUNIX_NEW / min(r["second_s"] for r in rs) for side, rs in runs.items()}
        report(f"tunix_decode_ratio_b{batch}", f"decode tok/s vs tunix, batch {batch}, 2 layers, 152k vocab",
               rate["ours"], rate["tunix"], rate["ours"] / rate["tunix"], ">= 1.1",
               f"best second call of {args.repeats}")
        compile_s[batch] = {side: min(r["first_s"] - r["second_s"] for r in rs) for side, rs in runs.items()}
    ours_compile, theirs_compile = compile_s[1]["ours"], compile_s[1]["tunix"]
    report("tunix_compile_ratio", "first call's extra seconds vs tunix, batch 1", ours_compile,
           theirs_compile, ours_compile / theirs_compile, "<= 1.5", "first call - second call")


_BATCH = flags.DEFINE_integer("batch", 32, "sequences decoded at once")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "new tokens per sequence (small)")
_NEW_TOKENS_06B = flags.DEFINE_integer("new_tokens_06b", 256, "new tokens per sequence (0.6B)")
_SKIP_06B = flags.DEFINE_bool("skip_06b", False, "leave out the two 0.6B measurements")
_SCALE = flags.DEFINE_bool("scale", False, "measure the paged KV cache (issue 21)")
_GPU = flags.DEFINE_bool("gpu", False, "with --scale: bfloat16, 1.7B ratios, GPU table; with --precision: "
                          "FP8 decode speed (fp8_decode_speedup)")
_GPU_MODELS = flags.DEFINE_list("gpu_models", ["0.6b", "1.7b"], "with --gpu: model shapes")
_GPU_BATCHES = flags.DEFINE_list("gpu_batches", ["1", "64", "256"], "with --gpu: batch sizes")
_BIG_ROLLOUT = flags.DEFINE_bool(
    "big_rollout", False, "with --scale --gpu: 64 prompts x 2048 tokens x 16 samples on one GPU"
)
_STARTUP = flags.DEFINE_bool("startup", False, "measure compilation and start-up (issue 31)")
_PRECISION = flags.DEFINE_bool("precision", False, "measure the FP8 engine (issue 41)")
_EXACT = flags.DEFINE_bool("exact", False, "measure exact numerics (issue 52, experiments.bench_exact)")
_POLICY_DIR = flags.DEFINE_string("policy_dir", None, "with --precision: a policy folder (default: tiny)")
_PROBLEMS = flags.DEFINE_string("problems", None, "with --precision --policy_dir: held-out problems (JSONL)")
_PRECISION_PROMPTS = flags.DEFINE_integer("precision_prompts", 32, "with --problems: problems used")
_PRECISION_SAMPLES = flags.DEFINE_integer("precision_samples", 4, "with --precision: samples per prompt")
_PRECISION_TOKENS = flags.DEFINE_integer("precision_tokens", 64, "with --precision: new tokens per sample")
_WEIGHT_BLOCK = flags.DEFINE_integer("weight_block", 32, "with --precision: the policy's FP8 weight block")
_PRECISION_SHAPE = flags.DEFINE_string("precision_shape", "1.7b", "with --precision --gpu: the decode shape")
_TUNIX_PATH = flags.DEFINE_string("tunix_path", None, "with --startup: a folder holding google-tunix 0.1.7")
_PORT = flags.DEFINE_integer("port", 8765, "with --startup: the port experiments.serve listens on")
_REPEATS = flags.DEFINE_integer("repeats", 3, "with --startup: fresh processes per side of the tunix runs")
_TORCH_WORKER = flags.DEFINE_list("torch_worker", None, "internal: SHAPE,PATH,BATCH,NEW of one PyTorch run")
_STARTUP_WORKER = flags.DEFINE_list("startup_worker", None,
                                     "internal: programs | floor | ours,BATCH | tunix,BATCH")


def rounded(value: float) -> float:
    """A figure for the JSON line: 3 decimals, or 3 significant digits below 0.1 (a log-prob mismatch of
    0.0012 is not 0.001, nor one of 0.00016 zero)."""
    return round(value, 3) if abs(value) >= 0.1 else float(f"{value:.3g}")


def shown(value: float) -> str:
    """A figure for the table: 2 decimals, or 2 significant digits below 0.1."""
    return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.2g}"


def main(argv) -> None:
    del argv
    args = flags.FLAGS  # the flags by name (scale() and startup() read them)
    if _TORCH_WORKER.value:
        shape, path, batch, new = _TORCH_WORKER.value
        torch_worker(shape, path, int(batch), int(new))
        return
    if _STARTUP_WORKER.value:
        kind, *rest = _STARTUP_WORKER.value
        workers = dict(programs=programs_worker, floor=floor_worker, ours=ours_worker, tunix=tunix_worker)
        workers[kind](*map(int, rest))
        return

    rows, figures = [], {}
    bench_start = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (shared machine: timings are noisy)", flush=True)

    def report(key, name, ours, base, ratio, goal, note):
        """Record one measurement and print it at once (the whole run takes minutes)."""
        figures[key] = ratio
        rows.append(f"{name:<52}{shown(ours):>12}{shown(base):>12}{shown(ratio):>9}  {goal:<9}{note}")
        print(rows[-1], flush=True)

    def finish(note: str) -> None:
        print(f"\n{'measurement':<52}{'ours':>12}{'baseline':>12}{'ratio':>9}  {'goal':<9}note")
        print("\n".join(rows))
        print(note)
        print(f"whole benchmark: {time.perf_counter() - bench_start:.0f} s on "
              f"{jax.devices()[0].device_kind}; load average at end: {os.getloadavg()[0]:.2f}")
        print(json.dumps({k: rounded(v) if isinstance(v, float) else v for k, v in figures.items()}))

    report.figures = figures
    if args.exact:
        from experiments.bench_exact import exact  # only this mode needs it

        exact(args, report, generate_tokens_per_s)
        finish("(baselines: the default numerics, same shapes, same run)")
        return
    if args.precision:
        precision(args, report)
        finish("(baselines: the bfloat16 pool / engine weights / engine)")
        return
    if args.startup:
        startup(args, report)
        finish("(baselines: the goals; google-tunix 0.1.7's Sampler in a fresh process of its own)")
        return
    if args.scale:
        scale(args, report)
        finish("(wall times; the machine is shared)")
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
    finish("(baselines: transformers generate on PyTorch CPU; memory-bandwidth floor; turn-synchronous "
           "batch)")


if __name__ == "__main__":
    bench_record.run(main)
