"""LoRA: the low-rank path equals the merged weights, its gradients are exact, PEFT folders round-trip through
peft itself with equal logits, the sampler's log-probs equal the trainer's, and bad adapters are refused."""

import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import engine, models
from rstar2jax.models import lora as lora_lib
from rstar2jax.models import peft_adapter, peft_config
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


def test_bad_lora_configs_are_refused(tiny_models):
    with pytest.raises(ValueError, match="lora target 'c_attn': not a projection"):
        models.LoraConfig(targets=("q_proj", "c_attn"))
    for rank in (0, -2):
        with pytest.raises(ValueError, match=f"lora rank={rank}"):
            models.LoraConfig(rank=rank)
    config = models.config_from_hf(tiny_models("qwen3").path)
    with pytest.raises(ValueError, match="lora rank=65 is larger than q_proj's 64 x 96 matrix"):
        lora_lib.check_lora(config, models.LoraConfig(rank=65))


# --- adapters as peft writes them: a matrix of peft's own folders, each loaded with peft's logits ----------

#: peft LoraConfig options of each case (r=4, alpha=8 unless given); every way peft names its targets.
PEFT_CASES = {
    "all_linear": dict(target_modules="all-linear"),  # saved as the expanded list of full module paths
    "suffixes": dict(target_modules=["self_attn.q_proj", "down_proj"], use_rslora=True),
    "regex": dict(target_modules=r".*\.layers\.1\.(self_attn\.(q|v)_proj|mlp\.up_proj)"),
    "exclude_list": dict(target_modules="all-linear",
                         exclude_modules=["o_proj", "model.layers.0.mlp.up_proj"]),
    "exclude_regex": dict(target_modules=["q_proj", "k_proj", "v_proj"],
                          exclude_modules=r".*layers\.0\.self_attn\.k_proj"),
    "layers_to_transform": dict(target_modules=["q_proj", "gate_proj"], layers_to_transform=[1],
                                layers_pattern="layers"),
    "uniform_patterns": dict(target_modules=["v_proj", "o_proj"], r=8, lora_alpha=16,
                             rank_pattern={"v_proj": 4, "o_proj": 4},
                             alpha_pattern={"self_attn.v_proj": 8, "o_proj": 8}),
}
#: What each case adapts: projection -> layers (the tiny model has 2).
PEFT_EXPECTED = {
    "all_linear": {t: (0, 1) for t in models.LORA_TARGETS},
    "suffixes": {"q_proj": (0, 1), "down_proj": (0, 1)},
    "regex": {"q_proj": (1,), "v_proj": (1,), "up_proj": (1,)},
    "exclude_list": {**{t: (0, 1) for t in models.LORA_TARGETS if t != "o_proj"}, "up_proj": (1,)},
    "exclude_regex": {"q_proj": (0, 1), "k_proj": (1,), "v_proj": (0, 1)},
    "layers_to_transform": {"q_proj": (1,), "gate_proj": (1,)},
    "uniform_patterns": {"v_proj": (0, 1), "o_proj": (0, 1)},
}


@pytest.fixture(scope="module")
def peft_base(tiny_models):
    """The tiny Qwen3 (transformers and ours), its path and a batch of tokens."""
    tiny = tiny_models("qwen3")
    config, params = models.load_pretrained(tiny.path)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 10))
    return tiny, config, params, tokens


