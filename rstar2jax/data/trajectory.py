"""The trajectory record: what one agentic rollout produces and what the trainer consumes.

Token in / token out: ``response_ids`` is exactly what followed the prompt, model-sampled tokens and inserted
tool/turn tokens interleaved; ``loss_mask`` is 1 on model-sampled tokens and 0 on inserted ones.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Literal

#: How one tool call ended: a sandbox status, or a failure found before anything ran.
ToolOutcome = Literal[
    # Sandbox statuses (see sandbox_server.schema) ...
    "ok", "error", "timeout", "memory_limit", "output_limit", "killed",
    "invalid_request", "internal",
    # ... and failures found before anything ran.
    "parse_error", "unreachable",
]

#: Outcomes that count as a failed tool call for the RoC tool-error penalty: anything but a clean run.
FAILED_OUTCOMES = frozenset(o for o in ToolOutcome.__args__ if o != "ok")

#: The policy version of a response token no policy sampled (inserted tool output and turn tokens); a
#: sampled token carries the trainer step whose parameters sampled it (>= 0). The engine's
#: ``rstar2jax.engine.NO_POLICY_VERSION`` is the same value.
NO_POLICY_VERSION = -1


_ANSWER_BLOCK = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def answer_tag_counts(text: str) -> tuple[int, int, int]:
    """(``<answer>`` tags, ``</answer>`` tags, closed ``<answer>...</answer>`` blocks) in ``text``; blocks
    are matched left to right, each from an opening tag to the nearest closing tag after it."""
    return text.count("<answer>"), text.count("</answer>"), len(_ANSWER_BLOCK.findall(text))


@dataclasses.dataclass
class Trajectory:
    """One multi-turn rollout of one problem.

    Attributes:
      problem_id: id of the problem (dataset row id).
      prompt_ids: the rendered prompt, ending with the first assistant opener.
      response_ids: every token after the prompt (sampled and inserted), in order.
      loss_mask: per response token, 1 if the policy sampled it, 0 if it was inserted
        (tool output, turn tokens).
      logprobs: per response token, the sampler's log-probability (0.0 where ``loss_mask`` is 0).
      tool_outcomes: the outcome of every tool call, in order (``ToolOutcome``).
      num_turns: assistant turns, the first included.
      num_answer_blocks: ``<answer>`` blocks (opening tags) the model wrote.
      num_answer_closes / num_answer_pairs: ``</answer>`` tags and closed ``<answer>...</answer>`` blocks in
        the model's text (``answer_tag_counts``; the released code's format rule needs them); None when not
        recorded.
      truncated: the response hit its token budget (or the turn limit) before the model finished.
      answer: the extracted final answer, or None.
      reward: the reward: binary (0.0 or 1.0) from the answer verifier, or a reward function's float.
      timings: seconds spent per phase (e.g. "generate", "tool", "verify").
      policy_versions: per response token, the policy version (trainer step) whose parameters sampled it,
        ``NO_POLICY_VERSION`` (-1) where ``loss_mask`` is 0; None when the rollout did not record them (the
        trainer then tags the sampled tokens with the version of the parameters it rolled out with). Tokens
        of one trajectory can carry several versions (a partial rollout resumed after an update).
      entropies: per response token, the entropy (nats) of the policy distribution the token was sampled
        from, before temperature / top-p (the engine computes it from the same logits as the log-prob, so
        it costs no extra pass over the vocabulary); 0.0 where ``loss_mask`` is 0; None when the rollout
        did not record them. High-entropy "forking" tokens are the paper's section 5 analysis
        (``rstar2jax.eval`` has the tools).
      text: the text the model wrote (tool responses and turn tokens left out): what the answer is
        extracted from and a reward function (``reward.fn``) reads; None when not recorded.
    """

    problem_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    tool_outcomes: list[str] = dataclasses.field(default_factory=list)
    num_turns: int = 1
    num_answer_blocks: int = 0
    truncated: bool = False
    answer: str | None = None
    reward: float = 0.0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    num_answer_closes: int | None = None
    num_answer_pairs: int | None = None
    policy_versions: list[int] | None = None
    entropies: list[float] | None = None
    text: str | None = None

    def __post_init__(self):
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"response_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs ({len(self.logprobs)}) "
                "must have the same length"
            )
        for name in ("policy_versions", "entropies"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} ({len(values)}) must have one entry per response token ({n})")

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_outcomes)

    @property
    def num_failed_calls(self) -> int:
        return sum(o in FAILED_OUTCOMES for o in self.tool_outcomes)


def tool_error_ratios(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``tool_error_ratio`` (failed / all tool calls) and ``tool_error_ratio_correct`` (the same inside the
    correct trajectories, reward > 0: the paper's Fig. 4). Each is NaN when those trajectories made no call:
    no calls is not "no failed calls"."""

    def ratio(group):
        calls = sum(t.num_tool_calls for t in group)
        return sum(t.num_failed_calls for t in group) / calls if calls else math.nan

    return {
        "tool_error_ratio": ratio(trajectories),
        "tool_error_ratio_correct": ratio([t for t in trajectories if t.reward > 0]),
    }


#: The fields of a trajectory's declared record (``trajectory_to_dict``), every field of ``Trajectory``:
#: what a checkpoint keeps of a finished, untrained group and what the rollout record writes. Renaming or
#: moving the class changes nothing on disk; a new field needs a default (older records lack it).
TRAJECTORY_FIELDS = (
    "problem_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "tool_outcomes", "num_turns",
    "num_answer_blocks", "truncated", "answer", "reward", "timings", "num_answer_closes", "num_answer_pairs",
    "policy_versions", "entropies", "text",
)


def trajectory_to_dict(trajectory: Trajectory) -> dict:
    """``trajectory`` as plain JSON data: ``TRAJECTORY_FIELDS`` by name (lists, numbers, strings, None)."""
    return {name: getattr(trajectory, name) for name in TRAJECTORY_FIELDS}


def trajectory_from_dict(record: dict) -> Trajectory:
    """The trajectory ``trajectory_to_dict`` wrote (missing fields take their defaults; unknown ones fail)."""
    unknown = set(record) - set(TRAJECTORY_FIELDS)
    if unknown:
        raise ValueError(f"trajectory record has unknown fields {sorted(unknown)}")
    return Trajectory(**record)
