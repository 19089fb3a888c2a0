"""ModelConfig from HF configs: real Qwen3 shapes, llama3 RoPE, unsupported fields named."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rstar2jax import models

QWEN3_06B_PARAMS = 596_049_920  # transformers' Qwen3ForCausalLM.from_config count (tied embedding once)


@pytest.fixture(scope="module")
def qwen3_06b(shared_dir):
    return models.config_from_hf(shared_dir / "model_configs" / "qwen3-0.6b.json")


def test_qwen3_06b_config(qwen3_06b):
    config = qwen3_06b
    assert (config.model_type, config.hidden_size, config.intermediate_size, config.num_layers) == (
        "qwen3",
        1024,
        3072,
        28,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (16, 8, 128, 151936)
    assert config.rope_theta == 1e6 and config.rope_scaling is None and config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings and config.qk_norm and not config.qkv_bias
    assert config.eos_token_ids == (151645,) and config.bos_token_id == 151643
    assert config.num_params == QWEN3_06B_PARAMS
    hash(config)  # usable as a jit static argument
    assert models.config_from_hf(models.config_to_hf(config)) == config
    assert models.config_from_hf(transformers.AutoConfig.for_model(**models.config_to_hf(config))) == config


def test_qwen3_06b_builds_and_runs_with_random_weights(qwen3_06b):
    config = dataclasses.replace(qwen3_06b, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = models.init_params(config, jax.random.key(0))
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == QWEN3_06B_PARAMS
    assert params["layers"]["q_proj"].shape == (28, 1024, 16, 128) and params["embed"].dtype == jnp.bfloat16
    logits, _ = models.forward(params, config, jnp.array([[151643, 9707, 11, 1879]], jnp.int32))
    assert logits.shape == (1, 4, 151936) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_llama3_rope_frequencies_match_transformers():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    hf = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_scaling=scaling
    )
    config = models.config_from_hf(hf)
    assert dict(config.rope_scaling)["factor"] == 8.0 and config.rope_theta == 500000.0
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    np.testing.assert_allclose(models.rope_inverse_frequencies(config), expected.numpy(), rtol=1e-6)
    # The legacy layout (top-level rope_theta, rope_scaling without it) reads the same.
    legacy = {**models.config_to_hf(config), "rope_theta": 500000.0}
    assert models.config_from_hf(legacy) == config


BASE = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model_type="mistral"), "model_type='mistral'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window=True"),
        (dict(num_key_value_heads=3, num_attention_heads=4), "num_kv_heads=3"),
    ],
)
def test_unsupported_config_fields_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        models.config_from_hf({**BASE, **change})


def test_invalid_options_are_named():
    config = models.config_from_hf(BASE)
    with pytest.raises(ValueError, match="remat_policy='everything'"):
        dataclasses.replace(config, remat_policy="everything")
    with pytest.raises(ValueError, match="compute_dtype='int8'"):
        dataclasses.replace(config, compute_dtype="int8")
    with pytest.raises(ValueError, match="qk_norm=True does not match model_type='llama'"):
        dataclasses.replace(config, qk_norm=True)
