"""Checks and page arithmetic of the engine's requests, on the host before any work: a request that could
never be admitted, or a stop list that does not fit, is refused in the caller's frame."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.config import EngineConfig, pages_for
from rstar2jax.engine.state import NO_TOKEN

__all__ = ["check_request", "pages_needed", "stop_table"]


def stop_table(engine_config: EngineConfig, stop: Sequence[Sequence[int]]) -> np.ndarray:
    """``[max_stops, max_stop_len]`` right-aligned stop table, read-only (plans carry it as a value); raises
    ValueError if it does not fit."""
    cfg = engine_config
    table = np.full((cfg.max_stops, cfg.max_stop_len), NO_TOKEN, np.int32)
    if len(stop) > cfg.max_stops:
        raise ValueError(f"{len(stop)} stop sequences given; this engine takes at most {cfg.max_stops}")
    for row, seq in zip(table, stop, strict=False):
        seq = [int(t) for t in seq]
        if not 0 < len(seq) <= cfg.max_stop_len or min(seq) < 0:
            raise ValueError(f"stop sequence {seq} must be 1..{cfg.max_stop_len} non-negative token ids")
        row[cfg.max_stop_len - len(seq) :] = seq
    table.setflags(write=False)
    return table


def pages_needed(engine_config: EngineConfig, prompt_len: int, n: int, max_tokens: int, *,
                 shared: int = 0) -> int:
    """Pages a group can ever take from the pool: its prompt's (but ``shared`` whole pages already in the
    pool), a private copy of the prompt's last page per sibling, and each session's response budget."""
    ps = engine_config.page_size
    prompt_pages = pages_for(prompt_len, ps)
    growth = pages_for(prompt_len + max_tokens, ps) - prompt_pages
    return prompt_pages - shared + (n - 1) + n * growth


def check_request(engine_config: EngineConfig, vocab_size: int, prompt_ids: Sequence[int], n: int,
                  max_tokens: int) -> None:
    """Raise ValueError for a request that could never be admitted."""
    cfg = engine_config
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if len(prompt_ids) + max_tokens > cfg.max_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"slot capacity max_len={cfg.max_len}"
        )
    if not isinstance(n, int) or not 1 <= n <= cfg.num_slots:
        raise ValueError(f"n={n} must be in [1, num_slots={cfg.num_slots}]")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, vocab_size={vocab_size})")
    needed, pool = pages_needed(cfg, len(prompt_ids), n, max_tokens), cfg.pool_pages - 1
    if needed > pool:
        raise ValueError(
            f"a group of {n} with a {len(prompt_ids)}-token prompt and max_tokens={max_tokens} needs "
            f"{needed} KV pages of {cfg.page_size} tokens; the pool holds only {pool} "
            "(raise EngineConfig.num_pages)"
        )
