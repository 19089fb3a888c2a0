"""The asynchronous-RL workload of ``experiments/bench_async.py`` (parts ``async``, ``split``, ``weights``).

The demo's agent workload in miniature: the demo's synthetic integer problems, a tiny Qwen3-shaped policy
taught to call the Python tool (``rstar2jax.agent.testing.teach_tool_use``: it calls the tool with
``TOOL_CODE`` and answers what it printed; each problem's gold answer is set to that output, so rewards
are the policy's own hits, about half its samples at temperature 1), a real ``sandbox_server`` behind
``sandbox_server.latency_proxy`` (every tool call delayed by a lognormal draw, median 0.5 s, p95 2 s) and
``rl_iteration`` with the trainer's ``PolicyRollout``. The synchronous and the asynchronous run take the
same number of updates from the same initial state, seeds and problem order; each first runs ``warmup``
untimed updates (they compile the engine's and the step's programs; the step function is shared, so the
second run compiles nothing new).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import jax
import numpy as np

#: The short prompt of the tool-using tiny policy (its sequences and its teaching stay cheap).
SYSTEM_PROMPT = ""


@dataclasses.dataclass(frozen=True)
class AsyncWorkload:
    """Each update: ``prompts`` problems x ``samples`` rollouts (2G; RoC keeps half), at most
    ``max_response_length`` tokens and ``max_turns`` turns; ``updates`` timed after ``warmup``."""

    prompts: int = 2
    samples: int = 4
    max_response_length: int = 96
    max_turns: int = 2
    updates: int = 12
    warmup: int = 2
    seed: int = 0
    latency_median_s: float = 0.5
    latency_p95_s: float = 2.0


def taught_policy(workload: AsyncWorkload, folder: str):
    """(policy, problems, prompt): the tool-using tiny policy and the problems whose answer it can hit."""
    from rstar2jax.agent import PYTHON_TOOL_NAME, PromptConfig
    from rstar2jax.agent.testing import teach_tool_use, tiny_policy, tool_code_output
    from rstar2jax.data.problems import Problem
    from rstar2jax.data.synthetic import make_task

    prompt = PromptConfig(system_prompt=SYSTEM_PROMPT, user_prefix="",
                          tools=({"type": "function", "function": {"name": PYTHON_TOOL_NAME}},))
    count = workload.prompts * (workload.updates + workload.warmup + 2)
    output = tool_code_output().strip()
    problems = [Problem(p.id, p.problem, output) for p in make_task(count, 0, seed=workload.seed).train]
    policy = tiny_policy(problems, folder, vocab_size=512, prompt=prompt, seed=workload.seed)
    params = teach_tool_use(policy, problems, steps=80, learning_rate=1e-2, prompt=prompt)
    # On the host: each run starts from its own device copy (the update donates the parameters it updates).
    return dataclasses.replace(policy, params=jax.device_get(params)), problems, prompt


def longest_prompt(policy, problems, prompt) -> int:
    """The longest rendered prompt of ``problems``, in tokens (the engine's and the batch rows' room)."""
    from rstar2jax.agent import render_prompt_ids

    return max(len(render_prompt_ids(policy.tokenizer, p.problem, prompt)) for p in problems)


def policy_rollout(policy, prompt, url: str, verifier, workload: AsyncWorkload, max_prompt: int):
    """The trainer's ``PolicyRollout`` on the sandbox at ``url``, sampling at temperature 1; ``engines``:
    every engine its synchronous calls made (their ``core.stats["busy_s"]``: the ceiling's engine time)."""
    from rstar2jax.agent import PolicyRollout, RolloutConfig, SandboxClient
    from rstar2jax.engine import EngineConfig, SamplingParams, page_rounded

    engine = EngineConfig(num_slots=workload.prompts * workload.samples * 2,
                          max_len=page_rounded(max_prompt + workload.max_response_length))
    rollout_fn = PolicyRollout(policy.model_config, policy.tokenizer, SandboxClient(url),
                               engine_config=engine, max_prompt_length=max_prompt, verifier=verifier,
                               config=RolloutConfig(prompt=prompt, sampling=SamplingParams(temperature=1.0)))
    engines, make_engine = [], rollout_fn.make_engine

    def recorded(*args, **kwargs):
        engines.append(make_engine(*args, **kwargs))
        return engines[-1]

    rollout_fn.make_engine, rollout_fn.engines = recorded, engines
    return rollout_fn


def train_pieces(policy, workload: AsyncWorkload, max_prompt: int):
    """(rl_step, iteration config): the decoupled loss (what async uses; at eta=0 it equals PPO's)."""
    from rstar2jax import train

    optimizer = train.make_optimizer(1e-4, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
    step = train.make_rl_step(policy.model_config, optimizer,
                              train.RLLossConfig(off_policy_correction="decoupled"))
    iteration = train.RLIterationConfig(samples_per_problem=workload.samples, keep=workload.samples // 2,
                                        roc_mode="paper", reject_equal_reward=False,
                                        seq_len=max_prompt + workload.max_response_length, pack=False)
    return optimizer, step, iteration


def run_schedule(policy, problems, rollout_fn, pieces, workload: AsyncWorkload, *, asynchronous: bool,
                 rollout_device=None) -> dict:
    """One run: per-update wall seconds (timed updates), metrics, the producer's ledger."""
    from rstar2jax import train
    from rstar2jax.data.problems import ProblemIterator
    from rstar2jax.schedules.async_schedule import AsyncSchedule

    optimizer, step, iteration = pieces
    total = workload.updates + workload.warmup
    schedule = None
    if asynchronous:
        device = rollout_device or jax.devices()[0]
        schedule = AsyncSchedule(1, devices=[device], dtype=policy.model_config.compute_dtype)
        schedule.begin_stage(total, 0)
    iterator = ProblemIterator(problems, workload.prompts, seed=workload.seed)
    params = jax.device_put(policy.params, jax.devices()[0])
    state = jax.device_put(train.init_train_state(params, optimizer, workload.seed), jax.devices()[0])
    history, starts = [], []
    try:
        for _ in range(total):
            starts.append(time.perf_counter())
            batch = schedule.draw(iterator, stage_last=False) if asynchronous else next(iterator)
            state, metrics = train.rl_iteration(
                state, batch, rollout_fn=rollout_fn, rl_step=step, config=iteration,
                max_response_length=workload.max_response_length, max_turns=workload.max_turns,
                num_rows=workload.prompts * iteration.keep, schedule=schedule)
            jax.block_until_ready(state.params)
            history.append(metrics)
        end = time.perf_counter()
        ledger = dict(schedule.ledger) if asynchronous else {}
        outstanding = len(schedule.tickets) if asynchronous else 0
    finally:
        if schedule is not None:
            schedule.close()
    timed = history[workload.warmup:]
    return {
        "s_per_update": (end - starts[workload.warmup]) / workload.updates,
        "history": timed,
        "ledger": ledger,
        "outstanding": outstanding,
        "rewards": [m["reward"] for m in timed],
    }


def weight_update_ms(repeats: int = 3) -> dict:
    """An in-flight update of the Qwen3-0.6B shape (bfloat16), split placement: the trainer's weights on
    device 0, the engine on device 1 decoding a session; the copy into the engine's layout and its queueing
    timed (``Producer.update``'s two halves), median of ``repeats``."""
    from rstar2jax import models
    from rstar2jax.engine import Engine, EngineConfig, SamplingParams
    from rstar2jax.schedules.placement import engine_copy

    config = models.preset("qwen3-0.6b", param_dtype="bfloat16", compute_dtype="bfloat16")
    trainer, engine_device = jax.devices()[0], jax.devices()[-1]
    with jax.default_device(trainer):
        params = models.init_params(config, jax.random.key(0))
    with jax.default_device(engine_device):  # the engine's state (KV pages) beside its weights
        engine = Engine(engine_copy(params, engine_device), config, EngineConfig(num_slots=1, max_len=256),
                        policy_version=0)

    async def scenario():
        times = []
        async with engine:
            (session,) = await engine.open([1, 2, 3, 4], sampling=SamplingParams(temperature=1.0),
                                           max_tokens=200, seed=0)
            decoding = asyncio.ensure_future(session.generate(max_new_tokens=200))
            for version in range(1, repeats + 1):
                start = time.perf_counter()
                copy = jax.block_until_ready(engine_copy(params, engine_device))
                await engine.update_weights(copy, version)
                times.append(1000 * (time.perf_counter() - start))
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)
            session.close()
        return times

    times = asyncio.run(scenario())
    leaves = jax.tree.leaves(params)
    return {"ms": statistics.median(times), "all_ms": times,
            "params": int(sum(np.prod(x.shape) for x in leaves))}
