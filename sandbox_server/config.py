"""Server configuration: every limit in one dataclass, with the command-line flags generated from it."""

from __future__ import annotations

import dataclasses
import math
import re

# Warm "tiers": each worker keeps one warm process per tier and forks a call from the lightest tier whose
# pre-imports the code mentions. Forking cost grows with the parent's resident memory (about 0.7 ms for
# the stdlib tier, 1.1 ms with numpy, 2.7 ms with sympy on the reference machine), so a trivial call should
# not pay for sympy's heap. Any call may still import anything; it then pays that import itself.
# Not "random", "statistics" or "threading": their after-fork hooks (reseeding, lock resets) would run in
# every forked call, which costs more than importing them in the few calls that need them.
STDLIB_PRELOAD = (
    "bisect", "cmath", "collections", "copy", "decimal", "fractions", "functools", "heapq", "itertools",
    "math", "operator", "re", "string",
)  # fmt: skip
# numpy 2 loads random/fft/polynomial lazily; preloading them saves each call ~15-40 ms (numpy.random is
# also touched by every call, which reseeds it).
NUMPY_PRELOAD = ("numpy", "numpy.random", "numpy.fft", "numpy.polynomial")
TIER_PRELOAD = {
    "base": STDLIB_PRELOAD,
    "numpy": STDLIB_PRELOAD + NUMPY_PRELOAD,
    "full": STDLIB_PRELOAD + NUMPY_PRELOAD + ("mpmath", "sympy"),
}
# Run once in each warm process before it forks anything: the first use of many numpy/sympy functions
# imports submodules and builds tables (sympy's first simplify() costs ~0.3 s), which every call would
# otherwise pay again. sympy's result cache is cleared afterwards, so calls start from an empty cache.
NUMPY_WARMUP = """
import numpy as np
a = np.random.rand(8, 8)
np.linalg.det(a); np.linalg.solve(a, a[0]); np.fft.fft(a[0]); np.polynomial.Polynomial([1, 2]).roots()
"""
SYMPY_WARMUP = """
import sympy as sp
x, y = sp.symbols("x y")
sp.factor(x**4 - 1); sp.expand((x + y)**5); sp.solve(x**2 - 5*x + 6, x)
sp.simplify(sp.sin(x)**2 + sp.cos(x)**2)
sp.integrate(x * sp.exp(x), x); sp.diff(sp.sin(x) * x, x); sp.limit(sp.sin(x) / x, x, 0)
sp.series(sp.exp(x), x, 0, 4); sp.nsimplify(0.75); sp.factorint(2**32 + 1); sp.Matrix([[1, 2], [3, 4]]).det()
sp.summation(x**2, (x, 1, 10)); sp.N(sp.pi, 30); sp.Poly(x**2 + 1, x).all_roots()
sp.Rational(1, 3) + sp.sqrt(8)
sp.core.cache.clear_cache()
"""
TIER_WARMUP = {"base": "", "numpy": NUMPY_WARMUP, "full": NUMPY_WARMUP + SYMPY_WARMUP}
# A tier is chosen when the code mentions one of its trigger words; "full" serves everything.
TIER_TRIGGERS = {"full": re.compile(r"\b(sympy|mpmath)\b"), "numpy": re.compile(r"\bnumpy\b")}
TIERS = ("base", "numpy", "full")
AUTO_UID_START = 1_000_000  # above the uids distributions hand out, below the 32-bit overflow ids
AUTO_UID_SERVERS = 100_000


# Values outside these pass the type checks but make every call fail (a 1-byte output cap, a timeout that
# overflows the CPU limit, a call too small to start Python): refused at start-up with the field's name.
SANE_BOUNDS = {
    "workers": (1, 256),
    "slots": (1, 1024),
    "default_timeout": (0.001, 86400.0),
    "max_timeout": (0.001, 86400.0),
    "memory_mb": (64, 1 << 20),
    "total_memory_mb": (0, 1 << 24),
    "file_size_mb": (1, 1 << 20),
    "tmp_mb": (1, 1 << 20),
    "nproc": (1, 1 << 16),
    "nofile": (16, 1 << 20),
    "max_output_bytes": (256, 1 << 30),
    "output_limit_bytes": (256, 1 << 34),
    "max_request_bytes": (1024, 1 << 34),
    "max_body_bytes_in_flight": (1024, 1 << 36),
    "max_batch": (1, 1 << 16),
    "max_queue": (1, 1 << 24),
    "max_sessions": (1, 1 << 16),
    "session_ttl": (0.001, 86400.0 * 7),
    "session_cpu_seconds": (1, 86400 * 7),
    "session_memory_mb": (64, 1 << 20),
    "header_timeout": (0.1, 3600.0),
    "body_timeout": (0.1, 3600.0),
    "write_timeout": (0.1, 3600.0),
}


