"""HF checkpoints: save -> transformers loads the same model; load into a mesh; bad checkpoints are named."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from rstar2jax import models
from tests.models.tiny_models import FAMILIES


def _perturbed(params, seed=0):
    """Host copies of params with every leaf (norms and biases included) moved by N(0, 0.05)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda leaf: np.asarray(leaf) + 0.05 * rng.standard_normal(leaf.shape, np.float32), params
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers_with_same_logits(tiny_models, family, tmp_path):
    config, loaded = models.load_pretrained(tiny_models(family).path)
    params = _perturbed(loaded)
    # A tiny shard limit forces the sharded layout (several files + index) for one family.
    max_shard_bytes = 40_000 if family == "qwen3" else models.hf_checkpoint.DEFAULT_MAX_SHARD_BYTES
    models.save_pretrained(params, config, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / models.hf_checkpoint.INDEX_FILE).exists() == (family == "qwen3")

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert torch_model.config.model_type == family
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 14)).astype(np.int32)
    with torch.no_grad():
        expected = torch_model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    # Explicit positions and segments: the signature of the parity tests, whose compiled forward is reused.
    positions = np.broadcast_to(np.arange(14, dtype=np.int32), (2, 14))
    logits, _ = models.forward(params, config, tokens, positions=positions, segment_ids=np.ones_like(tokens))
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)

    reloaded_config, reloaded = models.load_pretrained(tmp_path)
    assert reloaded_config == config
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_transformers_sharded_checkpoint_loads(tiny_models, tmp_path):
    tiny = tiny_models("llama")
    tiny.torch_model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / models.hf_checkpoint.INDEX_FILE).exists()
    _, from_index = models.load_pretrained(tmp_path)
    _, from_single = models.load_pretrained(tiny.path)
    jax.tree.map(np.testing.assert_array_equal, from_index, from_single)


def test_bfloat16_load_and_save(tiny_models, tmp_path):
    config, params = models.load_pretrained(tiny_models("qwen2").path, dtype=jnp.bfloat16)
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    models.save_pretrained(params, config, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, reloaded = models.load_pretrained(tmp_path, dtype="bfloat16")  # dtype names work too
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


@pytest.mark.needs_devices(8)
def test_load_with_mesh_places_each_tensor_in_its_sharding(tiny_models):
    tiny = tiny_models("qwen3")
    mesh = models.make_mesh(fsdp=2, tensor=4)
    config, sharded = models.load_pretrained(tiny.path, mesh=mesh)
    _, unsharded = models.load_pretrained(tiny.path)
    expected = models.param_shardings(config, mesh)
    for leaf, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding == sharding
    assert sharded["layers"]["q_proj"].sharding.spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor", None
    )
    jax.tree.map(np.testing.assert_array_equal, sharded, unsharded)


@pytest.fixture
def editable_checkpoint(tiny_models, tmp_path):
    """A copy of the tiny Qwen3 checkpoint and a function rewriting its tensors."""
    path = tmp_path / "checkpoint"
    shutil.copytree(tiny_models("qwen3").path, path)
    weights = path / "model.safetensors"

    def edit(change):
        tensors = safetensors.numpy.load_file(weights)
        change(tensors)
        safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})

    return path, edit


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
         r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"),
        (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
         r"unexpected tensors: \['model.layers.0.self_attn.o_proj.bias'\]"),
        (lambda t: t.update({"model.layers.0.self_attn.k_norm.weight": np.ones(12, np.float32)}),
         r"model.layers.0.self_attn.k_norm.weight has shape \(12,\), expected \(24,\)"),
        (lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}),
         r"tensor model.norm.weight has dtype I32"),
    ],
    ids=["missing", "unexpected", "wrong_shape", "integer"],
)  # fmt: skip
def test_bad_tensor_is_named(editable_checkpoint, change, message):
    path, edit = editable_checkpoint
    edit(change)
    with pytest.raises(ValueError, match=message):
        models.load_pretrained(path)


def test_unsupported_model_type_is_named(editable_checkpoint):
    path, _ = editable_checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type='mistral'"):
        models.load_pretrained(path)


def test_directory_without_weights_is_reported(tmp_path, tiny_models):
    shutil.copy(tiny_models("qwen3").path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.load_pretrained(tmp_path)


def test_save_rejects_params_of_another_shape(tiny_models, tmp_path):
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    params["layers"]["up_proj"] = params["layers"]["up_proj"][:, :, :5]
    with pytest.raises(ValueError, match=r"\['layers'\]\['up_proj'\] has shape \(2, 64, 5\)"):
        models.save_pretrained(params, config, tmp_path)


def test_save_pretrained_writes_the_tokenizer_with_its_chat_template(tiny_models, tmp_path):
    """A policy folder with its tokenizer is all ``config.model.path`` needs; the chat template survives."""
    from rstar2jax.data.chat_template import CHATML_TOOLS_TEMPLATE
    from rstar2jax.data.tokenizer import load_tokenizer, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(["What is 2+2? <answer>4</answer>"] * 4, 300, tmp_path / "tok")
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    models.save_pretrained(params, config, tmp_path / "policy", tokenizer=tokenizer)
    reloaded = load_tokenizer(tmp_path / "policy")
    assert reloaded.chat_template == CHATML_TOOLS_TEMPLATE and len(reloaded) == len(tokenizer)
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<tool_call>"
    assert reloaded.encode(text) == tokenizer.encode(text)
    config2, params2 = models.load_pretrained(tmp_path / "policy")
    assert config2 == config
    np.testing.assert_array_equal(params2["embed"], params["embed"])
    models.save_pretrained(params, config, tmp_path / "bare")
    assert not (tmp_path / "bare" / "tokenizer.json").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], r"tensor '[\w.]+': bytes \d+\.\.\d+ lie outside the \d+ data bytes"),
        (lambda b: b[:5], r"5 bytes, shorter than the 8-byte header length"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], r"header of 1000000000 bytes does not fit"),
        (lambda b: b[:8] + b"\xff" * 20 + b[28:], r"header is not JSON"),
    ],
    ids=["truncated", "stub", "header_length", "header_bytes"],
)
def test_damaged_safetensors_file_is_named(editable_checkpoint, damage, message):
    path, _ = editable_checkpoint
    weights = path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    named = f"^{re.escape(str(weights))}: not a valid safetensors file: "
    with pytest.raises(ValueError, match=named + message):
        models.load_pretrained(path)
