"""LoRA: the low-rank path equals the merged weights, its gradients are exact, PEFT folders round-trip through
peft itself with equal logits, the sampler's log-probs equal the trainer's, and bad adapters are refused."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import engine, models
from rstar2jax.models import lora as lora_lib
from rstar2jax.models import peft_adapter
from tests.models.conftest import REFERENCE_CONFIG, logprob_loss

LORA = models.LoraConfig(rank=4, alpha=8.0)


def _trained_adapters(config, lora, seed=1):
    """Adapters as after some training (B no longer zero), made on the host: nothing to compile."""
    rng = np.random.default_rng(seed)
    specs = lora_lib.lora_specs(config, lora)
    return jax.tree.map(lambda spec: (0.2 * rng.normal(size=spec.shape)).astype(np.float32), specs,
                        is_leaf=models.params.is_param_spec)


def test_lora_forward_equals_merged_forward(reference):
    # Remat, the chunked MLP (dropout keys per chunk) and blockwise attention all run the low-rank path.
    config = dataclasses.replace(REFERENCE_CONFIG, remat_policy="full", mlp_chunk_size=4,
                                 attention="blockwise", attention_block_size=8)
    adapters = _trained_adapters(config, LORA)
    tokens = reference.tokens
    merged = lora_lib.merge(reference.params, adapters, LORA)
    expected, _ = models.forward(merged, config, tokens)
    attached = lora_lib.attach(reference.params, adapters, LORA)
    logits, _ = models.forward(attached, config, tokens)
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
    # B starts at zero: fresh adapters compute exactly the base model.
    fresh = lora_lib.attach(reference.params, lora_lib.init_lora(config, LORA, jax.random.key(3)), LORA)
    np.testing.assert_array_equal(models.forward(fresh, config, tokens)[0],
                                  models.forward(reference.params, config, tokens)[0])


def test_lora_delta_with_and_without_jit():
    """The low-rank path of every projection layout: (x A)(s B) = x (s A B), jitted and op by op."""
    rng = np.random.default_rng(0)
    cases = {
        "btd,dhk->bthk": ((2, 3, 8), (8, 4), (4, 2, 5)),
        "bthk,hkd->btd": ((2, 3, 2, 5), (2, 5, 4), (4, 8)),
        "btd,df->btf": ((2, 3, 8), (8, 4), (4, 6)),
    }
    for spec, (x_shape, a_shape, b_shape) in cases.items():
        x, a, b = (rng.normal(size=s).astype(np.float32) for s in (x_shape, a_shape, b_shape))
        dense = np.tensordot(a, b, axes=1)  # A B as the weight it adds, input axes first
        expected = np.einsum(spec, x, dense)
        tree = {"q_proj": {"a": a, "b": b}}
        jitted = jax.jit(lora_lib.lora_delta, static_argnums=(2, 3))(x, tree, "q_proj", spec)
        with jax.disable_jit():
            eager = lora_lib.lora_delta(x, tree, "q_proj", spec)
        for got in (jitted, eager):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert lora_lib.lora_delta(x, tree, "k_proj", spec) is None  # no adapter: nothing to add


def test_lora_dropout_masks_the_adapters_input_only():
    x = jnp.ones((2, 64, 8))
    tree = {"q_proj": {"a": jnp.eye(8, 4), "b": jnp.eye(4, 6)}}
    plain = lora_lib.lora_delta(x, tree, "q_proj", "btd,df->btf")
    rate = 0.25
    dropped = {**tree, "dropout": {"key": jax.random.key_data(jax.random.key(0)),
                                   "keep_below": jnp.uint32(int((1 - rate) * 2**32))}}
    out = np.asarray(lora_lib.lora_delta(x, dropped, "q_proj", "btd,df->btf"))
    kept = out[..., :4] != 0
    assert 0.6 < kept.mean() < 0.9  # about 1 - rate of the inputs kept
    np.testing.assert_allclose(out[..., :4][kept], np.asarray(plain)[..., :4][kept] / (1 - rate), rtol=1e-5)
    chunk = np.asarray(lora_lib.lora_delta(x, dropped, "q_proj", "btd,df->btf", chunk_index=1))
    assert (chunk != out).any()  # another MLP chunk draws another mask


def test_adapter_gradients_match_finite_differences_and_the_dense_gradient(reference):
    config, params, tokens = REFERENCE_CONFIG, reference.params, reference.tokens
    adapters = _trained_adapters(config, LORA)

    # One program for the loss and its gradient; the finite differences call it too.
    loss_and_grad = jax.jit(jax.value_and_grad(
        lambda adapters: logprob_loss(lora_lib.attach(params, adapters, LORA), tokens, config)[0]))

    def adapter_loss(adapters):
        return loss_and_grad(adapters)[0]

    grads = loss_and_grad(adapters)[1]
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    # Central differences along unit directions v: (L(x + e v) - L(x - e v)) / 2e = <grad, v>, along the
    # gradient itself (= its norm) and along a random direction.
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    random = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    random_norm = jnp.sqrt(sum(jnp.sum(v * v) for v in random))
    eps = 3e-3
    for direction in (jax.tree.map(lambda g: g / norm, grads),
                      jax.tree.unflatten(treedef, [v / random_norm for v in random])):
        shifted = [jax.tree.map(lambda x, v, s=s: x + s * eps * v, adapters, direction) for s in (1, -1)]
        numeric = (adapter_loss(shifted[0]) - adapter_loss(shifted[1])) / (2 * eps)
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True)
        analytic = sum(jnp.vdot(g, v) for g, v in pairs)
        np.testing.assert_allclose(numeric, analytic, atol=2e-3 * norm)

    # The projection of the dense weight gradient at the merged weights: dA = s dW B^T, dB = s A^T dW.
    merged = lora_lib.merge(params, adapters, LORA)
    dense = jax.grad(lambda p: logprob_loss(p, tokens, config)[0])(merged)["layers"]
    for name, pair in adapters["layers"].items():
        layers, rank = pair["a"].shape[0], pair["a"].shape[-1]
        a, b = pair["a"].reshape(layers, -1, rank), pair["b"].reshape(layers, rank, -1)
        dw = dense[name].reshape(layers, a.shape[1], b.shape[2])
        expected_a = LORA.scale * jnp.einsum("lio,lro->lir", dw, b)
        expected_b = LORA.scale * jnp.einsum("lir,lio->lro", a, dw)
        np.testing.assert_allclose(grads["layers"][name]["a"].reshape(expected_a.shape), expected_a,
                                   rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(grads["layers"][name]["b"].reshape(expected_b.shape), expected_b,
                                   rtol=1e-4, atol=1e-7)


def test_sampler_logprobs_match_the_trainers(reference):
    """The engine samples from the merged weights; the trainer scores with the low-rank path: same
    log-probs within the sampler-vs-trainer tolerance of the rollout tests."""
    config, params = REFERENCE_CONFIG, reference.params
    adapters = _trained_adapters(config, LORA)
    prompts = [[1, 2, 3, 4], [5, 6]]
    outputs = engine.generate(lora_lib.merge(params, adapters, LORA), config, prompts, max_new_tokens=8,
                              temperature=1.0, seed=3)
    attached = lora_lib.attach(params, adapters, LORA)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = np.array([prompt + out.tokens], np.int32)
        logp, _ = models.sequence_logprobs(attached, config, tokens[:, :-1], tokens[:, 1:])
        np.testing.assert_allclose(out.logprobs, np.asarray(logp)[0, len(prompt) - 1:], atol=2e-4)


@pytest.mark.needs_devices(8)
def test_lora_shardings_follow_the_base_matrices():
    mesh = models.make_mesh(data=2, fsdp=2, tensor=2)
    shardings = lora_lib.lora_shardings(REFERENCE_CONFIG, LORA, mesh)["layers"]
    assert set(shardings) == set(models.LORA_TARGETS)
    P = jax.sharding.PartitionSpec
    assert shardings["q_proj"]["a"].spec == P(None, "fsdp", None)  # [L, embed, rank]: as q_proj's input
    assert shardings["q_proj"]["b"].spec == P(None, None, "tensor", None)  # [L, rank, heads, head_dim]
    assert shardings["o_proj"]["a"].spec == P(None, "tensor", None, None)
    assert shardings["down_proj"]["b"].spec == P(None, None, "fsdp")
    specs = lora_lib.lora_specs(REFERENCE_CONFIG, LORA)["layers"]
    assert specs["q_proj"]["a"].axes == ("layers", "embed", "lora_rank")
    assert specs["o_proj"]["a"].axes == ("layers", "heads", "head_dim", "lora_rank")
    assert specs["o_proj"]["b"].axes == ("layers", "lora_rank", "embed")
    count = lora_lib.adapter_parameter_count(REFERENCE_CONFIG, LORA)
    fresh = jax.eval_shape(lambda: lora_lib.init_lora(REFERENCE_CONFIG, LORA, jax.random.key(0)))
    assert count == sum(x.size for x in jax.tree.leaves(fresh))
    # D = 64, H Dh = 64, K Dh = 32, F = 128, 2 layers: r (fan_in + fan_out) per layer and projection.
    assert count == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_peft_round_trip_gives_equal_logits(tiny_models, tmp_path, family):
    """Ours -> a PEFT folder -> peft on the transformers model (same logits) -> peft's own save -> ours."""
    import peft  # a test dependency (setup.py's test extra)
    import torch

    tiny = tiny_models(family)
    config, params = models.load_pretrained(tiny.path)
    lora = models.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    adapters = _trained_adapters(config, lora)
    base = str(tiny.path)
    ours = peft_adapter.save_peft_adapter(adapters, config, lora, tmp_path / "ours", base_model=base)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 12))
    expected, _ = models.forward(lora_lib.attach(params, adapters, lora), config, tokens.astype(np.int32))

    peft_model = peft.PeftModel.from_pretrained(tiny.torch_model, ours)
    with torch.no_grad():
        logits = peft_model(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)
    peft_model.save_pretrained(tmp_path / "theirs")
    peft_model.unload()  # leaves the shared tiny model as it was

    loaded_lora, loaded = peft_adapter.load_peft_adapter(tmp_path / "theirs", config, base_model=base)
    assert loaded_lora == lora
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, adapters))


