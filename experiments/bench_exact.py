"""Exact numerics (issue 52), run by ``python -m experiments.bench_engine --exact``.

- ``exact_mismatch_max_fp32`` / ``_bf16``: max |engine log-prob - trainer log-prob| over the sampled tokens of
  8 prompts x 32 tokens (temperature 1) of the tiny shape with random weights, the trainer's log-probs from
  ``models.sequence_logprobs`` over the sequences packed two to a row (as the RL step computes them), with
  ``numerics="exact"``. Goal 0.0. The default mode's figure is printed beside it.
- ``exact_decode_ratio``: exact / default ``generate`` tokens/s at batch 1 and at batch 16 (both printed);
  the key is the smaller of the two. Goal >= 0.9.
- ``exact_train_ratio``: exact / default ``rl_step`` tokens/s (4 rows of 128 tokens). Goal >= 0.9.

Both speed ratios time the two numerics taking turns (decode: whole ``generate`` calls; training: single
steps), so that the load of a shared machine changes both sides alike.

Each measurement takes the model shape (``shape``, default :data:`SHAPE`) and its dtypes as arguments:
``experiments.accelerator_check``'s ``exact`` stage runs the same ones on the Qwen3-1.7B shape in bfloat16.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax import models, train
from rstar2jax.engine import EngineConfig, generate

SHAPE = models.preset("tiny", vocab_size=4096, hidden_size=128, intermediate_size=384, num_heads=2,
                      num_kv_heads=1, head_dim=64)


def _config(dtype: str, numerics: str, shape: models.ModelConfig) -> models.ModelConfig:
    return dataclasses.replace(shape, compute_dtype=dtype, numerics=numerics, eos_token_ids=())


def logprob_mismatch(dtype: str, numerics: str, *, prompts: int = 8, new_tokens: int = 32,
                     shape: models.ModelConfig = SHAPE) -> float:
    """Max |engine - trainer| log-prob over the sampled tokens (module docstring)."""
    config = _config(dtype, numerics, shape)
    params = models.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, config.vocab_size, int(n)).tolist() for n in rng.integers(4, 48, prompts)]
    engine = EngineConfig(num_slots=4, max_len=128, decode_chunk=8, token_buckets=(4, 64), eos_token_ids=())
    gens = generate(params, config, batch, max_new_tokens=new_tokens, temperature=1.0, engine_config=engine)
    width = 2 * (48 + new_tokens)
    tokens, targets, positions, segments = (np.zeros((prompts // 2, width), np.int32) for _ in range(4))
    spans = []
    for i, (prompt, gen) in enumerate(zip(batch, gens, strict=True)):
        seq, row = prompt + gen.tokens, i // 2
        start, n = (width // 2) * (i % 2), len(seq) - 1
        tokens[row, start:start + n], targets[row, start:start + n] = seq[:-1], seq[1:]
        positions[row, start:start + n], segments[row, start:start + n] = np.arange(n), i + 1
        spans.append((row, start + len(prompt) - 1, np.asarray(gen.logprobs, np.float32)))
    logp, _ = models.sequence_logprobs(params, config, jnp.asarray(tokens), jnp.asarray(targets),
                                      positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments))
    logp = np.asarray(logp)
    return max(float(np.max(np.abs(logp[row, at:at + len(lp)] - lp))) for row, at, lp in spans)


def decode_rates(generate_tokens_per_s, numerics: str, batches=(1, 16), new_tokens: int = 64,
                 repeats: int = 2, *, dtype: str = "float32", shape: models.ModelConfig = SHAPE) -> dict:
    """``generate`` tokens/s per batch by ``bench_engine.generate_tokens_per_s`` (greedy, 16-token prompts;
    the best of ``repeats`` after a warm-up)."""
    config = _config(dtype, numerics, shape)
    params = models.init_params(config, jax.random.key(0))
    rates = generate_tokens_per_s(params, config, batches=batches, new_tokens=new_tokens, chunks=(16,),
                                  repeats=repeats)
    return {batch: rates[batch, 16] for batch in batches}


def decode_ratios(generate_tokens_per_s, repeats: int = 2, **options) -> dict:
    """Exact and default ``decode_rates`` (``options``: its other keyword arguments) taking turns
    ``repeats`` times, so that a load change on a shared machine hits both alike; the best of each per batch
    and their ratio: ``{"exact": {batch: tok/s}, "default": {...}, "ratio": {...}}``."""
    best = {"default": {}, "exact": {}}
    for _ in range(repeats):
        for numerics, rates in best.items():
            for batch, rate in decode_rates(generate_tokens_per_s, numerics, repeats=1, **options).items():
                rates[batch] = max(rates.get(batch, 0.0), rate)
    default, exact_ = best["default"], best["exact"]
    return {"exact": exact_, "default": default, "ratio": {batch: exact_[batch] / default[batch]
                                                           for batch in default}}


def _rl_step_timer(numerics: str, rows: int, seq_len: int, dtype: str, shape: models.ModelConfig):
    """A function that runs one compiled ``rl_step`` (compute in ``dtype``; rows x seq_len tokens, a
    32-token prompt then trained tokens) on its own train state and returns its wall seconds."""
    config = _config(dtype, numerics, shape)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (rows, seq_len + 1)).astype(np.int32)
    mask = np.zeros((rows, seq_len), np.float32)
    mask[:, 31:] = 1.0
    data = train.Batch(
        tokens=tokens[:, :-1], targets=tokens[:, 1:],
        positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)),
        segment_ids=np.ones((rows, seq_len), np.int32), loss_mask=mask,
        advantages=np.repeat(rng.normal(size=(rows, 1)), seq_len, axis=1).astype(np.float32),
        sampler_logp=(-rng.random((rows, seq_len)) * 10).astype(np.float32))
    optimizer = train.make_optimizer()
    state = train.init_train_state(models.init_params(config, jax.random.key(0)), optimizer, 0)
    step = train.make_rl_step(config, optimizer).lower(state, data).compile()

    def timed() -> float:
        nonlocal state
        start = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    return timed


def train_rates(rows: int = 4, seq_len: int = 128, steps: int = 3, *, dtype: str = "float32",
                shape: models.ModelConfig = SHAPE) -> dict:
    """``rl_step`` tokens/s of the default and the exact numerics, ``{numerics: tok/s}``: the median of
    ``steps`` steps each after a warm-up step, the two taking turns step by step (a load change on a shared
    machine hits both alike)."""
    timers = {numerics: _rl_step_timer(numerics, rows, seq_len, dtype, shape)
              for numerics in ("default", "exact")}
    times = {numerics: [] for numerics in timers}
    for _ in range(steps + 1):
        for numerics, timed in timers.items():
            times[numerics].append(timed())
    return {numerics: rows * seq_len / float(np.median(seconds[1:])) for numerics, seconds in times.items()}


def exact(args, report, generate_tokens_per_s) -> None:
    """The four figures of the module docstring, through ``report``; ``generate_tokens_per_s``: bench_engine's
    (passed in: that module runs as ``__main__``)."""
    del args
    for dtype, key in (("float32", "exact_mismatch_max_fp32"), ("bfloat16", "exact_mismatch_max_bf16")):
        ours, base = logprob_mismatch(dtype, "exact"), logprob_mismatch(dtype, "default")
        report(key, f"max |engine - trainer| log-prob, {dtype}", ours, base, ours, "0.0",
               "baseline: the default numerics")
    rates = decode_ratios(generate_tokens_per_s)
    default, ours, ratios = rates["default"], rates["exact"], rates["ratio"]
    for batch, ratio in ratios.items():
        print(f"  decode tok/s at batch {batch}: exact {ours[batch]:.1f}, default {default[batch]:.1f}, "
              f"ratio {ratio:.2f}", flush=True)
    batch = min(ratios, key=ratios.get)
    report("exact_decode_ratio", f"decode tok/s, exact vs default (min of batch {tuple(ratios)})",
           ours[batch], default[batch], ratios[batch], ">= 0.9", f"the smaller ratio: batch {batch}")
    rates = train_rates(steps=9)
    report("exact_train_ratio", "rl_step tok/s, exact vs default (4 x 128)", rates["exact"], rates["default"],
           rates["exact"] / rates["default"], ">= 0.9", "float32, median of 9 steps taking turns")
