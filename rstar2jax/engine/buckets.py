"""Token buckets: the static shapes of one device step (:class:`StepLayout`, one compiled program each) and
the choice of the smallest bucket that holds a step's work (:func:`choose_bucket`).

Both sides of the engine import this module: the host side (scheduler, plan, outbox) picks a bucket and
names it in the plan, the device side (:mod:`~rstar2jax.engine.step`, the runner, the program cache)
compiles and fills it. It holds shapes and NumPy packing only, no device code, so planning a step never
imports the step program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.state import NO_TOKEN

__all__ = ["StepLayout", "bucket_layouts", "choose_bucket"]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static shapes of one bucket's step inputs, and their packing into one int32 and one float32 buffer.

    Attributes:
      tokens: T, the bucket (flat tokens per step).
      num_slots: S. rows: R1 = min(T, S), single-query attention rows (and decode rows of the loop).
      tiles, tile: R2 = T // Q tiles of Q = ``prefill_tile`` tokens.
      updates (U = S): slot records; forks (S): page-table rows copied, with one entry each; entries
      (2 S + max_pages): page-table entries; copies (S): pages copied; poison: P when freed pages are
      poisoned, else 0.
      iterations: C = ``decode_chunk``, device iterations at most (the ragged one included).
      greedy: the program samples every row greedily, whatever its slot's settings (compiled in about half
        the time: the host runs it only while no sequence samples).
    """

    tokens: int
    num_slots: int
    tile: int
    max_pages: int
    max_stops: int
    max_stop_len: int
    num_pages: int
    poison: bool
    iterations: int
    greedy: bool = False

    @classmethod
    def of(cls, engine_config: EngineConfig, tokens: int) -> StepLayout:
        cfg = engine_config
        return cls(tokens, cfg.num_slots, cfg.prefill_tile, cfg.max_pages, cfg.max_stops, cfg.max_stop_len,
                   cfg.pool_pages, cfg.poison_freed_pages, cfg.decode_chunk)

    @property
    def rows(self) -> int:
        return min(self.tokens, self.num_slots)

    @property
    def tiles(self) -> int:
        return self.tokens // self.tile

    @property
    def num_entries(self) -> int:
        return 2 * self.num_slots + self.max_pages

    @functools.cached_property
    def int_fields(self) -> dict[str, tuple[int, ...]]:
        S, W, T = self.num_slots, self.max_stop_len, self.tokens
        return {
            "upd_slot": (S,), "upd_clear": (S,), "upd_status": (S,), "upd_seq_len": (S,),
            "upd_last_token": (S,), "upd_recent": (S, W), "upd_seed": (S,), "upd_top_k": (S,),
            "upd_budget_end": (S,), "upd_segment_start": (S,), "upd_segment_end": (S,),
            "upd_stop_seqs": (S, self.max_stops, W),
            "fork_src": (S,), "fork_dst": (S,), "fork_col": (S,), "fork_page": (S,),
            "entry_slot": (self.num_entries,), "entry_col": (self.num_entries,),
            "entry_page": (self.num_entries,),
            "copy_src": (S,), "copy_dst": (S,),
            "poison": (self.num_pages if self.poison else 0,),
            "tok_slot": (T,), "tok_pos": (T,), "tok_id": (T,),
            "row_token": (self.rows,), "tile_token": (self.tiles, self.tile),
            "num_decode": (1,),
        }  # fmt: skip

    @functools.cached_property
    def float_fields(self) -> dict[str, tuple[int, ...]]:
        return {"upd_temperature": (self.num_slots,), "upd_top_p": (self.num_slots,)}

    @functools.cached_property
    def _offsets(self) -> tuple[dict, int, dict, int]:
        """(int field offsets, int buffer size, float field offsets, float buffer size)."""
        out = []
        for fields in (self.int_fields, self.float_fields):
            offsets, total = {}, 0
            for name, shape in fields.items():
                offsets[name] = (total, total + math.prod(shape), shape)
                total += math.prod(shape)
            out += [offsets, total]
        return tuple(out)

    @functools.cached_property
    def _padding(self) -> tuple[np.ndarray, np.ndarray]:
        _, int_total, _, float_total = self._offsets
        ints, floats = np.zeros((int_total,), np.int32), np.zeros((float_total,), np.float32)
        view = self.views(ints, floats)
        for name in ("upd_slot", "fork_dst", "entry_slot", "tok_slot"):
            view[name][...] = self.num_slots
        view["copy_dst"][...] = self.num_pages
        view["row_token"][...] = self.tokens
        view["tile_token"][...] = self.tokens
        view["upd_recent"][...] = NO_TOKEN
        view["upd_stop_seqs"][...] = NO_TOKEN
        return ints, floats

    def padding(self) -> tuple[np.ndarray, np.ndarray]:
        """Buffers of a step that does nothing (every entry padding): fill their :meth:`views`."""
        ints, floats = self._padding
        return ints.copy(), floats.copy()

    def views(self, ints, floats) -> dict:
        """Named views (NumPy) or slices (jnp) of the two buffers."""
        int_offsets, _, float_offsets, _ = self._offsets
        out = {}
        for offsets, buffer in ((int_offsets, ints), (float_offsets, floats)):
            for name, (start, end, shape) in offsets.items():
                out[name] = buffer[start:end].reshape(shape)
        return out

    @property
    def buffer_sizes(self) -> tuple[int, int]:
        """Entries of the int32 and of the float32 input buffer."""
        _, int_total, _, float_total = self._offsets
        return int_total, float_total


def bucket_layouts(engine_config: EngineConfig) -> tuple[StepLayout, ...]:
    """The layout of each of ``engine_config.token_buckets``, smallest first."""
    return tuple(StepLayout.of(engine_config, tokens) for tokens in engine_config.token_buckets)


def choose_bucket(layouts: tuple[StepLayout, ...], tokens: int, rows: int, tiles: int) -> StepLayout:
    """The first of ``layouts`` (smallest first) with room for ``tokens`` flat tokens, ``rows`` single-query
    rows and ``tiles`` prefill tiles."""
    for layout in layouts:
        if layout.tokens >= tokens and layout.rows >= rows and layout.tiles >= tiles:
            return layout
    raise AssertionError(f"no bucket holds {tokens} tokens, {rows} rows, {tiles} tiles")
