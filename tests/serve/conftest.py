"""Fixtures of the serving tests: the tiny taught policy folder (built once) and a live server on it."""

import asyncio
import socket
import threading

import pytest

from experiments.tiny_policy import build_tiny_policy
from rstar2jax.serve import ChatService, ServerConfig, load_policy, start_server


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A ChatService on its own event loop in a daemon thread."""

    def __init__(self, policy, config: ServerConfig):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = ChatService(policy, config)
        self.runner = self.call(self._start())

    async def _start(self):
        await self.service.__aenter__()
        return await start_server(self.service, "127.0.0.1", self.port)

    def call(self, coroutine, timeout=120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self):
        async def stop():
            await self.runner.cleanup()
            await self.service.__aexit__(None, None, None)

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


SERVER_CONFIG = ServerConfig(num_slots=4, max_len=512, segment_tokens=8, warmup=False)


@pytest.fixture(scope="session")
def server(tiny_policy):
    live = LiveServer(tiny_policy, SERVER_CONFIG)
    yield live
    live.close()
