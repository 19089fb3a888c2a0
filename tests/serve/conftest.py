"""Fixtures of the serving tests (the tiny taught policy folder is ``tests/conftest.py``'s): its weights as a
plain HF folder, the policy loaded, and a live server on it."""

import shutil

import pytest

from rstar2jax.data.conversation import PROMPT_CONFIG_FILE
from rstar2jax.serve import BackgroundServer, ServerConfig, load_policy


@pytest.fixture(scope="session")
def plain_policy_dir(tiny_policy_dir, tmp_path_factory):
    """The tiny policy's weights and tokenizer as a plain HF folder: it records no conversation format."""
    folder = tmp_path_factory.mktemp("plain") / "plain"
    shutil.copytree(tiny_policy_dir, folder)
    (folder / PROMPT_CONFIG_FILE).unlink()
    return folder


@pytest.fixture(scope="session")
def tiny_policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


SERVER_CONFIG = ServerConfig(num_slots=4, max_len=512, decode_chunk=4, warmup=False)  # tokens stream in fours


@pytest.fixture(scope="session")
def server(tiny_policy):
    with BackgroundServer(tiny_policy, SERVER_CONFIG) as live:
        yield live