def test_bad_lora_configs_and_adapters_are_refused(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="lora target 'c_attn': not a projection"):
        models.LoraConfig(targets=("q_proj", "c_attn"))
    for rank in (0, -2):
        with pytest.raises(ValueError, match=f"lora rank={rank}"):
            models.LoraConfig(rank=rank)
    tiny = tiny_models("qwen3")
    config = models.config_from_hf(tiny.path)
    with pytest.raises(ValueError, match="lora rank=65 is larger than q_proj's 64 x 96 matrix"):
        lora_lib.check_lora(config, models.LoraConfig(rank=65))

    adapters = _trained_adapters(config, LORA)
    folder = peft_adapter.save_peft_adapter(
        adapters, config, LORA, tmp_path / "a", base_model="org/Qwen3-tiny"
    )
    assert peft_adapter.load_peft_adapter(folder, config, base_model="/ckpt/Qwen3-tiny")[0] == LORA  # moved
    with pytest.raises(ValueError, match="belongs to base model 'org/Qwen3-tiny', not 'org/Other'"):
        peft_adapter.load_peft_adapter(folder, config, base_model="org/Other")
    wider = dataclasses.replace(config, hidden_size=96)
    with pytest.raises(ValueError, match="has shape .* this base needs"):
        peft_adapter.load_peft_adapter(folder, wider)
    deeper = dataclasses.replace(config, num_layers=1)
    with pytest.raises(ValueError, match="tensors this qwen3 model has no place for"):
        peft_adapter.load_peft_adapter(folder, deeper)
    settings = json.loads((folder / peft_adapter.ADAPTER_CONFIG).read_text())
    (folder / peft_adapter.ADAPTER_CONFIG).write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        peft_adapter.load_peft_adapter(folder, config)
