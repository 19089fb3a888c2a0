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
import time
import urllib.request
from collections.abc import Iterator

from sandbox_server.config import ServerConfig

_LISTENING = re.compile(r"sandbox_server listening on (http://\S+)")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class LocalServer:
    """A running server: ``url`` to call it, ``process`` to inspect it, ``log_path`` holds its output."""

    url: str
    process: subprocess.Popen
    log_path: str

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path: str) -> dict:
        """GET a JSON endpoint such as ``/health`` or ``/metrics`` (synchronous)."""
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)


@contextlib.contextmanager
def start_local(
    *, startup_timeout: float = 180.0, env: dict | None = None, python: str | None = None, **limits
) -> Iterator[LocalServer]:
    """Start ``python -m sandbox_server`` on 127.0.0.1 and a free port; stop it (SIGTERM) on exit.

    The server also stops by itself if this process dies without leaving the ``with`` block (a killed script,
    a notebook kernel shut down mid-cell): its standard input is a pipe from here (``--stop-at-stdin-eof``).

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
    args = [python or sys.executable, "-m", "sandbox_server"]
    args += ["--host", "127.0.0.1", "--port", "0", "--stop-at-stdin-eof"]
    for name, value in limits.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    log_fd, log_path = tempfile.mkstemp(prefix="sandbox_server-", suffix=".log")
    python_path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, **(env or {}), PYTHONPATH=python_path)
    process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    os.close(log_fd)
    server = LocalServer(url="", process=process, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.url:
            match = _LISTENING.search(server.log_text())
            if match:
                server.url = match.group(1)
            elif process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sandbox server did not start (exit code {process.poll()}):\n{server.log_text()}"
                )
            else:
                time.sleep(0.05)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stdin.close()
        os.unlink(log_path)
