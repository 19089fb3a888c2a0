"""Host-side page bookkeeping of the paged KV pool: free list, reference counts, page tables, prefix cache.

A slot holding ``n`` tokens (its pending last token included) holds ``ceil(n / page_size)`` pages, in position
order in its page-table row (and, while it decodes, a few pages ahead). Writes only ever go to the page of
position ``seq_len - 1`` and later pages (:mod:`rstar2jax.engine.state`), so those are private to the slot;
pages before it may be shared:

* :meth:`PageAllocator.fork`: siblings share the source's full pages (reference counts) and get a private
  copy of the page holding its pending token (the only page that may be partly filled);
* :meth:`PageAllocator.attach`: a new sequence whose tokens start with the same whole pages as tokens whose
  keys/values are in the pool (:meth:`PageAllocator.register`: prompts as they are prefilled, finished
  sequences when they are released) takes those pages instead of prefilling them again.

Prefix cache: a registered page that no slot holds any more is not freed but *cached*: it keeps its keys and
values and stays findable by :meth:`~PageAllocator.match`, until the pool needs a page and no free one is
left; then the least recently used cached page is evicted (unregistered and reused). A page in use is never
evicted. :attr:`~PageAllocator.num_free` counts cached pages as free. Pages are found by a hash chain: the
digest of a page covers its tokens and every token before it, so equal digests mean equal prefixes.

:class:`PageAllocator` only does arithmetic on NumPy arrays; the engine sends the changed page-table entries
to the device with its next step.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.config import EngineConfig, pages_for
from rstar2jax.engine.paged_attention import NULL_PAGE

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free list, reference counts, page tables and prefix cache of ``num_slots`` slots over ``num_pages``
    pages.

    Attributes:
      table: int32 ``[num_slots, max_pages]``: each slot's pages; :data:`NULL_PAGE` past its end.
      held: int ``[num_slots]``: pages in each row.
      refcount: int ``[num_pages]``: rows holding each page.
      cache: whether unheld registered pages stay cached (the prefix cache); False frees them at once.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages: int, *, cache: bool = True):
        self.page_size = page_size
        self.cache = cache
        self.table = np.full((num_slots, max_pages), NULL_PAGE, np.int32)
        self.held = np.zeros((num_slots,), np.int64)
        self.refcount = np.zeros((num_pages,), np.int64)
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # a stack: low page ids first
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._digest_of: dict[int, bytes] = {}  # registered page -> prefix digest
        self._page_of: dict[bytes, int] = {}  # prefix digest -> page
        self.evicted = 0  # cached pages reused for other contents

    @classmethod
    def of(cls, engine_config: EngineConfig) -> PageAllocator:
        """The allocator of an engine's pool and slots (its prefix cache on with ``prefix_sharing``)."""
        cfg = engine_config
        return cls(cfg.pool_pages, cfg.page_size, cfg.num_slots, cfg.max_pages, cache=cfg.prefix_sharing)

    @property
    def num_free(self) -> int:
        """Pages no slot holds: free and cached ones (a cached page is evicted when needed)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages no slot holds that keep their keys/values for the prefix cache."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages held by at least one slot."""
        return len(self.refcount) - 1 - self.num_free

    @property
    def free_pages(self) -> list[int]:
        """Pages no slot holds and the prefix cache does not keep (a copy, next taken last)."""
        return list(self._free)

    @property
    def cached_pages(self) -> list[int]:
        """Pages no slot holds that the prefix cache keeps (a copy, least recently used first)."""
        return list(self._cached)

    def is_registered(self, page: int) -> bool:
        """Whether ``page`` holds a prefix later prompts may find."""
        return page in self._digest_of

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._digest_of.pop(page)]
            self.evicted += 1
        else:
            raise RuntimeError("the page pool is exhausted (the scheduler admits work only when it fits)")
        self.refcount[page] = 1
        return page

    def grow(self, slot: int, num_tokens: int) -> list[tuple[int, int]]:
        """Give ``slot`` pages for ``num_tokens`` tokens (never shrinks); returns the new (column, page)
        entries of its row."""
        needed = pages_for(num_tokens, self.page_size)
        if needed > self.table.shape[1]:
            raise ValueError(f"{num_tokens} tokens exceed the page table ({self.table.shape[1]} pages)")
        start = int(self.held[slot])
        new = [(col, self._take()) for col in range(start, needed)]
        if new:
            self.table[slot, start:needed] = [page for _, page in new]
            self.held[slot] = needed
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
            copies.append((int(self.table[src, pending]), copy))
        return copies

    def shrink(self, slot: int, num_tokens: int) -> list[int]:
        """Give back ``slot``'s pages past those of ``num_tokens`` tokens (pages given ahead of a decode that
        stopped sooner: private, never written); returns them."""
        keep = pages_for(num_tokens, self.page_size)
        extra = self.table[slot, keep : self.held[slot]].tolist()
        if any(self.refcount[page] != 1 or page in self._digest_of for page in extra):
            raise ValueError(f"slot {slot} shares pages past its {num_tokens} tokens")
        self.table[slot, keep:] = NULL_PAGE
        self.held[slot] = min(int(self.held[slot]), keep)
        self.refcount[extra] = 0
        self._free.extend(reversed(extra))
        return extra

    def release(self, slot: int) -> list[int]:
        """Drop ``slot``'s row; returns the pages that became free (cached ones are not: they keep their
        contents)."""
        pages = self.table[slot, : self.held[slot]].copy()
        self.table[slot] = NULL_PAGE
        self.held[slot] = 0
        self.refcount[pages] -= 1
        freed = []
        for page in reversed(pages.tolist()):  # the deepest pages are evicted first
            if self.refcount[page]:
                continue
            if self.cache and page in self._digest_of:
                self._cached[page] = None
            else:
                self._unregister(page)
                freed.append(page)
        self._free.extend(freed)
        return freed

    def forget_prefixes(self) -> None:
        """Unregister every page (their keys/values are stale: new weights): cached pages become free."""
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._digest_of.clear()
        self._page_of.clear()

    def _unregister(self, page: int) -> None:
        digest = self._digest_of.pop(page, None)
        if digest is not None:
            del self._page_of[digest]

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
        so that later sequences with the same prefix can :meth:`attach` them."""
        num_pages = min(num_kv // self.page_size, int(self.held[slot]))
        for i, digest in enumerate(self._digests(tokens, num_pages)):
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

    def num_cached_in(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` are cached (unheld): attaching them takes them out of :attr:`num_free`."""
        return sum(page in self._cached for page in pages)

    def attach(self, slot: int, pages: Sequence[int]) -> None:
        """Put shared ``pages`` at the start of ``slot``'s (empty) row."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} already holds pages")
        for page in pages:
            self._cached.pop(page, None)
        self.table[slot, : len(pages)] = pages
        self.refcount[list(pages)] += 1
        self.held[slot] = len(pages)
