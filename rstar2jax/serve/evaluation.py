"""The paper's evaluation protocol as one resumable run: agentic rollouts of a policy on eval sets, every
sample written to ``samples.jsonl``, the per-dataset summary to ``summary.json``.

Protocol defaults (:class:`EvalProtocol`) are the paper's: 16 samples per problem at temperature 0.6, up to
30 assistant turns and 30K response tokens, the Python tool run in a sandbox. Each problem's group is seeded
by ``(seed, dataset, problem index)``, so a resumed run samples what an uninterrupted one would have.
Rollouts are the training rollouts (:func:`rstar2jax.agent.rollout_async`: same prompt, tool-call parser
and tool-response format), graded by the training verifier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import zlib
from collections.abc import Mapping, Sequence

import tqdm.auto as tqdm

from rstar2jax.agent.multi_turn import rollout_async
from rstar2jax.agent.rollout_types import RolloutConfig, ToolSandbox
from rstar2jax.data.conversation import PromptConfig, render_prompt_ids
from rstar2jax.data.problems import Problem
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, page_rounded
from rstar2jax.eval.samples import SampleLog, format_summary, sample_record, summarize
from rstar2jax.reward import AnswerVerifier
from rstar2jax.serve.policy import PROMPTS, Policy, prompt_format


@dataclasses.dataclass(frozen=True)
class EvalProtocol:
    """Sampling and limits of an evaluation (defaults: the paper's).

    Attributes:
      samples: samples per problem (k of avg@k, pass@k, maj@k).
      temperature, top_p: sampling.
      max_tokens: response budget per sample (sampled and tool tokens).
      max_turns: assistant turns per sample.
      tool_timeout: seconds one Python call may run.
      seed: seeds every problem's group.
    """

    samples: int = 16
    temperature: float = 0.6
    top_p: float = 1.0
    max_tokens: int = 30_000
    max_turns: int = 30
    tool_timeout: float = 10.0
    seed: int = 0

    def rollout_config(self, prompt: PromptConfig, seed: int) -> RolloutConfig:
        return RolloutConfig(
            max_response_length=self.max_tokens,
            max_turns=self.max_turns,
            tool_timeout=self.tool_timeout,
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p),
            prompt=prompt,
            seed=seed,
        )


def problem_seed(seed: int, dataset: str, index: int) -> int:
    """The seed of one problem's group: independent of which other problems run (resume-safe)."""
    return int(zlib.crc32(f"{seed}/{dataset}/{index}".encode()))


async def evaluate_to_files(
    policy: Policy,
    datasets: Mapping[str, Sequence[Problem]],
    workdir: str | pathlib.Path,
    *,
    sandbox: ToolSandbox,
    verifier: AnswerVerifier,
    protocol: EvalProtocol = EvalProtocol(),
    prompt: PromptConfig | None = None,
    num_slots: int = 32,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Runs every unfinished problem of ``datasets`` and writes ``workdir/samples.jsonl`` (appended, one
    problem at a time) and ``workdir/summary.json``; returns the summary (see
    :func:`rstar2jax.eval.samples.summarize`). ``prompt``: the conversation format (default: the one the
    policy was trained in, :func:`~rstar2jax.serve.policy.prompt_format`)."""
    workdir = pathlib.Path(workdir)
    prompt = prompt or prompt_format(policy)
    k = protocol.samples
    log = SampleLog(workdir / "samples.jsonl")
    todo = [
        (name, index, problem, log.missing(name, index, k))
        for name, problems in datasets.items()
        for index, problem in enumerate(problems)
        if not log.done(name, index, k)
    ]
    finished = sum(len(problems) for problems in datasets.values()) - len(todo)
    if todo:
        tokenizer = policy.tokenizer
        longest = max(len(render_prompt_ids(tokenizer, p.problem, prompt)) for _, _, p, _ in todo)
        engine_config = EngineConfig(
            num_slots=num_slots,
            max_len=page_rounded(longest + protocol.max_tokens),
            eos_token_ids=policy.eos_token_ids,
            seed=protocol.seed,
        )
        limit = asyncio.Semaphore(max(2, 2 * num_slots // k))  # enough groups queued to keep slots busy
        with tqdm.tqdm(
            total=finished + len(todo), initial=finished, desc="problems", disable=not progress
        ) as bar:
            async with Engine(policy.params, policy.model_config, engine_config) as engine:

                async def run(name: str, index: int, problem: Problem, missing: list[int]) -> None:
                    async with limit:
                        config = protocol.rollout_config(prompt, problem_seed(protocol.seed, name, index))
                        trajectories = await rollout_async(
                            [problem],
                            len(missing),
                            engine=engine,
                            sandbox=sandbox,
                            tokenizer=tokenizer,
                            verifier=verifier,
                            config=config,
                        )
                    log.append(
                        [
                            sample_record(
                                name,
                                index,
                                s,
                                problem,
                                t,
                                tokenizer.decode(t.response_ids, skip_special_tokens=False),
                                max_turns=protocol.max_turns,
                            )
                            for s, t in zip(missing, trajectories, strict=True)
                        ]
                    )
                    bar.update(1)

                tasks = [asyncio.ensure_future(run(*item)) for item in todo]
                try:
                    await asyncio.gather(*tasks)
                finally:  # a failure (or Ctrl-C) stops the other problems before the engine stops
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
    summary = summarize(log.records, k)
    no_nan = {d: {key: None if v != v else v for key, v in m.items()} for d, m in summary.items()}
    record = {
        "protocol": dataclasses.asdict(protocol),
        "model": policy.path,
        "prompt": prompt.to_json_dict(),
        "datasets": no_nan,
    }
    (workdir / "summary.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    return summary


__all__ = ["PROMPTS", "EvalProtocol", "evaluate_to_files", "format_summary", "problem_seed"]
