"""The scheduler's one account of the KV pool: which pages each slot holds, which it may still take, which are
free, and which prefixes may be reused.

Every page of the pool (but the null page) is, at any time, exactly one of

* **held** by one or more slots (the :class:`~rstar2jax.engine.pages.PageAllocator`'s page tables and
  reference counts);
* **promised**: not taken yet, but counted against the pool for an admitted sequence, which takes it as it
  grows (:attr:`PageLedger.promised`, per slot: a sequence is admitted only with every page it can ever take
  promised, so nothing admitted ever waits for a page);
* **free**: neither (cached prefix pages count as free: they are evicted when needed).

A group is promised, at admission, its prompt's pages (but whole pages of a prefix already in the pool),
a private copy of the prompt's last page per sibling and each session's response budget
(:func:`~rstar2jax.engine.requests.pages_needed`); each page taken from the pool is taken from its slot's
promise, and pages a paused sequence gives back return to it.

New weights make the prefix cache's keys/values stale: :meth:`PageLedger.forget_prefixes` unregisters every
page and keeps the slots then holding pages (written with the old weights) out of the cache for good.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.requests import pages_needed

__all__ = ["PageLedger"]


class PageLedger:
    """Held, promised and free pages of one engine's pool, and its prefix cache (with
    ``EngineConfig.prefix_sharing``).

    Attributes:
      allocator: the page tables, reference counts, free list and prefix cache.
      promised: int ``[num_slots]``: pages each slot may still take from the pool.
    """

    def __init__(self, engine_config: EngineConfig):
        self.engine_config = engine_config
        self.allocator = PageAllocator.of(engine_config)
        self.promised = np.zeros((engine_config.num_slots,), np.int64)
        self._stale: set[int] = set()  # slots holding keys/values of earlier weights: never registered
        self._fresh: set[int] = set()  # pages written again with new weights (``on_update="recompute"``)

    @property
    def reserved(self) -> int:
        """Pages promised to admitted sequences, not yet taken from the pool."""
        return int(self.promised.sum())

    @property
    def num_free(self) -> int:
        """Pages neither held by a sequence nor promised to one (cached pages count as free)."""
        return self.allocator.num_free - self.reserved

    def shared_prefix(self, prompt_ids: Sequence[int]) -> list[int]:
        """Pages of the pool holding the longest whole-page prefix of ``prompt_ids`` (none without the prefix
        cache)."""
        return self.allocator.match(prompt_ids) if self.engine_config.prefix_sharing else []

    def group_cost(self, prompt_ids: Sequence[int], n: int, max_tokens: int) -> tuple[list[int], int]:
        """The prefix pages a group would attach, and the free pages admitting it takes: those it may ever
        take from the pool, plus the cached pages it attaches (they stop counting as free)."""
        shared = self.shared_prefix(prompt_ids)
        needed = pages_needed(self.engine_config, len(prompt_ids), n, max_tokens, shared=len(shared))
        return shared, needed + self.allocator.num_cached_in(shared)

    def promise(self, slot: int, num_pages: int) -> None:
        self.promised[slot] += num_pages

    def attach(self, slot: int, pages: list[int]) -> list[tuple[int, int]]:
        """Put shared prefix ``pages`` at the start of ``slot``'s empty row; returns its ``(column, page)``
        entries."""
        self.allocator.attach(slot, pages)
        return list(enumerate(pages))

    def grow(self, slot: int, num_tokens: int) -> list[tuple[int, int]]:
        """Take pages (promised) for ``num_tokens`` tokens of ``slot``; returns the new ``(column, page)``
        entries of its row."""
        new = self.allocator.grow(slot, num_tokens)
        self._fresh.difference_update(page for _, page in new)  # a page reused: its contents are gone
        self.promised[slot] -= len(new)
        if self.promised[slot] < 0:
            raise AssertionError(f"slot {slot} took more pages than promised")
        return new

    def fork(self, source: int, siblings: Sequence[int], seq_len: int) -> list[tuple[int, int]]:
        """Siblings share ``source``'s full pages and take a private copy (promised) of the page of position
        ``seq_len - 1``; returns the ``(source page, copy)`` pairs."""
        copies = self.allocator.fork(source, siblings, seq_len)
        self._fresh.difference_update(copy for _, copy in copies)
        self.promised[list(siblings)] -= 1
        return copies

    def shrink(self, slot: int, num_tokens: int) -> list[int]:
        """Give back ``slot``'s pages past those of ``num_tokens`` tokens (given ahead of a decode that
        stopped sooner); they return to its promise. Returns them."""
        freed = self.allocator.shrink(slot, num_tokens)
        self.promised[slot] += len(freed)
        return freed

    def release(self, slot: int, tokens: Sequence[int], num_kv: int) -> list[int]:
        """Free ``slot``: its written whole pages stay findable (a chat's next turn hits), its promise ends.
        Returns the pages that became free."""
        self.register(slot, tokens, num_kv)
        self._stale.discard(slot)
        self.promised[slot] = 0
        freed = self.allocator.release(slot)
        self._fresh.difference_update(freed)
        return freed

    def register(self, slot: int, tokens: Sequence[int], num_kv: int) -> None:
        """Make ``slot``'s whole pages of the first ``num_kv`` tokens findable by later prompts (with the
        prefix cache, and unless they hold keys/values of earlier weights)."""
        if self.engine_config.prefix_sharing and slot not in self._stale:
            self.allocator.register(slot, tokens, num_kv)

    def forget_prefixes(self) -> None:
        """New weights: no page written before is found again (cached ones are freed), and the slots holding
        pages now never register theirs."""
        self.allocator.forget_prefixes()
        self._stale.update(np.flatnonzero(self.allocator.held).tolist())

    def mark_fresh(self, slot: int, num_tokens: int) -> None:
        """The keys/values of ``slot``'s first ``num_tokens`` tokens are written with the new weights."""
        self._fresh.update(self.allocator.table[slot, : num_tokens // self.allocator.page_size].tolist())

    def fresh_tokens(self, slot: int) -> int:
        """Tokens of ``slot``'s leading whole pages written with the new weights (by a sequence sharing
        them)."""
        held = self.allocator.table[slot, : self.allocator.held[slot]].tolist()
        count = next((i for i, page in enumerate(held) if page not in self._fresh), len(held))
        return count * self.allocator.page_size

    def forget_fresh(self) -> None:
        """No page counts as written with the new weights (a recompute begins or ends)."""
        self._fresh.clear()
