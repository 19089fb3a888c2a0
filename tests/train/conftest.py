"""Fixtures for the trainer tests: a tiny Qwen3, random packed batches, and cheap compilation: XLA's
backend optimisation off (``FAST_COMPILE``; these models are too small for it to matter) and a persistent
compilation cache so the subprocess tests (resume, launchers, multi-process) reuse each other's programs."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.data.batch import TokenSequence, build_batch

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_model_config() -> models.ModelConfig:
    """The tiny preset narrowed to width 32 with a 128-token vocabulary (layers unrolled: they compile faster
    on CPU)."""
    return models.preset(
        "tiny", vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8, tie_word_embeddings=False,
        scan_layers=False,
    )


@pytest.fixture(scope="session")
def tiny_model():
    config = tiny_model_config()
    return config, models.init_params(config, jax.random.PRNGKey(0))


def copy_tree(tree):
    """A fresh copy (steps donate their input state)."""
    return jax.tree.map(jnp.copy, tree)


def random_sequences(seed: int, count: int, *, vocab: int = 128, max_len: int = 20) -> list[TokenSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(4, max_len))
        prompt = int(rng.integers(1, n - 1))
        mask = [0] * prompt + rng.integers(0, 2, n - prompt).tolist()
        mask[-1] = 1
        out.append(
            TokenSequence(
                tokens=rng.integers(0, vocab, n).tolist(),
                loss_mask=mask,
                logprobs=(-3 * rng.random(n)).tolist(),
                advantage=float(rng.normal()),
            )
        )
    return out


@pytest.fixture
def rl_batch():
    return build_batch(random_sequences(0, 16), seq_len=32, num_rows=8, with_rl_fields=True)
