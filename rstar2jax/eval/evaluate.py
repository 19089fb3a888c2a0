"""The paper's evaluation protocol, in one module: k samples per problem (the paper: 16 at temperature 0.6,
up to 30 assistant turns and 30K response tokens, the Python tool run in a sandbox, :class:`EvalProtocol`),
scored by average pass@1, unbiased pass@k and tool-use statistics. Three ways to run it:

- :func:`evaluate_to_files` (``experiments.evaluate``): a loaded policy on eval sets, its own engine, the
  training rollouts (:func:`rstar2jax.agent.rollout_async`: same prompt, tool-call parser and tool-response
  format) graded by the training verifier; every sample written to ``samples.jsonl`` as its problem
  finishes and the per-dataset summary (avg@k, pass@k, maj@k, ...; ``eval.samples.summarize``) to
  ``summary.json``. Each problem's group is seeded by ``(seed, dataset, problem index)``
  (:func:`problem_seed`), so a resumed run samples what an uninterrupted one would have;
- :func:`evaluate_policy` (the demo, the ablation, notebooks): parameters through a batched rollout function
  (the trainer's ``agent.PolicyRollout``: every problem's group decoded side by side), summarised by
  :func:`aggregate` into a :class:`DatasetEval` (:func:`save_evaluation` writes it);
- :func:`evaluate` / :func:`evaluate_async`: any async per-problem sampler, problems concurrently; callers
  that already hold the trajectories call :func:`aggregate` directly.

Eval sets load from local JSONL files with :func:`load_eval_set`: AIME24/25, MATH-500 and HMMT25 by name
(package data in ``rstar2jax/eval/sets``, its README gives source and licence of each), or any file with
``problem`` / ``answer`` fields.

Importing this module loads neither the engine nor the agent: the runners that need them import them when
called, so a launcher can check its datasets (and fail in one line) before the heavy imports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import tqdm.auto as tqdm

from rstar2jax.data.conversation import PromptConfig, max_prompt_tokens, prompt_format
from rstar2jax.data.problems import Problem, load_problems
from rstar2jax.data.trajectory import Trajectory, tool_error_ratios
from rstar2jax.eval.pass_at_k import pass_at_1, pass_at_k
from rstar2jax.eval.samples import SampleLog, sample_record, summarize


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

    def rollout_config(self, prompt: PromptConfig, seed: int):
        """The ``agent.RolloutConfig`` of one problem's group."""
        from rstar2jax.agent.rollout_types import RolloutConfig  # deferred: see the module doc
        from rstar2jax.engine.config import SamplingParams

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


#: ``await sample_fn(problem, k)`` -> k trajectories of ``problem`` with their binary rewards filled in.
SampleFn = Callable[[Problem, int], Awaitable[Sequence[Trajectory]]]

#: Eval sets known by name (``<name>.jsonl`` in the eval data folder).
EVAL_SETS = ("aime24", "aime25", "math500", "hmmt25")
#: Environment variable naming another eval data folder (default: the bundled ``rstar2jax/eval/sets``).
EVAL_DATA_ENV = "RSTAR2JAX_EVAL_DATA"
#: The bundled eval sets (``<name>.jsonl``; the README there gives each one's source and licence).
EVAL_SETS_DIR = pathlib.Path(__file__).resolve().parent / "sets"


@dataclasses.dataclass(frozen=True)
class DatasetEval:
    """One dataset's evaluation: the per-sample correctness and the summary metrics.

    ``metrics`` holds ``pass@1`` (average over the k samples), ``pass@<j>`` for the requested j (unbiased),
    ``response_length`` (mean tokens after the prompt, tool output included), ``tool_calls_per_traj``,
    ``tool_error_ratio`` (failed / all calls), ``tool_error_ratio_correct`` (the same inside correct
    trajectories, the paper's Fig. 4; NaN when they made no call), ``truncation_rate`` and ``num_problems``.
    """

    problem_ids: list[str]
    correct: np.ndarray  # [num_problems, k] bool
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-dataset evaluations, keyed by dataset name."""

    datasets: dict[str, DatasetEval]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat ``{f"{prefix}/{dataset}/{metric}": value}`` for the metrics JSONL / TensorBoard."""
        return {
            f"{prefix}/{name}/{key}": value
            for name, ds in self.datasets.items()
            for key, value in ds.metrics.items()
        }


