"""Fixtures of the model tests."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from rstar2jax import models
from tests.models.tiny_models import TinyModel

# Head counts divisible by a 4-way tensor axis so every sharding rule really shards something.
REFERENCE_CONFIG = models.preset(
    "tiny", vocab_size=128, num_heads=8, num_kv_heads=4, head_dim=8, tie_word_embeddings=False
)


def logprob_loss(params, tokens, config):
    """Mean next-token log-prob (the training objective's shape), with the logits as auxiliary output."""
    logits, _ = models.forward(params, config, tokens)
    return models.token_logprobs(logits[:, :-1], tokens[:, 1:]).mean(), logits


@dataclasses.dataclass(frozen=True)
class Reference:
    """Unsharded, scanned, no-remat results that sharded / unrolled / rematerialised variants must match."""

    config: models.ModelConfig
    params: dict
    tokens: np.ndarray
    loss: jax.Array
    logits: jax.Array
    grads: dict


@pytest.fixture(scope="session")
def reference():
    params = models.init_params(REFERENCE_CONFIG, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, REFERENCE_CONFIG.vocab_size, (8, 12)).astype(np.int32)
    loss_and_grad = jax.value_and_grad(functools.partial(logprob_loss, config=REFERENCE_CONFIG), has_aux=True)
    (loss, logits), grads = loss_and_grad(params, tokens)
    return Reference(REFERENCE_CONFIG, params, tokens, loss, logits, grads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> TinyModel, built lazily once per session."""
    cache = {}

    def get(family: str) -> TinyModel:
        if family not in cache:
            cache[family] = TinyModel(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return cache[family]

    return get