def _peft_folder(tiny, folder, **options):
    """A peft LoRA model on a copy of the tiny model (random A and B), saved to ``folder``; its logits."""
    import copy

    import peft
    import torch

    options = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **options}
    torch.manual_seed(0)
    model = peft.get_peft_model(copy.deepcopy(tiny.torch_model), peft.LoraConfig(**options))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_peft_saved_adapters_load_with_peft_logits(peft_base, tmp_path, case):
    import torch

    tiny, config, params, tokens = peft_base
    model = _peft_folder(tiny, tmp_path, **PEFT_CASES[case])
    with torch.no_grad():
        expected = model(torch.as_tensor(tokens)).logits.numpy()
    saved = json.loads((tmp_path / peft_config.ADAPTER_CONFIG).read_text())
    if case == "all_linear":  # what peft 0.21 writes: every matched module's full path, not the shorthand
        assert "model.layers.0.self_attn.o_proj" in saved["target_modules"]

    lora, adapters = peft_adapter.load_peft_adapter(tmp_path, config, base_model=str(tiny.path))
    spec = peft_config.read_adapter_spec(tmp_path, config)
    assert spec.layers == PEFT_EXPECTED[case]
    assert (lora.rank, lora.alpha) == (4, 8.0)  # uniform_patterns: r=8 / alpha 16 overridden everywhere
    assert lora.rslora == (case == "suffixes")
    for target, pair in adapters["layers"].items():  # layers peft left alone hold zero adapters
        for layer in set(range(config.num_layers)) - set(spec.layers[target]):
            assert not pair["a"][layer].any() and not pair["b"][layer].any()
    logits, _ = models.forward(lora_lib.merge(params, adapters, lora), config, tokens.astype(np.int32))
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias=True"),
        (dict(target_modules=["q_proj"], use_dora=True), "use_dora=True"),
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save=['lm_head']"),
        (dict(target_modules=["q_proj"], bias="all"), "bias='all'"),
        (dict(target_modules=["q_proj", "lm_head"]), "adapts 'lm_head', which this library cannot"),
        (dict(target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 2}), "rank_pattern gives"),
        (dict(target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 16}), "alpha_pattern gives"),
    ],
)
def test_what_cannot_be_applied_is_refused_naming_the_peft_option(peft_base, tmp_path, options, message):
    tiny, config, _, _ = peft_base
    _peft_folder(tiny, tmp_path, **options)
    with pytest.raises(ValueError, match=re.escape(message)):
        peft_adapter.load_peft_adapter(tmp_path, config, base_model=str(tiny.path))


def test_base_identity_is_architecture_and_shapes(peft_base, tmp_path, caplog):
    """A name that differs only warns (once; ``strict_base`` refuses); another architecture, other shapes or
    more layers than the base are refused whatever the name."""
    tiny, config, _, _ = peft_base
    adapters = _trained_adapters(config, LORA)
    folder = peft_adapter.save_peft_adapter(adapters, config, LORA, tmp_path / "a",
                                            base_model="Qwen/Qwen3-tiny")
    caplog.set_level(logging.WARNING, logger="rstar2jax")
    for _ in range(2):  # a local copy under another name: loads, with one warning naming both
        lora, loaded = peft_adapter.load_peft_adapter(folder, config, base_model="/models/qwen3-tiny")
    assert lora == LORA
    jax.tree.map(np.testing.assert_array_equal, loaded, adapters)
    warnings = [r.getMessage() for r in caplog.records if "names base model" in r.getMessage()]
    assert len(warnings) == 1 and "'Qwen/Qwen3-tiny'" in warnings[0] and "'/models/qwen3-tiny'" in warnings[0]
    with pytest.raises(ValueError, match="names base model 'Qwen/Qwen3-tiny', applied to '/models/qwen3-tiny'"
                                         ".*strict_base"):
        peft_adapter.load_peft_adapter(folder, config, base_model="/models/qwen3-tiny", strict_base=True)
    assert peft_adapter.load_peft_adapter(folder, config, base_model="Qwen/Qwen3-tiny/", strict_base=True)

    wider = dataclasses.replace(config, hidden_size=96)
    with pytest.raises(ValueError, match=r"has shape .* this base needs .* model \(Qwen/Qwen3-tiny\)"):
        peft_adapter.load_peft_adapter(folder, wider, base_model="Qwen/Qwen3-tiny")
    shallower = dataclasses.replace(config, num_layers=1)
    with pytest.raises(ValueError, match="no module of this qwen3 model of 1 layers"):
        peft_adapter.load_peft_adapter(folder, shallower)
    llama = dataclasses.replace(config, model_type="llama", qk_norm=None)
    with pytest.raises(ValueError, match="trained on a Qwen3ForCausalLM .* this base is a LlamaForCausalLM"):
        peft_adapter.load_peft_adapter(folder, llama)
    settings = json.loads((folder / peft_config.ADAPTER_CONFIG).read_text())
    (folder / peft_config.ADAPTER_CONFIG).write_text(json.dumps({**settings, "init_lora_weights": "pissa"}))
    assert peft_adapter.load_peft_adapter(folder, config)[0] == LORA  # as peft: loaded, with a warning
    assert "init_lora_weights='pissa': it belongs to the residual base" in caplog.text
    for broken, message in (({"peft_type": "IA3"}, "only LORA adapters load"),
                            ({"target_modules": None}, "target_modules is not set"),
                            ({"target_modules": ["c_attn"]}, "matches no module of this qwen3 model")):
        (folder / peft_config.ADAPTER_CONFIG).write_text(json.dumps({**settings, **broken}))
        with pytest.raises(ValueError, match=message):
            peft_adapter.load_peft_adapter(folder, config)
