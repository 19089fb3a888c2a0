"""Evaluation: the paper's protocol (:class:`EvalProtocol`: average pass@1 over k samples, unbiased pass@k,
tool-use statistics) and its three runners (:func:`evaluate_to_files`, :func:`evaluate_policy`,
:func:`evaluate`), all in ``rstar2jax.eval.evaluate``; per-sample records and their summary (avg@k, pass@k,
maj@k) in ``rstar2jax.eval.samples``; eval-set loading.

Plots and the markdown run report live in ``rstar2jax.eval.report`` (imported on demand: it needs matplotlib).
"""

from rstar2jax.data.trajectory import tool_error_ratios
from rstar2jax.eval.evaluate import (
    EVAL_DATA_ENV,
    EVAL_SETS,
    EVAL_SETS_DIR,
    DatasetEval,
    EvalProtocol,
    EvalResult,
    SampleFn,
    aggregate,
    default_eval_data_dir,
    evaluate,
    evaluate_async,
    evaluate_policy,
    evaluate_to_files,
    load_eval_set,
    problem_seed,
    save_evaluation,
)
from rstar2jax.eval.pass_at_k import pass_at_1, pass_at_k
from rstar2jax.eval.samples import format_summary, summarize

__all__ = [
    "EVAL_DATA_ENV",
    "EVAL_SETS",
    "EVAL_SETS_DIR",
    "DatasetEval",
    "EvalProtocol",
    "EvalResult",
    "SampleFn",
    "aggregate",
    "default_eval_data_dir",
    "evaluate",
    "evaluate_async",
    "evaluate_policy",
    "evaluate_to_files",
    "format_summary",
    "load_eval_set",
    "problem_seed",
    "save_evaluation",
    "summarize",
    "tool_error_ratios",
    "pass_at_1",
    "pass_at_k",
]
