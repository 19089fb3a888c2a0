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
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from rstar2jax.engine import Engine, EngineConfig, EngineCore, SamplingParams, generate
from rstar2jax.models import HF_CONFIGS_DIR, config_from_hf, init_params, load_pretrained

QWEN3_06B = HF_CONFIGS_DIR / "qwen3-0.6b.json"
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
    with open(QWEN3_06B, encoding="utf-8") as f:
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


_BATCH = flags.DEFINE_integer("batch", 32, "sequences decoded at once")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "new tokens per sequence (small)")
_NEW_TOKENS_06B = flags.DEFINE_integer("new_tokens_06b", 256, "new tokens per sequence (0.6B)")
_SKIP_06B = flags.DEFINE_bool("skip_06b", False, "leave out the two 0.6B measurements")
_TORCH_WORKER = flags.DEFINE_list("torch_worker", None, "internal: SHAPE,PATH,BATCH,NEW of one PyTorch run")


def main(argv) -> None:
    del argv
    args = flags.FLAGS
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