def choose_tier(code: str, available: tuple[str, ...]) -> str | None:
    """The lightest available tier at least as heavy as the modules ``code`` mentions need (None: none)."""
    needed = "base"
    for tier in ("full", "numpy"):
        if TIER_TRIGGERS[tier].search(code):
            needed = tier
            break
    return next((tier for tier in TIERS[TIERS.index(needed) :] if tier in available), None)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = dataclasses.field(
        default="127.0.0.1", metadata={"help": "bind address (loopback by default)"}
    )
    port: int = dataclasses.field(default=8088, metadata={"help": "TCP port; 0 picks a free one"})
    token: str | None = dataclasses.field(
        default=None,
        metadata={"help": "bearer token required on every endpoint but /health (env SANDBOX_TOKEN)"},
    )
    workers: int = dataclasses.field(
        default=2, metadata={"help": "warm worker sets (one process per tier each)"}
    )
    # A call holds its slot while the kernel tears it down and while it waits to be reaped, with little CPU;
    # 16 keeps two cores busy where 8 left them idle at times (+7-10% calls/s, trivial and mixed).
    slots: int = dataclasses.field(default=16, metadata={"help": "calls running at once per worker"})
    tiers: str = dataclasses.field(
        default="base,numpy,full",
        metadata={"help": "warm tiers to keep, lightest first (subset of base,numpy,full)"},
    )
    default_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "wall-clock timeout (s) if unset"}
    )
    max_timeout: float = dataclasses.field(
        default=120.0, metadata={"help": "largest timeout (s) a request may ask"}
    )
    memory_mb: int = dataclasses.field(
        default=1024, metadata={"help": "address-space limit per call process, MiB (RLIMIT_AS, soft = hard)"}
    )
    total_memory_mb: int = dataclasses.field(
        default=6144, metadata={"help": "memory cgroup limit over all workers and their calls, MiB (0: none)"}
    )
    file_size_mb: int = dataclasses.field(default=16, metadata={"help": "largest file a call may write, MiB"})
    tmp_mb: int = dataclasses.field(default=64, metadata={"help": "size of each call's private tmpfs, MiB"})
    nproc: int = dataclasses.field(
        default=32, metadata={"help": "processes + threads per call (RLIMIT_NPROC)"}
    )
    nofile: int = dataclasses.field(
        default=256, metadata={"help": "open files per call process (RLIMIT_NOFILE)"}
    )
    max_output_bytes: int = dataclasses.field(
        default=65536, metadata={"help": "bytes kept per stream (head and tail, with an omission marker)"}
    )
    output_limit_bytes: int = dataclasses.field(
        default=8 << 20,
        metadata={"help": "total stdout+stderr bytes after which a call is killed (output_limit)"},
    )
    max_code_chars: int = dataclasses.field(default=1 << 20, metadata={"help": "largest 'code' field"})
    max_stdin_chars: int = dataclasses.field(default=8 << 20, metadata={"help": "largest 'stdin' field"})
    precompile_max_chars: int = dataclasses.field(
        default=2048,
        metadata={
            "help": "one-shot cells up to this many characters are compiled by the front end, which saves "
            "each call ~70 copy-on-write faults (~0.3 ms); longer ones compile inside the call (0: all do)"
        },
    )
    call_setup: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto: calls are forked and isolated by a fork server in C (the extension "
            "sandbox_server._spawn) when it is built, ~240 fewer copy-on-write faults per trivial call "
            "than the worker forking them itself in Python; python: always the latter"
        },
    )
    max_request_bytes: int = dataclasses.field(
        default=32 << 20, metadata={"help": "largest request body (413)"}
    )
    max_body_bytes_in_flight: int = dataclasses.field(
        default=256 << 20,
        metadata={
            "help": "bytes of request bodies received and not yet decoded, all requests together; a "
            "request whose body would take them past it (unless it is the only one) gets 503 + "
            "Retry-After, so many large bodies at once cannot run the front end out of memory"
        },
    )
    header_timeout: float = dataclasses.field(
        default=60.0,
        metadata={
            "help": "seconds a client has to send a request's headers, counted from connecting or from the "
            "previous answer on a kept-alive connection (a slow client is disconnected); also how long an "
            "idle kept-alive connection stays open"
        },
    )
    body_timeout: float = dataclasses.field(
        default=30.0,
        metadata={"help": "seconds a request's body may take to arrive once its headers have (400)"},
    )
    write_timeout: float = dataclasses.field(
        default=60.0,
        metadata={"help": "seconds a client has to take an answer before its connection is dropped"},
    )
    max_batch: int = dataclasses.field(default=256, metadata={"help": "most requests in one /run/batch"})
    max_queue: int = dataclasses.field(
        default=2048, metadata={"help": "calls waiting for a slot before new requests get 503 + Retry-After"}
    )
    max_sessions: int = dataclasses.field(
        default=64,
        metadata={"help": "open sessions; when all are open, POST /sessions answers 503 (none is evicted)"},
    )
    session_ttl: float = dataclasses.field(
        default=600.0, metadata={"help": "idle seconds before a session is closed"}
    )
    session_cpu_seconds: int = dataclasses.field(
        default=300, metadata={"help": "CPU seconds a session may use over its lifetime"}
    )
    session_memory_mb: int = dataclasses.field(
        default=2048, metadata={"help": "address-space limit of a session, MiB"}
    )
    call_memory_cgroups: int = dataclasses.field(
        default=1,
        metadata={
            "help": "1: each call and session joins its own memory cgroup (needs root and a memory cgroup), "
            "so memory outside its address space (memfd, tmpfs, pipes) counts against its limit and an OOM "
            "kill stays inside it; costs each call a cgroup migration (~0.1 ms of CPU on cgroup v1); "
            "0: calls share the server's cgroup"
        },
    )
    call_cpu_cgroups: int = dataclasses.field(
        default=0,
        metadata={
            "help": "1: each call slot (and session) is its own cpu cgroup with an equal weight, so a call's "
            "many processes or threads get one call's share of the CPU, not one each (needs root and a "
            "cgroup v1 cpu hierarchy; costs each call a second cgroup migration); 0: CPU shared per thread"
        },
    )
    uid_base: int = dataclasses.field(
        default=0,
        metadata={
            "help": "first of the unprivileged uids (one per slot, one per session); 0 derives it from the "
            "server's pid so that servers sharing a host never share uids"
        },
    )

    def __post_init__(self) -> None:
        positive = (
            "workers", "slots", "memory_mb", "file_size_mb", "tmp_mb", "nproc", "nofile", "max_output_bytes",
            "output_limit_bytes", "max_code_chars", "max_stdin_chars", "max_request_bytes", "max_batch",
            "max_sessions", "session_cpu_seconds", "session_memory_mb", "max_queue",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.default_timeout <= self.max_timeout:
            raise ValueError(
                f"need 0 < default_timeout <= max_timeout, got {self.default_timeout}, {self.max_timeout}"
            )
        if self.session_ttl <= 0:
            raise ValueError(f"session_ttl must be positive, got {self.session_ttl}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        names = {t.strip() for t in self.tiers.split(",") if t.strip()}
        if not names <= set(TIERS) or "full" not in names:
            raise ValueError(f"tiers must be a subset of {TIERS} that includes 'full', got {self.tiers!r}")
        if self.uid_base < 0 or self.uid_base + self.uid_count >= 2**31:
            raise ValueError(f"uid_base must be 0 (automatic) or leave room for {self.uid_count} uids")
        if self.call_cpu_cgroups not in (0, 1):
            raise ValueError(f"call_cpu_cgroups must be 0 or 1, got {self.call_cpu_cgroups!r}")
        if self.call_memory_cgroups not in (0, 1):
            raise ValueError(f"call_memory_cgroups must be 0 or 1, got {self.call_memory_cgroups!r}")
        if self.call_setup not in ("auto", "python"):
            raise ValueError(f"call_setup must be 'auto' or 'python', got {self.call_setup!r}")
        for name in ("total_memory_mb", "precompile_max_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name, (low, high) in SANE_BOUNDS.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
        if self.max_body_bytes_in_flight < self.max_request_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be >= max_request_bytes "
                f"({self.max_request_bytes})"
            )
        if self.output_limit_bytes < self.max_output_bytes:
            raise ValueError(
                f"output_limit_bytes ({self.output_limit_bytes}) must be >= max_output_bytes "
                f"({self.max_output_bytes})"
            )

    @property
    def tier_list(self) -> tuple[str, ...]:
        """The configured tiers, lightest first."""
        names = {t.strip() for t in self.tiers.split(",") if t.strip()}
        return tuple(t for t in TIERS if t in names)

    @property
    def uid_count(self) -> int:
        """How many uids a server uses: one per slot of each warm process, one per session."""
        return self.workers * len(self.tier_list) * self.slots + self.max_sessions

    def first_uid(self, server_pid: int) -> int:
        """``uid_base``, or a base derived from the server's pid, in blocks that cannot overlap."""
        if self.uid_base:
            return self.uid_base
        block = -(-self.uid_count // 1000) * 1000
        return AUTO_UID_START + (server_pid % AUTO_UID_SERVERS) * block

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "localhost") or self.host.startswith("127.")

    def worker_payload(self) -> dict:
        """The part of the configuration a worker needs (never the token)."""
        payload = dataclasses.asdict(self)
        for name in ("token", "host", "port"):
            payload.pop(name)
        return payload


def build_arg_parser():
    """The ``python -m sandbox_server`` command line, one flag per ``ServerConfig`` field."""
    import argparse  # here, not at module level: warm workers import this module and should stay lean

    parser = argparse.ArgumentParser(
        prog="python -m sandbox_server",
        description="Fast isolated Python execution service (aiohttp front end, forked warm workers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field in dataclasses.fields(ServerConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(field.type), str)
        parser.add_argument(
            flag, dest=field.name, type=kind, default=field.default, help=field.metadata["help"]
        )
    parser.add_argument(
        "--stop-at-stdin-eof",
        action="store_true",
        help="also stop when standard input reaches end of file (start_local passes a pipe, so the server "
        "stops when the process that started it dies)",
    )
    parser.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow binding a non-loopback address without a bearer token",
    )
    return parser
