"""Training attention (models.attention): every implementation against the dense reference, packed rows."""

import dataclasses
import functools
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.models import attention as attention_lib
from rstar2jax.models import attention_kernels as kernels
from rstar2jax.models import flash_attention, platform, segments
from tests.models.conftest import REFERENCE_CONFIG, logprob_loss

# Rows of [3, 50]: contiguous segments of several lengths, a padding run (id 0), one whole row.
SEGMENTS = np.array([[1] * 10 + [2] * 15 + [3] * 25, [1] * 33 + [0] * 17, [7] * 50], np.int32)


def _inputs(seed=0, shape=(3, 50), heads=4, kv_heads=2, head_dim=8):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (
        jax.random.normal(key, (*shape, n, head_dim))
        for key, n in zip(keys[:3], (heads, kv_heads, kv_heads), strict=True)
    )
    cotangent = jax.random.normal(keys[3], q.shape)
    return q * head_dim**-0.5, k, v, cotangent


def _value_and_grads(q, k, v, cotangent, segments, **options):
    out, vjp = jax.vjp(lambda q, k, v: attention_lib.attention(q, k, v, segments, **options), q, k, v)
    return (out, *vjp(cotangent))


def _blockwise(block):
    return dict(implementation="blockwise", block_size=block)


def _tokamax_xla_kernel(q, k, v, segment_ids):
    """tokamax's XLA kernel runs the same segment mask on CPU (the GPU kernels get it the same way)."""
    return kernels._tokamax_attention(
        q, k, v, segments.segment_starts(segment_ids), kernels=("xla_chunked",)
    )