def aggregate(
    problems: Sequence[Problem],
    samples: Sequence[Sequence[Trajectory]],
    pass_ks: Sequence[int] | None = None,
) -> DatasetEval:
    """Summarises ``samples[i]``, the k trajectories of ``problems[i]`` (same k for every problem).

    A trajectory is correct when its (binary) reward is positive. ``pass_ks`` are the extra pass@j to
    report (default: j = k when k > 1).
    """
    if not problems or len(samples) != len(problems):
        raise ValueError(
            f"need one list of samples per problem and at least one problem; got {len(samples)} "
            f"sample lists for {len(problems)} problems"
        )
    k = len(samples[0])
    for problem, group in zip(problems, samples, strict=True):
        if len(group) != k or k == 0:
            raise ValueError(
                f"problem {problem.id!r} has {len(group)} samples; every problem needs k = {k} > 0"
            )
        strays = {t.problem_id for t in group} - {problem.id}
        if strays:
            raise ValueError(f"samples of problem {problem.id!r} include trajectories of {sorted(strays)}")
    flat = [t for group in samples for t in group]
    correct = np.array([[t.reward > 0 for t in group] for group in samples], dtype=bool)
    metrics = {"pass@1": float(pass_at_1(correct))}
    for j in pass_ks if pass_ks is not None else ([k] if k > 1 else []):
        metrics[f"pass@{j}"] = float(pass_at_k(correct, j))
    metrics.update(
        response_length=float(np.mean([len(t.response_ids) for t in flat])),
        tool_calls_per_traj=sum(t.num_tool_calls for t in flat) / len(flat),
        **tool_error_ratios(flat),
        truncation_rate=float(np.mean([t.truncated for t in flat])),
        num_problems=float(len(problems)),
    )
    return DatasetEval([p.id for p in problems], correct, metrics)


async def evaluate_async(
    problems: Sequence[Problem] | Mapping[str, Sequence[Problem]],
    sample_fn: SampleFn,
    k: int,
    *,
    pass_ks: Sequence[int] | None = None,
    max_concurrency: int = 16,
    progress: bool = True,
) -> EvalResult:
    """Samples ``k`` trajectories per problem (up to ``max_concurrency`` problems at once) and aggregates.

    Args:
      problems: one dataset (reported as ``"eval"``) or ``{name: problems}`` for several.
      sample_fn: ``await sample_fn(problem, k)`` returns the problem's k scored trajectories.
      k: samples per problem (the paper: 16).
      pass_ks: extra pass@j to report (see ``aggregate``).
      max_concurrency: problems in flight at once (the engine batches their rollouts).
      progress: show a progress bar over problems (on a terminal only).
    """
    if k < 1 or max_concurrency < 1:
        raise ValueError(f"k and max_concurrency must be >= 1, got {k} and {max_concurrency}")
    datasets = dict(problems) if isinstance(problems, Mapping) else {"eval": list(problems)}
    semaphore = asyncio.Semaphore(max_concurrency)
    total = sum(len(ds) for ds in datasets.values())
    # disable=None: no bar when stderr is not a terminal (a bar in a log file is one endless line)
    with tqdm.tqdm(total=total, desc="eval", unit="problem", disable=None if progress else True) as bar:

        async def sample(problem: Problem) -> list[Trajectory]:
            async with semaphore:
                trajectories = list(await sample_fn(problem, k))
            bar.update(1)
            return trajectories

        results = {name: await asyncio.gather(*(sample(p) for p in ds)) for name, ds in datasets.items()}
    return EvalResult({name: aggregate(datasets[name], results[name], pass_ks) for name in datasets})


