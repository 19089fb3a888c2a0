"""Evaluation: average pass@1 over k samples, unbiased pass@k, tool-use statistics, eval-set loading.

Plots and the markdown run report live in ``rstar2jax.eval.report`` (imported on demand: it needs matplotlib).
"""

from rstar2jax.eval.evaluate import (
    EVAL_DATA_ENV,
    EVAL_SETS,
    EVAL_SETS_DIR,
    DatasetEval,
    EvalResult,
    SampleFn,
    aggregate,
    default_eval_data_dir,
    evaluate,
    evaluate_async,
    load_eval_set,
    tool_error_ratios,
)
from rstar2jax.eval.pass_at_k import pass_at_1, pass_at_k

__all__ = [
    "EVAL_DATA_ENV",
    "EVAL_SETS",
    "EVAL_SETS_DIR",
    "DatasetEval",
    "EvalResult",
    "SampleFn",
    "aggregate",
    "default_eval_data_dir",
    "evaluate",
    "evaluate_async",
    "load_eval_set",
    "tool_error_ratios",
    "pass_at_1",
    "pass_at_k",
]