def test_dense_reference_is_causal_attention_within_each_segment():
    q, k, v, _ = _inputs()
    out = np.asarray(attention_lib.attention(q, k, v, SEGMENTS, implementation="dense"))
    b, t = 0, 17  # segment 2 spans [10, 25): query 17 sees keys 10..17
    heads, kv_heads = q.shape[2], k.shape[2]
    for h in range(heads):
        kh = h // (heads // kv_heads)
        scores = np.asarray(k[b, 10:18, kh]) @ np.asarray(q[b, t, h])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        np.testing.assert_allclose(out[b, t, h], probs @ np.asarray(v[b, 10:18, kh]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [8, 16, 64])
@pytest.mark.parametrize("segments", ["packed", "none"])
def test_blockwise_values_and_gradients_match_dense(block, segments):
    """Several blocks (50 is padded to a multiple of the block), segment starts inside blocks, GQA."""
    q, k, v, cotangent = _inputs(seed=block)
    segment_ids = SEGMENTS if segments == "packed" else None
    expected = _value_and_grads(q, k, v, cotangent, segment_ids, implementation="dense")
    got = _value_and_grads(q, k, v, cotangent, segment_ids, **_blockwise(block))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


def test_tokamax_segment_mask_matches_dense():
    q, k, v, cotangent = _inputs(seed=3)
    expected = _value_and_grads(q, k, v, cotangent, SEGMENTS, implementation="dense")
    out, vjp = jax.vjp(lambda q, k, v: _tokamax_xla_kernel(q, k, v, SEGMENTS), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *vjp(cotangent)), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


_FLAGS_PROBE = """
import sys
import jax
import numpy as np
from absl import flags

HOST = flags.DEFINE_integer("host_option", 1, "a flag of the host program")
sys.argv = ["host", "--host_option=7", "--not_an_absl_option"]  # a command line absl cannot parse
FLAGS_BEFORE = flags.FLAGS.is_parsed()
flags.FLAGS.host_option = 3  # set by the host program before it parses

from rstar2jax.models import attention_kernels as attention
q = k = v = jax.numpy.ones((1, 8, 2, 8))
starts = np.zeros((1, 8), np.int32)
run = lambda q, k, v: attention._tokamax_attention(q, k, v, starts, kernels=("xla_chunked",))
out, pullback = jax.vjp(run, q, k, v)
grads = pullback(jax.numpy.ones_like(out))
finite = bool(np.isfinite(grads[0]).all())
print(FLAGS_BEFORE, flags.FLAGS.is_parsed(), flags.FLAGS["host_option"].value, finite)
"""


def test_tokamax_leaves_the_host_programs_absl_flags_as_it_found_them():
    """tokamax reads its options from absl flags (parsing sys.argv while they are unparsed): forward and
    backward of its attention leave FLAGS unparsed, a host flag's value as set, sys.argv unread."""
    pytest.importorskip("tokamax")
    out = subprocess.run([sys.executable, "-c", _FLAGS_PROBE], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[2]).stdout
    assert out.split() == ["False", "False", "3", "True"]


def _temp_bytes(length, block=256):
    q, k, v, cotangent = _inputs(shape=(1, length), heads=2, kv_heads=1, head_dim=16)
    grads = jax.jit(lambda *args: _value_and_grads(*args, None, **_blockwise(block)))
    return grads.lower(q, k, v, cotangent).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_sequence_length():
    """Compiled temporaries of forward + backward: doubling T at most doubles them (dense would quadruple)."""
    small, large = _temp_bytes(1024), _temp_bytes(4096)
    assert large <= 4.4 * small, (small, large)
    assert large < 4096 * 4096 * 2 * 4  # less than the dense [H, T, T] float32 scores


@pytest.mark.parametrize("implementation", ["blockwise", "pallas_triton"])
def test_model_with_fused_attention_matches_dense_on_packed_rows(implementation):
    """Whole model (scanned layers), loss and parameter gradients: blockwise (blocks of 8 over 50 tokens) and
    the Pallas kernels (interpreted) vs the dense path."""
    base = dataclasses.replace(REFERENCE_CONFIG, head_dim=16)
    tokens = np.random.default_rng(0).integers(0, base.vocab_size, SEGMENTS.shape).astype(np.int32)
    starts = np.asarray(segments.segment_starts(SEGMENTS))
    positions = (np.arange(SEGMENTS.shape[1])[None] - starts).astype(np.int32)
    params = models.init_params(base, jax.random.key(0))

    def loss(params, config):
        logp, entropy = models.sequence_logprobs(
            params,
            config,
            tokens[:, :-1],
            tokens[:, 1:],
            positions=positions[:, :-1],
            segment_ids=SEGMENTS[:, :-1],
        )
        return logp.sum() + entropy.sum(), (logp, entropy)

    results = {}
    for name in ("dense", implementation):
        config = dataclasses.replace(base, attention=name, attention_block_size=8)
        results[name] = jax.value_and_grad(functools.partial(loss, config=config), has_aux=True)(params)
    # Token by token: the loss sums ~200 terms whose signs cancel, so its own relative error says little.
    (_, per_token), (_, dense_per_token) = results[implementation][0], results["dense"][0]
    for value, dense in zip(per_token, dense_per_token, strict=True):
        np.testing.assert_allclose(value, dense, atol=1e-5, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
        results[implementation][1],
        results["dense"][1],
    )


@pytest.mark.parametrize("policy", ["save_projections", "save_attention", "full"])
def test_remat_policies_keep_loss_and_gradients(reference, policy):
    variant = dataclasses.replace(reference.config, remat_policy=policy)

    loss_and_grad = jax.value_and_grad(functools.partial(logprob_loss, config=variant), has_aux=True)
    (loss, _), grads = loss_and_grad(reference.params, reference.tokens)
    np.testing.assert_allclose(loss, reference.loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, reference.grads)


def test_bad_attention_options_are_named():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="segment_ids shape"):
        attention_lib.attention(q, k, v, SEGMENTS[:, :10])
    with pytest.raises(ValueError, match="block_size"):
        attention_lib.attention(q, k, v, SEGMENTS, block_size=12)
    with pytest.raises(ValueError, match="attention='flash'"):
        dataclasses.replace(REFERENCE_CONFIG, attention="flash")


def test_token_chunked_mlp_keeps_loss_and_gradients(reference):
    """mlp_chunk_size 4 over 12 tokens: three rematerialised chunks, the same loss and gradients."""
    variant = dataclasses.replace(reference.config, mlp_chunk_size=4, remat_policy="full")

    loss_and_grad = jax.value_and_grad(functools.partial(logprob_loss, config=variant), has_aux=True)
    (loss, _), grads = loss_and_grad(reference.params, reference.tokens)
    np.testing.assert_allclose(loss, reference.loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, reference.grads)


# ---- GPU kernels in Pallas' interpreter, and what "auto" picks (feature detection and the device check
# replaced by stubs that record what they were asked).

SMALL_BLOCKS = flash_attention.Blocks(forward_q=16, forward_k=16, backward_q=16, backward_k=16)
MIXED_BLOCKS = flash_attention.Blocks(forward_q=32, forward_k=16, backward_q=16, backward_k=32)


