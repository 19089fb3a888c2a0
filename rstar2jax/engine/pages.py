"""Host-side page bookkeeping of the paged KV pool: free list, reference counts, page tables, prefix index.

A slot holding ``n`` tokens (its pending last token included) holds ``ceil(n / page_size)`` pages, in position
order in its page-table row. Writes only ever go to the page of position ``seq_len - 1`` and later pages
(:mod:`rstar2jax.engine.state`), so those are private to the slot; pages before it may be shared:

* :meth:`PageAllocator.fork`: siblings share the source's full pages (reference counts) and get a private
  copy of the page holding its pending token (the only page that may be partly filled);
* :meth:`PageAllocator.attach`: a new sequence whose prompt starts with the same whole pages as a prompt
  already in the pool (:meth:`PageAllocator.register`) takes those pages instead of prefilling them again.

A page is free once no slot holds it. :class:`PageAllocator` only does arithmetic on NumPy arrays; the engine
pushes changed rows to the device (:func:`~rstar2jax.engine.ops.set_pages`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.paged_attention import NULL_PAGE


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Free list, reference counts and page tables of ``num_slots`` slots over ``num_pages`` pages.

    Attributes:
      table: int32 ``[num_slots, max_pages]``: each slot's pages; :data:`NULL_PAGE` past its end.
      held: int ``[num_slots]``: pages in each row.
      refcount: int ``[num_pages]``: rows holding each page.
      dirty: slots whose row changed since :meth:`take_dirty`.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages: int):
        self.page_size = page_size
        self.table = np.full((num_slots, max_pages), NULL_PAGE, np.int32)
        self.held = np.zeros((num_slots,), np.int64)
        self.refcount = np.zeros((num_pages,), np.int64)
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # a stack: low page ids first
        self.dirty: set[int] = set()
        self._digest_of: dict[int, bytes] = {}  # registered page -> prefix digest
        self._page_of: dict[bytes, int] = {}  # prefix digest -> page

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by at least one slot."""
        return len(self.refcount) - 1 - len(self._free)

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("the page pool is exhausted (the scheduler admits work only when it fits)")
        page = self._free.pop()
        self.refcount[page] = 1
        return page

    def grow(self, slot: int, num_tokens: int) -> list[int]:
        """Give ``slot`` pages for ``num_tokens`` tokens (never shrinks); returns the new pages."""
        needed = pages_for(num_tokens, self.page_size)
        if needed > self.table.shape[1]:
            raise ValueError(f"{num_tokens} tokens exceed the page table ({self.table.shape[1]} pages)")
        new = [self._take() for _ in range(int(needed - self.held[slot]))]
        if new:
            self.table[slot, self.held[slot] : needed] = new
            self.held[slot] = needed
            self.dirty.add(slot)
        return new

    def fork(self, src: int, dsts: Sequence[int], seq_len: int) -> list[tuple[int, int]]:
        """Make each of ``dsts`` (empty rows) share ``src``'s pages before the page of position
        ``seq_len - 1`` and hold a private copy of that one. ``src`` must hold exactly the pages of its
        ``seq_len`` tokens. Returns the ``(source page, copy)`` pairs for the device to copy."""
        pending = (seq_len - 1) // self.page_size
        if self.held[src] != pending + 1:
            raise ValueError(f"slot {src} holds {self.held[src]} pages, not those of its {seq_len} tokens")
        copies = []
        for dst in dsts:
            if self.held[dst]:
                raise ValueError(f"fork destination slot {dst} already holds pages")
            shared = self.table[src, :pending]
            self.refcount[shared] += 1
            copy = self._take()
            self.table[dst, :pending] = shared
            self.table[dst, pending] = copy
            self.held[dst] = pending + 1
            self.dirty.add(dst)
            copies.append((int(self.table[src, pending]), copy))
        return copies

    def release(self, slot: int) -> list[int]:
        """Drop ``slot``'s row; returns the pages that became free."""
        pages = self.table[slot, : self.held[slot]].copy()
        self.table[slot] = NULL_PAGE
        self.held[slot] = 0
        self.refcount[pages] -= 1
        freed = [int(p) for p in pages if self.refcount[p] == 0]
        for page in freed:
            digest = self._digest_of.pop(page, None)
            if digest is not None:
                del self._page_of[digest]
        self._free.extend(reversed(freed))
        return freed

    # ---- prefix sharing

    def _digests(self, tokens: Sequence[int], num_pages: int):
        """Digest of each whole page of ``tokens`` with everything before it (a hash chain)."""
        digest = b""
        for i in range(num_pages):
            block = np.asarray(tokens[i * self.page_size : (i + 1) * self.page_size], np.int64).tobytes()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            yield digest

    def register(self, slot: int, tokens: Sequence[int], num_kv: int) -> None:
        """Record the whole pages of ``slot`` whose keys/values are written (``num_kv`` tokens of ``tokens``),
        so that later prompts with the same prefix can :meth:`attach` them."""
        for i, digest in enumerate(self._digests(tokens, num_kv // self.page_size)):
            page = int(self.table[slot, i])
            if digest not in self._page_of and page not in self._digest_of:
                self._page_of[digest] = page
                self._digest_of[page] = digest

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Registered pages holding the longest whole-page prefix of ``tokens`` that leaves at least one token
        (the pending one) after it."""
        pages = []
        for digest in self._digests(tokens, (len(tokens) - 1) // self.page_size):
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def attach(self, slot: int, pages: Sequence[int]) -> None:
        """Put shared ``pages`` at the start of ``slot``'s (empty) row."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} already holds pages")
        self.table[slot, : len(pages)] = pages
        self.refcount[list(pages)] += 1
        self.held[slot] = len(pages)
        self.dirty.add(slot)

    def take_dirty(self) -> list[int]:
        dirty, self.dirty = sorted(self.dirty), set()
        return dirty
