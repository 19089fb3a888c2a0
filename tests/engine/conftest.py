"""Fixtures of the engine tests: a tiny random Qwen3 built with transformers and loaded into our params."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers

from rstar2jax import models
from rstar2jax.engine import EngineConfig, EngineCore
from rstar2jax.models import load_pretrained


@dataclasses.dataclass
class TinyQwen3:
    hf_model: transformers.PreTrainedModel
    config: object  # rstar2jax ModelConfig
    params: dict


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> TinyQwen3:
    """Random float32 Qwen3 (tied embeddings, GQA) with weights large enough for clear-cut greedy choices,
    saved by transformers and read back with ``load_pretrained``."""
    torch.manual_seed(0)
    tiny = models.config_to_hf(models.preset("tiny", max_position_embeddings=256))  # vocabulary of 256
    hf_config = transformers.Qwen3Config(**tiny, initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    config, params = load_pretrained(path)
    return TinyQwen3(model, config, params)


def teacher_forced(params, config, sequence, bucket: int = 64) -> np.ndarray:
    """log_softmax of a full (cache-free) forward over ``sequence`` at every position: float32
    [len, vocab]. The tokens are padded to a multiple of ``bucket`` so that the records of many lengths a
    test checks share a few compiled forwards (the model is causal: padding changes no earlier logit)."""
    padded = np.zeros((1, -(-len(sequence) // bucket) * bucket), np.int32)
    padded[0, :len(sequence)] = sequence
    logits, _ = models.forward(params, config, padded)
    return np.asarray(jax.nn.log_softmax(logits[0, :len(sequence)], axis=-1))


# One engine shape for the tests that share compiled programs (jit caches by shape).
ENGINE_CONFIG = EngineConfig(num_slots=4, max_len=64, decode_chunk=4, token_buckets=(4, 16), prefill_tile=8,
                             eos_token_ids=())


@pytest.fixture
def core(tiny_qwen3) -> EngineCore:
    return EngineCore(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG)
