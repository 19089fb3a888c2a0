"""Bounded capture of a call's stdout/stderr: keep the head and the tail, count what was dropped."""

from __future__ import annotations


class StreamCapture:
    """Keeps at most ``keep_bytes`` of a byte stream: the first half and the last half.

    Memory stays O(keep_bytes) however much the call writes. ``text()`` decodes with replacement characters,
    so undecodable output never becomes an error, and marks the omitted middle.
    """

    def __init__(self, keep_bytes: int):
        if keep_bytes < 2:
            raise ValueError(f"keep_bytes must be >= 2, got {keep_bytes}")
        self.head_limit = keep_bytes // 2
        self.tail_limit = keep_bytes - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            # Trim only when twice over, so a stream of small writes costs amortised O(1) per byte.
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: -self.tail_limit]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit :])
        omitted = self.total - len(self.head) - len(tail)
        if omitted <= 0:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        marker = f"\n[... sandbox: {omitted} bytes of output omitted ...]\n"
        return (
            bytes(self.head).decode("utf-8", errors="replace")
            + marker
            + tail.decode("utf-8", errors="replace")
        )
