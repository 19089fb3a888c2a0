"""What the server counts, and ``GET /metrics`` in the two forms it is read in: Prometheus' text exposition
format (version 0.0.4, what Prometheus and most scrapers parse) and a JSON object.

Every sample carries the label ``model_name``. Counters count since the server started; histograms are
cumulative, with vLLM's buckets for the latencies. ``render_prometheus`` lists them (``# HELP`` / ``# TYPE``
lines, counters ending in ``_total``); :data:`METRICS` is the list the README documents.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["METRICS", "Histogram", "ServerMetrics", "render_prometheus", "wants_json"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

#: name -> (type, help) of every metric, without the ``rstar2jax_`` prefix.
METRICS = {
    "requests_running": ("gauge", "Requests generating (their choices hold engine slots)."),
    "requests_waiting": ("gauge", "Requests accepted and not generating yet (being read or in the engine's "
                                  "queue); --max_waiting bounds them."),
    "kv_pages_used": ("gauge", "KV cache pages held by sequences."),
    "kv_pages_cached": ("gauge", "KV cache pages no sequence holds that keep a prefix for the prefix cache."),
    "kv_pages_free": ("gauge", "KV cache pages neither held nor cached."),
    "kv_pages_total": ("gauge", "KV cache pages of the pool (used + cached + free)."),
    "slots_used": ("gauge", "Engine slots holding a sequence."),
    "slots_total": ("gauge", "Engine slots (sequences decoded side by side)."),
    "prefix_cache_hit_rate": ("gauge", "Prompt tokens served by the prefix cache over all prompt tokens."),
    "draining": ("gauge", "1 while the server drains after SIGTERM / Ctrl-C."),
    "requests": ("counter", "Requests that reached the engine."),
    "requests_rejected": ("counter", "Requests refused by reason: queue_full (429), draining (503)."),
    "prompt_tokens": ("counter", "Prompt tokens of the requests that reached the engine."),
    "prompt_tokens_cached": ("counter", "Prompt tokens whose keys/values came from the prefix cache."),
    "generation_tokens": ("counter", "Tokens sampled, every choice."),
    "choices_finished": ("counter", "Choices by finish_reason: stop, length, tool_calls, abort (ended by a "
                                    "drain), cancelled (client gone or a failure)."),
    "time_to_first_token_seconds": ("histogram", "From a request's arrival to each choice's first token."),
    "inter_token_latency_seconds": ("histogram", "Between a choice's tokens (each arriving chunk's wait over "
                                                 "its tokens)."),
    "request_queue_time_seconds": ("histogram", "From a request's arrival to its admission by the engine."),
    "e2e_request_latency_seconds": ("histogram", "From a request's arrival to its last byte."),
}
_PREFIX = "rstar2jax_"
#: The counters of :attr:`ServerMetrics.counts` (the JSON keys since the server's first version).
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cancelled_choices")


class Histogram:
    """A cumulative histogram with fixed upper bounds (and ``+Inf``)."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Records ``value`` ``times`` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of observations <= le)`` per bucket, ``+Inf`` last."""
        bounds = [_number(b) for b in self.bounds] + ["+Inf"]
        running, out = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class ServerMetrics:
    """The server's counters, gauges it keeps itself (``running``, ``waiting``) and latency histograms.

    ``counts`` holds :data:`COUNTS`: ``requests``, ``prompt_tokens``, ``cached_tokens`` (of them, served by
    the prefix cache), ``completion_tokens`` and ``cancelled_choices``; ``finished`` the choices by finish
    reason, ``rejected`` the refused requests by reason.
    """

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.finished: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()
        self.running = 0
        self.waiting = 0
        self.draining = False
        self.histograms = {
            "time_to_first_token_seconds": Histogram(_TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(_ITL_BUCKETS),
            "request_queue_time_seconds": Histogram(_REQUEST_BUCKETS),
            "e2e_request_latency_seconds": Histogram(_REQUEST_BUCKETS),
        }

    def observe(self, name: str, value: float, times: int = 1) -> None:
        self.histograms[name].observe(value, times)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.counts["cached_tokens"] / max(self.counts["prompt_tokens"], 1)

    def gauges(self, engine: Mapping[str, int]) -> dict[str, float]:
        """Every gauge: the server's own and ``engine``'s (``kv_pages_*``, ``slots_*``)."""
        return {"requests_running": self.running, "requests_waiting": self.waiting, **engine,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate, "draining": int(self.draining)}

    def as_json(self, engine: Mapping[str, int]) -> dict:
        """The JSON form: the counters, ``prefix_cache_hit_rate``, the gauges, the refusals and finish
        reasons, and each histogram's count and mean."""
        return {
            **{key: self.counts[key] for key in COUNTS},
            **self.gauges(engine),
            "rejected": dict(self.rejected),
            "finish_reasons": dict(self.finished),
            **{name: {"count": h.count, "mean": h.mean} for name, h in self.histograms.items()},
        }

    def samples(self, engine: Mapping[str, int]) -> dict[str, list[tuple[dict, float]]]:
        """Metric name (of :data:`METRICS`) -> its ``(labels, value)`` samples (histograms apart)."""
        counts = self.counts
        out: dict[str, list[tuple[dict, float]]] = {
            name: [({}, value)] for name, value in self.gauges(engine).items()
        }
        out.update({
            "requests": [({}, counts["requests"])],
            "requests_rejected": [({"reason": r}, n) for r, n in sorted(self.rejected.items())],
            "prompt_tokens": [({}, counts["prompt_tokens"])],
            "prompt_tokens_cached": [({}, counts["cached_tokens"])],
            "generation_tokens": [({}, counts["completion_tokens"])],
            "choices_finished": [({"finish_reason": r}, n) for r, n in sorted(self.finished.items())],
        })
        return out


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def render_prometheus(metrics: ServerMetrics, engine: Mapping[str, int], labels: Mapping[str, str]) -> str:
    """The text exposition format (0.0.4) of ``metrics`` and the ``engine`` gauges, every sample labelled
    with ``labels`` (``{"model_name": ...}``)."""
    samples = metrics.samples(engine)
    lines: list[str] = []
    for name, (kind, text) in METRICS.items():
        full = _PREFIX + name
        lines += [f"# HELP {full}{'_total' if kind == 'counter' else ''} {text}",
                  f"# TYPE {full}{'_total' if kind == 'counter' else ''} {kind}"]
        if kind == "histogram":
            lines += _histogram_lines(full, metrics.histograms[name], labels)
            continue
        suffix = "_total" if kind == "counter" else ""
        for extra, value in samples[name]:
            lines.append(f"{full}{suffix}{_labels({**labels, **extra})} {_number(value)}")
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, histogram: Histogram, labels: Mapping[str, str]) -> Iterable[str]:
    for bound, count in histogram.cumulative():
        yield f"{name}_bucket{_labels({**labels, 'le': bound})} {count}"
    yield f"{name}_sum{_labels(labels)} {_number(histogram.sum)}"
    yield f"{name}_count{_labels(labels)} {histogram.count}"


def wants_json(format: str | None, accept: str) -> bool:
    """Whether ``/metrics`` answers JSON: ``format`` (the ``?format=`` parameter: ``json`` or ``prometheus``)
    when given, else whether the ``Accept`` header prefers ``application/json`` to ``text/plain`` and
    ``application/openmetrics-text`` (so scrapers and ``curl`` get the text format). ValueError for another
    ``format``."""
    if format is not None:
        if format not in ("json", "prometheus"):
            raise ValueError(f"format={format!r}: expected json or prometheus")
        return format == "json"
    best: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        try:
            q = next((float(p[2:]) for p in params if p.startswith("q=")), 1.0)
        except ValueError:
            continue
        best[media] = max(best.get(media, 0.0), q)
    text = max(best.get("text/plain", 0.0), best.get("application/openmetrics-text", 0.0))
    return best.get("application/json", 0.0) > text
