"""Answer extraction and verification (binary reward).

``score_answer(response_text, gold) -> bool`` is the paper's reward: 1 iff the last ``\\boxed{}`` inside the
final ``<answer>`` block of the model-written text equals the gold answer (integer fast path, otherwise
math-verify in worker processes with a deadline). ``grade_answer`` also returns the extracted answer and a
reason for logging; ``AnswerVerifier`` is the async, event-loop-safe form (``await verifier.score(...)``), and
runs a reward function of the user's in its worker processes instead (``await verifier.reward(...)``; the
rollout's ``reward=``, a run config's ``reward.fn``).
"""

from rstar2jax.reward.extraction import as_integer, extract_answer, final_answer_block, last_boxed
from rstar2jax.reward.verifier import (
    AnswerGrade,
    AnswerVerifier,
    RewardError,
    close_default_verifier,
    default_verifier,
    grade_answer,
    score_answer,
)

__all__ = [
    "AnswerGrade",
    "AnswerVerifier",
    "RewardError",
    "as_integer",
    "close_default_verifier",
    "default_verifier",
    "extract_answer",
    "final_answer_block",
    "grade_answer",
    "last_boxed",
    "score_answer",
]
