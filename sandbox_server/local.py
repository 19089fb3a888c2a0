"""``start_local``: run a real server process on a free loopback port for tests, notebooks and demos."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

from sandbox_server.config import ServerConfig

_LISTENING = re.compile(r"sandbox_server listening on (http://\S+)")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class LocalServer:
    """A running server: ``url`` to call it, ``process`` to inspect it, ``log_path`` holds its output (of
    every process a restart started, in order)."""

    url: str
    process: subprocess.Popen
    log_path: str
    _args: list[str] = dataclasses.field(default_factory=list, repr=False)
    _env: dict = dataclasses.field(default_factory=dict, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def log_text(self, start: int = 0) -> str:
        """The log from byte ``start`` on."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def get(self, path: str) -> dict:
        """GET a JSON endpoint such as ``/health`` or ``/metrics`` (synchronous)."""
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def _start(self, port: int, startup_timeout: float) -> None:
        """Start the server process on ``port`` (0: a free one) and wait until it listens."""
        args = [*self._args, "--port", str(port)]
        seen = os.path.getsize(self.log_path)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                            env=self._env)
        deadline = time.monotonic() + startup_timeout
        while True:
            match = _LISTENING.search(self.log_text(seen))
            if match:
                self.url = match.group(1)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                code, output = self.process.poll(), self.log_text(seen)
                raise RuntimeError(f"sandbox server did not start (exit code {code}):\n{output}")
            time.sleep(0.05)

    def restart_if_dead(self, startup_timeout: float = 180.0) -> str | None:
        """If the server process has exited (crashed, killed), start a new one on the same port, so its URL
        stays valid, and return a line saying so; None while it runs. Thread-safe."""
        with self._lock:
            code = self.process.poll()
            if code is None:
                return None
            self.process.stdin.close()
            self._start(int(urllib.parse.urlsplit(self.url).port), startup_timeout)
            return (f"sandbox server at {self.url} had exited (code {code}); restarted it "
                    f"(pid {self.process.pid})")

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after 30 s) and wait for it."""
        process = self.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stdin.close()


@contextlib.contextmanager
def start_local(
    *, startup_timeout: float = 180.0, env: dict | None = None, python: str | None = None, **limits
) -> Iterator[LocalServer]:
    """Start ``python -m sandbox_server`` on 127.0.0.1 and a free port; stop it (SIGTERM) on exit.

    The server also stops by itself if this process dies without leaving the ``with`` block (a killed script,
    a notebook kernel shut down mid-cell): its standard input is a pipe from here (``--stop-at-stdin-eof``).
    ``LocalServer.restart_if_dead`` brings a crashed server back on the same port.

    ``limits`` are ``ServerConfig`` fields (``workers=2``, ``memory_mb=512``, ``max_queue=64`` ...);
    ``env`` adds variables to the server's environment (calls never see them); ``python`` is the interpreter
    the server, its workers and so the calls run on (default: this one), which needs aiohttp, msgpack,
    numpy, sympy and mpmath.
    """
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"host", "port"}
    unknown = sorted(set(limits) - fields)
    if unknown:
        raise TypeError(f"unknown server option(s) {unknown}; valid: {sorted(fields)}")
    ServerConfig(**limits)  # fail here, with the config's message, rather than in the child
    args = [python or sys.executable, "-m", "sandbox_server", "--host", "127.0.0.1", "--stop-at-stdin-eof"]
    for name, value in limits.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    log_fd, log_path = tempfile.mkstemp(prefix="sandbox_server-", suffix=".log")
    os.close(log_fd)
    python_path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, **(env or {}), PYTHONPATH=python_path)
    server = LocalServer(url="", process=None, log_path=log_path, _args=args, _env=env)
    try:
        server._start(0, startup_timeout)
        yield server
    finally:
        if server.process is not None:
            server.stop()
        os.unlink(log_path)