@pytest.mark.parametrize(
    "kernel, kv_heads",
    [
        (functools.partial(kernels._pallas_triton_attention, blocks=SMALL_BLOCKS), 2),
        (functools.partial(kernels._pallas_triton_attention, blocks=MIXED_BLOCKS), 1),
        (kernels._jax_pallas_mha_attention, 2),
    ],
    ids=["pallas_triton-gqa2", "pallas_triton-mqa-mixed-blocks", "jax_pallas_mha-gqa2"],
)
def test_gpu_kernels_match_dense_in_interpret_mode(monkeypatch, kernel, kv_heads):
    """Packed rows (segment starts inside blocks, a padding run, a whole row; 50 tokens padded to the tile),
    several query and key blocks (so the segment-aware loop bounds skip some), forward and gradients."""
    monkeypatch.setattr(kernels, "pallas_interpreted", lambda: True)  # on a GPU too
    q, k, v, cotangent = _inputs(seed=kv_heads, heads=4, kv_heads=kv_heads, head_dim=16)
    expected = _value_and_grads(q, k, v, cotangent, SEGMENTS, implementation="dense")
    starts = segments.segment_starts(SEGMENTS)
    out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, starts), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *vjp(cotangent)), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.skipif(platform.accelerator() in ("cuda", "rocm"),
                    reason="on a GPU the kernels compile and run (test_gpu_kernels_on_this_gpu)")
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("implementation", ["pallas_triton", "jax_pallas_mha"])
def test_gpu_kernels_lower_through_triton_for_cuda_and_rocm(monkeypatch, platform, implementation):
    """No GPU needed: the forward and both backward kernels go through Pallas' Triton lowering (the part a GPU
    compile starts from) at the Qwen3 head dimension in bfloat16, a row that is not a multiple of the tile."""
    monkeypatch.setattr(kernels, "pallas_interpreted", lambda: False)
    q, k, v, cotangent = (x.astype(jnp.bfloat16) for x in _inputs(shape=(2, 300), head_dim=128))
    segments = np.repeat(np.array([[1, 2, 3], [4, 4, 4]], np.int32), [100, 150, 50], axis=1)

    def value_and_grads(q, k, v):
        return _value_and_grads(q, k, v, cotangent, segments, implementation=implementation)

    try:
        text = jax.jit(value_and_grads).trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()
    except RuntimeError as error:
        if "No supported GPU devices" in str(error):  # JAX >= 0.11 lowers Triton only for a known GPU
            pytest.skip(f"this JAX lowers Pallas Triton kernels only with a GPU: {error}")
        raise
    assert len(re.findall(r"custom_call @\S*triton", text)) == 3  # forward, and two for the backward


@pytest.mark.skipif(platform.accelerator() not in ("cuda", "rocm"), reason="runs the kernels on a GPU")
def test_gpu_kernels_on_this_gpu():
    """Compiled for this GPU: every kernel "auto" may pick passes the device check at the Qwen3 head dimension
    in bfloat16, and ours matches the dense reference at float32 precision (the tests pin it)."""
    for name in attention_lib.AUTO_CANDIDATES[platform.accelerator()]:
        if kernels.unavailable_reason(name) is None:
            assert attention_lib.probe(name, head_dim=128, dtype="bfloat16") is None, name
    q, k, v, cotangent = _inputs(heads=4, kv_heads=2, head_dim=64)
    expected = _value_and_grads(q, k, v, cotangent, SEGMENTS, implementation="dense")
    got = _value_and_grads(q, k, v, cotangent, SEGMENTS, implementation="pallas_triton")
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


