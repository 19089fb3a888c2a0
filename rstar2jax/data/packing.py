"""Packing variable-length sequences into fixed-length rows: first-fit decreasing.

Sequences are placed longest first, each into the first row with room for it (a new row when none has), which
uses at most 11/9 OPT + 6/9 rows (Dósa 2007) where first-fit in arrival order can need 1.7 OPT. The rows
are then ordered by their earliest sequence and each row's sequences by arrival, so the layout reads in the
input's order as far as the packing allows and depends on nothing but the widths.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_fit_decreasing(widths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sequence indices (ascending in each row, rows by their first index) with
    ``sum(widths[i] for i in row) <= capacity``.

    Raises:
      ValueError naming the sequence when one is wider than ``capacity`` or has a negative width.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for i, width in enumerate(widths):
        if width < 0 or width > capacity:
            raise ValueError(f"sequence {i} needs {width} positions; a row holds {capacity}")
    order = sorted(range(len(widths)), key=lambda i: (-widths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        row = next((r for r, room in enumerate(free) if widths[i] <= room), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= widths[i]
    rows = [sorted(row) for row in rows]
    rows.sort(key=lambda row: row[0])
    return rows
