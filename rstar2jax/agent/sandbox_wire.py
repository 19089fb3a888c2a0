"""The sandbox client's side of the wire: :class:`SandboxResult` (what a call returns), batch request bodies,
and the decoding of a server's answers into results.

Each result of a batch is decoded on its own: a malformed one is a ``BadResponse`` failure for its call only,
and text that is not valid UTF-8 has its bad bytes replaced by U+FFFD. The only thing imported from the
server package is its dependency-free wire schema.
"""

from __future__ import annotations

import dataclasses
import json

import msgpack

from sandbox_server import schema


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One execution result; fields as in ``sandbox_server.schema`` (``status`` is one of ``STATUSES``)."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    error_type: str | None
    duration: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_wire(cls, obj) -> SandboxResult:
        return cls(**schema.validate_run_result(obj))

    @classmethod
    def failure(
        cls, message: str, *, status: str = "internal", error_type: str | None = None
    ) -> SandboxResult:
        return cls(**schema.make_result(status, stderr=f"sandbox client: {message}\n", error_type=error_type))


def retry_after_seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def decode_body(raw: bytes, content_type: str):
    """The response body; strings that are not valid UTF-8 keep their bytes as surrogates here and are
    repaired result by result (:func:`result_from_wire`), so one bad string never costs a whole batch."""
    if content_type == schema.CONTENT_TYPE_MSGPACK:
        try:
            return msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape", strict_map_key=False)
        except (ValueError, msgpack.UnpackException):
            pass  # error responses may be JSON
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _valid_text(text):
    """``text`` with lone surrogates (undecodable bytes or escapes) replaced by U+FFFD; other values as is."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            try:  # msgpack's undecodable bytes, as they were sent
                return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            except UnicodeEncodeError:  # lone surrogates (from JSON escapes)
                return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def result_from_wire(item, url: str) -> SandboxResult:
    """One result of a batch: a malformed one is a ``BadResponse`` failure for its own call only."""
    try:
        if isinstance(item, dict):
            item = {key: _valid_text(value) for key, value in item.items()}
        return SandboxResult.from_wire(item)
    except (schema.SchemaError, TypeError, UnicodeError) as error:
        return SandboxResult.failure(f"malformed result from {url}: {error}", error_type="BadResponse")


def encode_batch(requests: list[dict], wire: str) -> tuple[bytes, str]:
    """The body of a ``POST /run/batch`` carrying ``requests`` and its content type; ``wire`` is ``"msgpack"``
    or ``"json"``."""
    payload = {schema.BATCH_REQUESTS_KEY: requests}
    if wire == "msgpack":
        body = msgpack.packb(payload, use_bin_type=True, unicode_errors="surrogatepass")
        return body, schema.CONTENT_TYPE_MSGPACK
    return json.dumps(payload).encode(), schema.CONTENT_TYPE_JSON


def batch_results(status: int, raw: bytes, content_type: str, url: str, count: int) -> list[SandboxResult]:
    """The ``count`` results of a batch from the server's answer (HTTP ``status``, body ``raw``): one per
    call, in order; an error status or a malformed body is the same failure for every call."""
    decoded = decode_body(raw, content_type)
    if status != 200:
        message = decoded.get("error") if isinstance(decoded, dict) else None
        failure = SandboxResult.failure(
            f"HTTP {status} from {url}: {message or raw[:200]!r}", error_type=f"HTTP{status}"
        )
        return [failure] * count
    wire_results = decoded.get(schema.BATCH_RESULTS_KEY) if isinstance(decoded, dict) else None
    if not isinstance(wire_results, list) or len(wire_results) != count:
        found = len(wire_results) if isinstance(wire_results, list) else "no"
        failure = SandboxResult.failure(
            f"malformed response from {url}: {found} results for {count} requests", error_type="BadResponse"
        )
        return [failure] * count
    return [result_from_wire(item, url) for item in wire_results]
