"""Token-entropy analysis of agentic rollouts (the paper's section 5): which sampled tokens are uncertain,
and are they the ones that react to a tool's output?

Every sampled response token carries the entropy of the policy distribution it was drawn from
(``Trajectory.entropies``)::

    H_t = -sum_v p(v | x_<t) log p(v | x_<t)

The paper splits the highest-entropy tokens in two: *forking* tokens (uncertainty inside the model's own
reasoning) and *reflection* tokens (uncertainty right after a tool response, where the model decides what to
make of the output). Here a sampled token is a reflection token when it is among the first
``reflection_window`` sampled tokens after an inserted run of the response (a tool response and the turn
markers around it); every other sampled token is a forking candidate. The headline compares the share of
reflection tokens among the top ``top_fraction`` by entropy with their share among all sampled tokens: a
ratio above 1 says tool feedback concentrates the policy's uncertainty.

Pure NumPy on host; nothing here needs a device.
"""

from __future__ import annotations

import collections
import dataclasses
import html
from collections.abc import Callable, Sequence

import numpy as np

from rstar2jax.data.trajectory import Trajectory


def reflection_mask(loss_mask: Sequence[int], window: int) -> np.ndarray:
    """bool per response token: True on the first ``window`` sampled tokens (``loss_mask`` 1) that follow
    each inserted run (``loss_mask`` 0, a tool response), False elsewhere (the first turn has none)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    mask = np.asarray(loss_mask, np.int64)
    if mask.ndim != 1 or not np.isin(mask, (0, 1)).all():
        raise ValueError("loss_mask must be a 1-D sequence of 0/1")
    out = np.zeros(mask.shape, bool)
    left = 0  # sampled tokens still to mark after the last inserted run
    for i, m in enumerate(mask):
        if m == 0:
            left = window
        elif left:
            out[i] = True
            left -= 1
    return out


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """The sampled response tokens of a set of trajectories, flattened in order (one entry per token).

    Attributes:
      token_ids: int64 ``[N]`` token ids.
      entropies: float64 ``[N]`` sampling entropies (nats).
      reflection: bool ``[N]`` reflection token (see :func:`reflection_mask`).
      trajectory: int64 ``[N]`` index of the trajectory in the input.
      position: int64 ``[N]`` index in that trajectory's response.
    """

    token_ids: np.ndarray
    entropies: np.ndarray
    reflection: np.ndarray
    trajectory: np.ndarray
    position: np.ndarray

    def __len__(self) -> int:
        return int(self.token_ids.size)


def sampled_tokens(trajectories: Sequence[Trajectory], reflection_window: int = 8) -> SampledTokens:
    """The sampled tokens of ``trajectories`` with their entropies and reflection flags. Raises
    ``ValueError`` naming the first trajectory without recorded entropies."""
    parts = collections.defaultdict(list)
    for k, t in enumerate(trajectories):
        if t.entropies is None:
            raise ValueError(f"trajectory {k} ({t.problem_id}) has no entropies: roll out with the engine")
        sampled = np.asarray(t.loss_mask, bool)
        parts["token_ids"].append(np.asarray(t.response_ids, np.int64)[sampled])
        parts["entropies"].append(np.asarray(t.entropies, np.float64)[sampled])
        parts["reflection"].append(reflection_mask(t.loss_mask, reflection_window)[sampled])
        parts["trajectory"].append(np.full(int(sampled.sum()), k, np.int64))
        parts["position"].append(np.flatnonzero(sampled).astype(np.int64))
    empty = {"token_ids": np.int64, "entropies": np.float64, "reflection": bool, "trajectory": np.int64,
             "position": np.int64}
    return SampledTokens(**{
        name: np.concatenate(parts[name]) if parts[name] else np.zeros((0,), dtype)
        for name, dtype in empty.items()
    })


@dataclasses.dataclass(frozen=True)
class EntropySplit:
    """The top ``top_fraction`` of sampled tokens by entropy, split into reflection and forking tokens.

    Attributes:
      threshold: the smallest entropy among the top tokens.
      top: bool ``[N]`` over :class:`SampledTokens`: the top tokens (exactly ``round(top_fraction * N)``,
        at least one; ties broken by order).
      reflection_share_of_top: reflection tokens / top tokens.
      reflection_share_of_all: reflection tokens / all sampled tokens.
      mean_entropy, mean_entropy_reflection, mean_entropy_forking: over all sampled tokens, the
        reflection ones, the others (NaN for an empty set).
    """

    top_fraction: float
    threshold: float
    top: np.ndarray
    reflection_share_of_top: float
    reflection_share_of_all: float
    mean_entropy: float
    mean_entropy_reflection: float
    mean_entropy_forking: float

    @property
    def enrichment(self) -> float:
        """How many times more common reflection tokens are among the top tokens than overall."""
        if not self.reflection_share_of_all:
            return float("nan")
        return self.reflection_share_of_top / self.reflection_share_of_all


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


def high_entropy_split(tokens: SampledTokens, top_fraction: float = 0.2) -> EntropySplit:
    """The top ``top_fraction`` of ``tokens`` by entropy and how many of them are reflection tokens."""
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    n = len(tokens)
    if n == 0:
        raise ValueError("no sampled tokens to analyse")
    k = max(1, round(top_fraction * n))
    order = np.argsort(-tokens.entropies, kind="stable")
    top = np.zeros(n, bool)
    top[order[:k]] = True
    e, r = tokens.entropies, tokens.reflection
    return EntropySplit(
        top_fraction=top_fraction,
        threshold=float(e[order[k - 1]]),
        top=top,
        reflection_share_of_top=float(r[top].mean()),
        reflection_share_of_all=float(r.mean()),
        mean_entropy=_mean(e),
        mean_entropy_reflection=_mean(e[r]),
        mean_entropy_forking=_mean(e[~r]),
    )


def common_words(
    token_ids: np.ndarray, decode: Callable[[list[int]], str], n: int = 15
) -> list[tuple[str, int]]:
    """The ``n`` most common tokens of ``token_ids`` as text (each decoded alone and stripped; whitespace-only
    tokens are shown as their ``repr``), with their counts."""
    counts = collections.Counter(int(i) for i in token_ids)
    words: collections.Counter[str] = collections.Counter()
    for token, count in counts.items():
        text = decode([token])
        words[text.strip() or repr(text)] += count
    return words.most_common(n)


def entropy_html(
    trajectory: Trajectory,
    decode: Callable[[list[int]], str],
    max_entropy: float | None = None,
) -> str:
    """The response of ``trajectory`` as HTML: each sampled token on a background from white (entropy 0)
    to red (``max_entropy``, default the trajectory's largest), its entropy in the hover text; inserted
    tokens (tool responses, turn markers) in grey."""
    if trajectory.entropies is None:
        raise ValueError(f"trajectory {trajectory.problem_id} has no entropies")
    entropies = np.asarray(trajectory.entropies, np.float64)
    top = max_entropy if max_entropy is not None else float(entropies.max(initial=0.0))
    pieces = []
    for token, sampled, h in zip(trajectory.response_ids, trajectory.loss_mask, entropies, strict=True):
        text = html.escape(decode([token]))
        if not sampled:
            pieces.append(f'<span style="color:#999">{text}</span>')
            continue
        level = min(h / top, 1.0) if top > 0 else 0.0
        fade = round(255 * (1 - level))
        pieces.append(f'<span title="H={h:.3f}" style="background:rgb(255,{fade},{fade})">{text}</span>')
    return '<pre style="white-space:pre-wrap;font-size:11px;line-height:1.5">' + "".join(pieces) + "</pre>"
