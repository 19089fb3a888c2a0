"""Benchmark of partial rollouts: what stopping rollouts at a token budget and resuming them costs.

  python -m experiments.bench_partial [--problems=8 --samples=4 --max_response_length=128 --budget=256]

Workload: ``problems x samples`` greedy rollouts of the synthetic integer task with a tiny Qwen3-shaped
model (random weights, byte-level BPE tokenizer trained here) on this CPU, with an in-process tool stub (a
random model almost never calls it). Three runs of the same workload, each after an untimed warm-up run of
itself (compilation excluded):

  whole      the baseline: one ``rollout_async`` call, whole turns (``segment_tokens=None``);
  segments   one call sampling in segments of ``--segment`` tokens (what partial rollouts look at the budget
             between), no budget;
  partial    calls of ``--budget`` sampled tokens each, the unfinished rollouts resumed by the next call
             (same parameters), until every rollout finished: each resume prefills prompt + response so
             far again.

Reported per run: wall time, engine calls, sampled tokens, tokens prefilled again by resumes, and whether
the finished token streams equal the baseline's (greedy decoding: they must). Timings on a shared machine
are noisy. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import platform
import tempfile
import time

import jax
from absl import flags

from experiments import bench_record
from rstar2jax.agent import PartialRollout, RolloutConfig, render_prompt_ids, rollout_async
from rstar2jax.agent.testing import ok_result, tiny_policy
from rstar2jax.data.synthetic import make_task
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, page_rounded
from rstar2jax.reward import AnswerVerifier


class StubSandbox:
    """A tool that prints nothing (the random policy's rare calls must not wait on a server)."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None):
        return ok_result("")


async def timed_calls(params, policy, problems, samples, verifier, engine_config, config, budget):
    """(seconds, finished trajectories, calls, tokens prefilled again): calls of ``budget`` tokens (None:
    one call) until every rollout finished."""
    finished, unfinished, calls, prefilled = [], [], 0, 0
    start = time.perf_counter()
    async with Engine(params, policy.model_config, engine_config, policy_version=0) as engine:
        pending = list(problems)
        while pending or unfinished:
            prefilled += sum(len(u.prompt_ids) + u.num_tokens for u in unfinished if u.num_tokens)
            results = await rollout_async(
                pending, samples, engine=engine, sandbox=StubSandbox(), tokenizer=policy.tokenizer,
                verifier=verifier, config=config, token_budget=budget, resume=unfinished,
            )
            calls, pending = calls + 1, []
            unfinished = [r for r in results if isinstance(r, PartialRollout)]
            finished += [r for r in results if not isinstance(r, PartialRollout)]
    return time.perf_counter() - start, finished, calls, prefilled


def streams(trajectories) -> list:
    return sorted((t.problem_id, t.response_ids) for t in trajectories)


def define_flags() -> None:
    """The benchmark's flags (defined only when it runs, so that tests can import its helpers)."""
    flags.DEFINE_integer("problems", 8, "Problems (engine groups).")
    flags.DEFINE_integer("samples", 4, "Rollouts per problem.")
    flags.DEFINE_integer("max_response_length", 128, "Response budget (tokens).")
    flags.DEFINE_integer("budget", 256, "Sampled tokens per partial-rollout call.")
    flags.DEFINE_integer("segment", 16, "Tokens sampled between looks at the budget.")
    flags.DEFINE_integer("slots", 32, "Engine slots.")
    flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    problems = [p.as_problem() for p in make_task(FLAGS.problems, 0, seed=FLAGS.seed).train]
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy = tiny_policy(problems, tokenizer_dir, seed=FLAGS.seed)
    longest_prompt = max(len(render_prompt_ids(policy.tokenizer, p.problem)) for p in problems)
    max_len = page_rounded(longest_prompt + FLAGS.max_response_length)
    engine_config = EngineConfig(num_slots=FLAGS.slots, max_len=max_len)
    base = RolloutConfig(max_response_length=FLAGS.max_response_length, seed=FLAGS.seed,
                         sampling=SamplingParams(temperature=0.0))
    segmented = RolloutConfig(**{**base.__dict__, "segment_tokens": FLAGS.segment})
    runs = (("whole", base, None), ("segments", segmented, None), ("partial", segmented, FLAGS.budget))
    rows, reference = [], None
    with AnswerVerifier(num_workers=1) as verifier:
        for name, config, budget in runs:
            args = (policy.params, policy, problems, FLAGS.samples, verifier, engine_config, config, budget)
            asyncio.run(timed_calls(*args))  # warm-up: compiles what the timed run uses
            seconds, finished, calls, prefilled = asyncio.run(timed_calls(*args))
            reference = reference or streams(finished)
            rows.append(dict(
                run=name, wall_s=round(seconds, 3), calls=calls,
                sampled_tokens=sum(sum(t.loss_mask) for t in finished), prefilled_again=prefilled,
                same_tokens=streams(finished) == reference,
            ))
    device = f"{jax.devices()[0]} ({platform.processor() or 'cpu'})"
    print(f"Partial rollouts on {device}: {len(problems)} problems x {FLAGS.samples} samples, greedy, budget "
          f"{FLAGS.max_response_length} tokens per response; partial calls of {FLAGS.budget} sampled tokens, "
          f"segments of {FLAGS.segment}")
    header = f"{'run':<10}{'wall s':>9}{'calls':>7}{'sampled':>9}{'re-prefilled':>14}{'same tokens':>13}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['run']:<10}{r['wall_s']:>9.2f}{r['calls']:>7}{r['sampled_tokens']:>9}"
              f"{r['prefilled_again']:>14}{str(r['same_tokens']):>13}")
    by_run = {r["run"]: r for r in rows}
    print("(shared 2-core machine, other jobs running: timings are noisy)")
    print(json.dumps({
        "whole_s": by_run["whole"]["wall_s"],
        "segments_s": by_run["segments"]["wall_s"],
        "partial_s": by_run["partial"]["wall_s"],
        "partial_calls": by_run["partial"]["calls"],
        "partial_vs_whole": round(by_run["partial"]["wall_s"] / by_run["whole"]["wall_s"], 3),
        "prefilled_again": by_run["partial"]["prefilled_again"],
        "sampled_tokens": by_run["whole"]["sampled_tokens"],
        "same_tokens": all(r["same_tokens"] for r in rows),
    }))


if __name__ == "__main__":
    define_flags()
    bench_record.run(main)
