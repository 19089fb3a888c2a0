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
def qwen3_06b():
    return models.preset("qwen3-0.6b")


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


def test_qwen3_06b_has_the_real_parameter_shapes(qwen3_06b):
    config = dataclasses.replace(qwen3_06b, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.key(0)))
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == QWEN3_06B_PARAMS
    assert params["layers"]["q_proj"].shape == (28, 1024, 16, 128) and params["embed"].dtype == jnp.bfloat16


@pytest.mark.slow  # 15-20 s on 2 cores: 0.6B random weights; CI's slow stage runs it
def test_qwen3_06b_builds_and_runs_with_random_weights(qwen3_06b):
    config = dataclasses.replace(qwen3_06b, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = models.init_params(config, jax.random.key(0))
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == QWEN3_06B_PARAMS
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


# sha256 of the official HF config.json of each size (rstar2jax/models/hf_configs/README.md) and the parameter
# count transformers' Qwen3ForCausalLM.from_config gives for it (tied embedding counted once).
PRESET_FILES = {
    "qwen3-0.6b": ("660db3b73d788119c04535e48cf9be5f55bc3100841a718637ae695b442f27dd", QWEN3_06B_PARAMS),
    "qwen3-1.7b": ("1ddb5b89ebc90dcb417a45c213d818577e65976454d29385c8f6140771d95197", 1_720_574_976),
    "qwen3-4b": ("8ba006f74fecfaaeb392872a60f4a480e7ec9860153d2e1b769ec81f9a147f8a", 4.022e9),
    "qwen3-8b": ("f7c4eadfbbf522470667b797a3c89be2524832d2d599797248dc304fff447c30", 8.191e9),
    "qwen3-14b": ("e73c3664ca09b10a673fef0c22e8a6b456201d49bd4713c9691f775720e8857a", 14.768e9),
}


def test_presets_are_the_bundled_official_configs():
    import hashlib

    assert set(models.PRESETS) == {"tiny", *PRESET_FILES}
    for name, (sha256, params) in PRESET_FILES.items():
        path = models.HF_CONFIGS_DIR / f"{name}.json"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256, path
        config = models.preset(name)
        assert config == models.config_from_hf(path)
        assert config.num_params == pytest.approx(params, rel=5e-4), name
    fourteen = models.preset("qwen3-14b", num_layers=2, compute_dtype="bfloat16")
    assert (fourteen.hidden_size, fourteen.num_heads, fourteen.num_layers) == (5120, 40, 2)
    assert fourteen.compute_dtype == "bfloat16" and not fourteen.tie_word_embeddings
    tiny = models.preset("tiny", vocab_size=151936)
    assert tiny == dataclasses.replace(models.TINY, vocab_size=151936) and tiny.num_layers == 2
    with pytest.raises(ValueError, match=r"model preset 'qwen3-15b' is unknown; expected one of"):
        models.preset("qwen3-15b")
