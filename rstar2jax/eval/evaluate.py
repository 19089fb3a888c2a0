"""Evaluation: sample k answers per problem with a rollout function, report average pass@1 and tool use.

``evaluate`` runs an async per-problem sampler concurrently; callers that already hold the trajectories
(e.g. a batched rollout inside the trainer) call ``aggregate`` directly. Eval sets load from local JSONL
files with ``load_eval_set``: AIME24/25, MATH-500 and HMMT25 by name (package data in ``rstar2jax/eval/sets``,
its README gives source and licence of each), or any file with ``problem`` / ``answer`` fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
from collections.abc import Awaitable, Callable, Mapping, Sequence

import numpy as np
import tqdm.auto as tqdm

from rstar2jax.data.problems import Problem, load_problems
from rstar2jax.data.trajectory import Trajectory, tool_error_ratios
from rstar2jax.eval.pass_at_k import pass_at_1, pass_at_k

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