def test_probe_passes_a_correct_kernel_and_names_what_is_wrong_with_others(monkeypatch):
    """The on-device check (here: interpreted, bfloat16): a correct kernel passes; one that ignores the
    segments, or one that cannot trace, is rejected with the reason."""
    assert attention_lib.probe("pallas_triton", head_dim=16, dtype="bfloat16") is None

    def unsegmented(q, k, v, starts):
        return attention_lib._dense_causal_attention(q, k, v, jnp.zeros_like(starts))

    def broken(q, k, v, starts):
        raise TypeError("Mesh.__init__() got an unexpected keyword argument 'out_shape'")

    def tf32_like(q, k, v, starts):  # off by ~1e-3 relative, as TF32 inputs are
        return attention_lib._dense_causal_attention(q, k, v, starts) * (1 + 1e-3)

    monkeypatch.setitem(kernels.GPU_KERNELS, "pallas_triton", unsegmented)
    assert "differs from the dense reference" in attention_lib.probe("pallas_triton", head_dim=16)
    monkeypatch.setitem(kernels.GPU_KERNELS, "pallas_triton", broken)
    assert attention_lib.probe("pallas_triton", head_dim=16).startswith("TypeError: Mesh.__init__()")
    # float32: TF32-level error passes at the default matmul precision, not where full float32 is asked for
    # (the caller's setting, though the check runs in a thread of its own).
    monkeypatch.setitem(kernels.GPU_KERNELS, "pallas_triton", tf32_like)
    with jax.default_matmul_precision("default"):
        assert attention_lib.probe("pallas_triton", head_dim=16, dtype="float32") is None
    with jax.default_matmul_precision("highest"):
        assert "relative error 1.0" in attention_lib.probe("pallas_triton", head_dim=16, dtype="float32")


@pytest.fixture
def stub_device(monkeypatch):
    """``set(accelerator, available, passing)``: the accelerator ``"auto"`` sees, the GPU kernels the
    installed packages offer and those that pass the device check; returns the kernels probed, in order."""
    probed = []

    def set_device(platform, available=("tokamax", "pallas_triton", "jax_pallas_mha"), passing=()):
        monkeypatch.setattr(attention_lib, "accelerator", lambda: platform)
        monkeypatch.setattr(
            attention_lib, "unavailable_reason",
            lambda name, head_dim=128: None if name in available else f"{name} is not installed",
        )

        def probe(name, head_dim=128, dtype="bfloat16"):
            probed.append(name)
            return None if name in passing else f"{name} failed to compile"

        monkeypatch.setattr(attention_lib, "probe", probe)
        return probed

    attention_lib._auto_choice.cache_clear()
    yield set_device
    attention_lib._auto_choice.cache_clear()


def test_auto_on_cuda_takes_the_first_kernel_that_is_installed_and_passes(stub_device):
    probed = stub_device("cuda", available=("pallas_triton", "jax_pallas_mha"), passing=("pallas_triton",))
    choice = attention_lib.auto_choice()
    assert choice.implementation == "pallas_triton"
    assert choice.rejected == (("tokamax", "tokamax is not installed"),)
    assert "passed its on-device check" in choice.reason
    assert probed == ["pallas_triton"]
    assert attention_lib.resolve_implementation("auto") == "pallas_triton"


def test_auto_on_cuda_prefers_tokamax_when_it_passes(stub_device):
    stub_device("cuda", passing=("tokamax", "pallas_triton"))
    assert attention_lib.resolve_implementation("auto") == "tokamax"


def test_auto_passes_over_a_kernel_that_fails_its_check(stub_device):
    """tokamax 0.0.12 under JAX 0.11: installed, but its kernel does not trace: the next kernel is used."""
    probed = stub_device("cuda", passing=("jax_pallas_mha",))
    choice = attention_lib.auto_choice()
    assert choice.implementation == "jax_pallas_mha"
    assert probed == ["tokamax", "pallas_triton", "jax_pallas_mha"]
    assert [name for name, _ in choice.rejected] == ["tokamax", "pallas_triton"]


def test_auto_on_rocm_never_tries_tokamax(stub_device):
    probed = stub_device("rocm", passing=("tokamax", "pallas_triton"))
    assert attention_lib.resolve_implementation("auto") == "pallas_triton"
    assert probed == ["pallas_triton"]


def test_auto_falls_back_to_blockwise_loudly_when_no_gpu_kernel_works(stub_device):
    stub_device("cuda", passing=())
    with pytest.warns(RuntimeWarning, match="no GPU kernel works here.*pallas_triton failed to compile"):
        choice = attention_lib.auto_choice()
    assert choice.implementation == "blockwise"
    assert len(choice.rejected) == 3


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_auto_is_blockwise_without_a_gpu_and_checks_nothing(stub_device, platform):
    probed = stub_device(platform, passing=("tokamax", "pallas_triton", "jax_pallas_mha"))
    assert attention_lib.resolve_implementation("auto") == "blockwise"
    assert probed == []
    with pytest.raises(ValueError, match="attention='flash' for training: expected one of"):
        attention_lib.resolve_implementation("flash")