def evaluate(
    problems: Sequence[Problem] | Mapping[str, Sequence[Problem]],
    sample_fn: SampleFn,
    k: int,
    **kwargs,
) -> EvalResult:
    """Synchronous ``evaluate_async`` (runs its own event loop; inside a running loop await the async one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(evaluate_async(problems, sample_fn, k, **kwargs))
    raise RuntimeError("evaluate() was called inside a running event loop; use `await evaluate_async(...)`")


# --------------------------------------------------------------------------------------------------------
# A policy's parameters through a batched rollout function (the trainer's): the demo's evaluation.


def evaluate_policy(
    params,
    problems: Sequence[Problem],
    rollout_fn: Callable[..., Sequence[Trajectory]],
    *,
    samples: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
) -> DatasetEval:
    """Average pass@1 over ``samples`` rollouts per held-out problem, plus tool-use statistics (one batched
    rollout call: the engine decodes every problem's group side by side). ``rollout_fn`` is called as the
    trainer calls its rollout function (``agent.PolicyRollout``)."""
    trajectories = rollout_fn(
        params,
        list(problems),
        samples_per_problem=samples,
        max_response_length=max_response_length,
        max_turns=max_turns,
        seed=seed,
    )
    groups: dict[str, list] = {p.id: [] for p in problems}
    for t in trajectories:
        groups[t.problem_id].append(t)
    return aggregate(problems, [groups[p.id] for p in problems])


def save_evaluation(result: DatasetEval, path: pathlib.Path, **extra: Any) -> dict[str, Any]:
    """Writes an evaluation's metrics and per-problem correctness as JSON; returns what it wrote."""
    record = {
        **extra,
        "metrics": result.metrics,
        "problem_ids": result.problem_ids,
        "correct": np.asarray(result.correct).astype(int).tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


# --------------------------------------------------------------------------------------------------------
# A loaded policy on eval sets, resumable, every sample on disk: the evaluate launcher.


class EvaluatedPolicy(Protocol):
    """What :func:`evaluate_to_files` reads of a policy (a loaded :class:`rstar2jax.policy.loader.Policy`)."""

    params: Any
    model_config: Any
    tokenizer: Any
    eos_token_ids: Sequence[int]
    path: str
    prompt: PromptConfig | None


@dataclasses.dataclass(frozen=True)
class _Todo:
    """One unfinished problem: its dataset, its index there, and the sample indices still to write."""

    dataset: str
    index: int
    problem: Problem
    missing: list[int]


async def evaluate_to_files(
    policy: EvaluatedPolicy,
    datasets: Mapping[str, Sequence[Problem]],
    workdir: str | pathlib.Path,
    *,
    sandbox,
    verifier,
    protocol: EvalProtocol = EvalProtocol(),
    prompt: PromptConfig | None = None,
    num_slots: int = 32,
    progress: bool = True,
    tools: Sequence | None = None,
) -> dict[str, dict[str, float]]:
    """Runs every unfinished problem of ``datasets`` and writes ``workdir/samples.jsonl`` (appended, one
    problem at a time) and ``workdir/summary.json``; returns the summary (see
    :func:`rstar2jax.eval.samples.summarize`). ``sandbox``: an ``agent.ToolSandbox`` (a ``SandboxClient``);
    ``verifier``: the ``reward.AnswerVerifier`` that grades answers; ``prompt``: the conversation format
    (default: the one the policy was trained in, :func:`~rstar2jax.data.conversation.prompt_format`);
    ``tools``: the model's tools, as ``agent.rollout_async``'s (None: the sandbox's Python tool; the prompt
    must list their schemas, ``agent.load_tools`` gives both)."""
    workdir = pathlib.Path(workdir)
    prompt = prompt or prompt_format(policy)
    log = SampleLog(workdir / "samples.jsonl")
    k = protocol.samples
    todo = [
        _Todo(name, index, problem, log.missing(name, index, k))
        for name, problems in datasets.items()
        for index, problem in enumerate(problems)
        if not log.done(name, index, k)
    ]
    if todo:
        finished = sum(len(problems) for problems in datasets.values()) - len(todo)
        with tqdm.tqdm(
            total=finished + len(todo), initial=finished, desc="problems", disable=not progress
        ) as bar:
            await _sample_problems(policy, todo, log, bar, sandbox, verifier, protocol, prompt, num_slots,
                                   tools)
    summary = summarize(log.records, k)
    _write_summary(workdir / "summary.json", summary, protocol, policy.path, prompt)
    return summary


async def _sample_problems(policy, todo, log, bar, sandbox, verifier, protocol, prompt, num_slots,
                           tools) -> None:
    """Samples the missing samples of every problem of ``todo`` on one engine (enough groups queued to
    keep its slots busy) and appends each problem's records as it finishes."""
    from rstar2jax.agent.multi_turn import rollout_async  # deferred: see the module doc
    from rstar2jax.engine import Engine, EngineConfig, page_rounded

    longest = max_prompt_tokens(policy.tokenizer, [item.problem for item in todo], prompt)
    engine_config = EngineConfig(
        num_slots=num_slots,
        max_len=page_rounded(longest + protocol.max_tokens),
        eos_token_ids=policy.eos_token_ids,
        seed=protocol.seed,
    )
    limit = asyncio.Semaphore(max(2, 2 * num_slots // protocol.samples))
    async with Engine(policy.params, policy.model_config, engine_config) as engine:

        async def run(item: _Todo) -> None:
            async with limit:
                seed = problem_seed(protocol.seed, item.dataset, item.index)
                config = protocol.rollout_config(prompt, seed)
                trajectories = await rollout_async(
                    [item.problem], len(item.missing), engine=engine, sandbox=sandbox,
                    tokenizer=policy.tokenizer, verifier=verifier, config=config, tools=tools,
                )  # fmt: skip
            log.append(_records(item, trajectories, policy.tokenizer, protocol.max_turns))
            bar.update(1)

        tasks = [asyncio.ensure_future(run(item)) for item in todo]
        try:
            await asyncio.gather(*tasks)
        finally:  # a failure (or Ctrl-C) stops the other problems before the engine stops
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _records(item: _Todo, trajectories: Sequence[Trajectory], tokenizer, max_turns: int) -> list[dict]:
    """The ``samples.jsonl`` records of one problem's new samples."""
    return [
        sample_record(
            item.dataset,
            item.index,
            sample,
            item.problem,
            trajectory,
            tokenizer.decode(trajectory.response_ids, skip_special_tokens=False),
            max_turns=max_turns,
        )
        for sample, trajectory in zip(item.missing, trajectories, strict=True)
    ]


def _write_summary(path: pathlib.Path, summary, protocol: EvalProtocol, model: str, prompt: PromptConfig):
    """``summary.json``: the protocol, the model, the prompt format and the per-dataset summary (NaN as
    null: JSON has no NaN)."""
    no_nan = {d: {key: None if v != v else v for key, v in m.items()} for d, m in summary.items()}
    record = {
        "protocol": dataclasses.asdict(protocol),
        "model": model,
        "prompt": prompt.to_json_dict(),
        "datasets": no_nan,
    }
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")


def default_eval_data_dir() -> pathlib.Path:
    """``$RSTAR2JAX_EVAL_DATA``, else the eval sets bundled with the package (``rstar2jax/eval/sets``)."""
    if os.environ.get(EVAL_DATA_ENV):
        return pathlib.Path(os.environ[EVAL_DATA_ENV])
    return EVAL_SETS_DIR


def load_eval_set(
    name_or_path: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Loads an eval set: a JSONL (or JSON / Parquet) file path, or a name in ``EVAL_SETS``.

    A name resolves to ``<data_dir>/<name>.jsonl`` (``data_dir`` defaults to ``default_eval_data_dir()``).
    Every row must have a problem and an answer: an eval set with unusable rows is an error, not a
    silently smaller set. ``limit`` keeps the first rows only.
    """
    path = pathlib.Path(name_or_path)
    if not path.is_file():
        if str(name_or_path) not in EVAL_SETS:
            raise ValueError(
                f"eval set {str(name_or_path)!r} is neither an existing file nor one of {EVAL_SETS}"
            )
        path = pathlib.Path(data_dir or default_eval_data_dir()) / f"{name_or_path}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"eval set {str(name_or_path)!r} not found at {path}; pass data_dir= or set ${EVAL_DATA_ENV}"
            )
    loaded = load_problems(path, limit=limit)
    if loaded.num_skipped:
        raise ValueError(f"{path}: rows without a usable problem/answer: {dict(loaded.skipped)}")
    return loaded.problems