def test_auto_choice_is_checked_once_per_head_dim_and_dtype(stub_device):
    probed = stub_device("cuda", available=("pallas_triton",), passing=("pallas_triton",))
    for _ in range(3):
        attention_lib.auto_choice(128, "bfloat16")
    attention_lib.auto_choice(64, "bfloat16")
    attention_lib.auto_choice(128, jnp.float32)
    assert probed == ["pallas_triton"] * 3


def test_auto_checks_its_kernel_even_when_first_resolved_inside_a_trace(monkeypatch):
    """The training step resolves "auto" while it is being traced: the device check must still run (and
    pass) rather than be staged into the step. Here on a stubbed CUDA machine, the kernel interpreted."""
    monkeypatch.setattr(attention_lib, "accelerator", lambda: "cuda")
    monkeypatch.setattr(kernels, "pallas_interpreted", lambda: True)
    attention_lib._auto_choice.cache_clear()
    try:
        q, k, v, _ = _inputs(heads=4, kv_heads=2, head_dim=16)
        auto = jax.jit(lambda q, k, v: attention_lib.attention(q, k, v, SEGMENTS, implementation="auto"))
        out = auto(q, k, v)
        choice = attention_lib.auto_choice(16, "float32")
    finally:
        attention_lib._auto_choice.cache_clear()
    assert choice.implementation == "pallas_triton", choice
    expected = attention_lib.attention(q, k, v, SEGMENTS, implementation="dense")
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)


def test_auto_falls_back_to_blockwise_when_its_kernel_cannot_trace_these_shapes(stub_device, monkeypatch):
    """The device check passed at its own shape, but these inputs fail while tracing: "auto" warns and runs
    the portable path; an explicit implementation raises."""
    stub_device("cuda", available=("pallas_triton",), passing=("pallas_triton",))
    q, k, v, _ = _inputs()
    expected = attention_lib.attention(q, k, v, SEGMENTS, implementation="blockwise", block_size=16)

    def broken(*args, **kwargs):
        raise TypeError("Mesh.__init__() got an unexpected keyword argument 'out_shape'")

    monkeypatch.setitem(kernels.GPU_KERNELS, "pallas_triton", broken)
    with pytest.warns(RuntimeWarning, match="pallas_triton failed"):
        out = attention_lib.attention(q, k, v, SEGMENTS, implementation="auto", block_size=16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(TypeError, match="out_shape"):
        attention_lib.attention(q, k, v, SEGMENTS, implementation="pallas_triton")


# ---- one vocabulary for training and decoding; old names are aliases


@pytest.mark.parametrize(
    "old, new, use",
    [("xla", "dense", "training"), ("jnp", "blockwise", "decoding"),
     ("pallas_gpu", "pallas_triton", "decoding"), ("pallas_interpret", "pallas_triton", "decoding"),
     ("blockwise", "blockwise", "decoding")],
)
def test_old_attention_names_resolve_to_their_new_ones(old, new, use):
    assert attention_lib.resolve_attention(old, use=use) == new


def test_the_old_dense_name_computes_the_same_attention():
    q, k, v, _ = _inputs()
    old = attention_lib.attention(q, k, v, SEGMENTS, implementation="xla")
    np.testing.assert_array_equal(np.asarray(old), np.asarray(attention_lib.attention(q, k, v, SEGMENTS,
                                                                                      implementation="dense")))
    assert dataclasses.replace(REFERENCE_CONFIG, attention="xla").attention == "dense"


@pytest.mark.parametrize("name", ["dense", "tokamax", "jax_pallas_mha", "xla", "flash", 3])
def test_decoding_rejects_training_only_and_unknown_names_naming_what_it_takes(name):
    expected = r"for decoding: expected one of \('auto', 'blockwise', 'pallas_triton'\)"
    with pytest.raises(ValueError, match=expected):
        attention_lib.resolve_attention(name, use="decoding")
    with pytest.raises(ValueError, match="attention use 'serving'"):
        attention_lib.resolve_attention("auto", use="serving")


@pytest.mark.parametrize("accelerator, expected", [("cuda", "pallas_triton"), ("rocm", "blockwise"),
                                                   ("cpu", "blockwise"), ("tpu", "blockwise")])
def test_decoding_auto_is_the_pallas_kernel_on_cuda_only(monkeypatch, accelerator, expected):
    monkeypatch.setattr(attention_lib, "accelerator", lambda: accelerator)
    assert attention_lib.resolve_attention("auto", use="decoding") == expected
