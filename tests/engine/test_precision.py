"""Low-precision engines: FP8 weights and FP8 KV pages against the float32 engine and trainer on a tiny
trained policy, FP8 pages through forks (through the prefix cache and page reuse: ``test_paged``), pool
sizing in bytes, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.tiny_policy import OPENER, conversations
from rstar2jax import algo, models
from rstar2jax.data.conversation import encode_text, render_chat
from rstar2jax.engine import (
    EngineConfig,
    EngineCore,
    SamplingParams,
    generate,
    init_state,
    paged_attention,
    pages_for_bytes,
)
from rstar2jax.engine.programs import PROGRAMS, engine_weights
from rstar2jax.models import platform
from rstar2jax.models.quantization import Fp8Weight
from rstar2jax.serve import load_policy
from tests.engine.conftest import ENGINE_CONFIG, teacher_forced
from tests.engine.test_paged import PAGED_CONFIG, _run

FP8_BOTH = dict(weight_dtype="fp8", weight_block=32, kv_dtype="fp8")
# Bounds the FP8 engine (weights in 32 x 32 blocks and KV pages) keeps against the float32 trainer on the
# tiny policy's taught prompts (measured: mean |delta log p| 0.015, max 0.28 on five prompts x 40 tokens).
MEAN_ABS_LOGPROB_BOUND = 0.05


@pytest.fixture(scope="module")
def taught(tiny_policy_dir):
    """The tiny taught policy (``experiments.tiny_policy``, as the serving tests build it) and the prompts
    of its three conversations, rendered as it was taught them."""
    policy = load_policy(tiny_policy_dir)
    prompts = []
    for messages, tools in conversations(policy.prompt):
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text = render_chat(policy.tokenizer, messages[:first_reply], tools=tools, add_generation_prompt=True)
        prompts.append(encode_text(policy.tokenizer, text + OPENER))
    return policy, prompts


def _trainer_logprobs(policy, prompt, tokens):
    """The float32 trainer's log-probs of ``tokens`` after ``prompt`` (teacher-forced forward)."""
    logprobs = teacher_forced(policy.params, policy.model_config, prompt + tokens)
    return logprobs[np.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1), tokens]


def _mismatch(policy, prompts, results):
    """``algo.rollout_mismatch`` of the engine's sampled-token log-probs against the trainer's."""
    width = max(len(r.tokens) for r in results)
    train, rollout, mask = (np.zeros((len(results), width), np.float32) for _ in range(3))
    for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        n = len(result.tokens)
        train[row, :n] = _trainer_logprobs(policy, prompt, result.tokens)
        rollout[row, :n], mask[row, :n] = result.logprobs, 1
    return {k: float(v) for k, v in algo.rollout_mismatch(train, rollout, mask).items()}


def test_fp8_engine_agrees_with_the_float32_engine_and_trainer(taught):
    """Greedy on the taught prompts, each answer to its end (EOS): the FP8 engine (weights and KV pages)
    picks the float32 engine's tokens, and its log-probs stay within the stated bound of the float32
    trainer's; the float32 engine's within rounding. The engine's weights are FP8 copies: the trainer's stay
    as they were."""
    policy, prompts = taught
    config = EngineConfig(num_slots=4, max_len=384, decode_chunk=8, token_buckets=(4, 64), prefill_tile=16)
    kwargs = dict(max_new_tokens=48, temperature=0.0)
    reference = generate(policy.params, policy.model_config, prompts, engine_config=config, **kwargs)
    fp8_config = dataclasses.replace(config, **FP8_BOTH)
    fp8 = generate(policy.params, policy.model_config, prompts, engine_config=fp8_config, **kwargs)
    assert [r.tokens for r in fp8] == [r.tokens for r in reference]
    assert all(r.finish_reason == "eos" for r in fp8)
    exact, low = _mismatch(policy, prompts, reference), _mismatch(policy, prompts, fp8)
    assert exact["mismatch_abs_log_ratio"] < 1e-4 and exact["mismatch_tokens"] > 3 * 10
    assert 1e-4 < low["mismatch_abs_log_ratio"] < MEAN_ABS_LOGPROB_BOUND, low
    assert low["mismatch_outside_band"] == 0 and low["mismatch_k3_kl"] < 0.01, low
    weights = engine_weights(policy.params, policy.model_config, fp8_config)
    assert isinstance(weights["layers"][0]["q_proj"], Fp8Weight)  # unrolled on the CPU: per-layer FP8 copies
    assert policy.params["layers"]["q_proj"].dtype == jnp.float32


FP8_PAGES = dataclasses.replace(PAGED_CONFIG, kv_dtype="fp8")


def test_fp8_pages_are_copied_with_their_scales_when_a_group_forks(tiny_qwen3):
    """Four greedy samples of one prompt: the prompt's partly filled last page is copied for three of them
    (values and scales). Each sample must then read what the first reads: equal tokens and log-probs."""
    config = dataclasses.replace(FP8_PAGES, prefix_sharing=False)
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    assert core.state.pages.quantized and core.state.pages.k.dtype == jnp.float8_e4m3fn
    (group,) = core.admit([(list(range(1, 20)), 4, SamplingParams(temperature=0.0), 12, (0,))])
    for record in group:
        core.start(record, max_new_tokens=12)
    _run(core)
    first = group[0]
    for record in group[1:]:
        assert record.response_ids == first.response_ids
        np.testing.assert_array_equal(record.logprobs, first.logprobs)
    alone = generate(tiny_qwen3.params, tiny_qwen3.config, [list(range(1, 20))], max_new_tokens=12,
                     engine_config=FP8_PAGES)[0]
    assert alone.tokens == first.response_ids
    np.testing.assert_allclose(alone.logprobs, first.logprobs, atol=2e-3)


def test_fp8_attention_reads_dequantized_pages_and_the_kernel_agrees():
    """Attention over FP8 pages equals attention over their dequantized values (jnp path and the Pallas
    kernel in interpret mode); every stored element is within e4m3's bound of what was written."""
    rng = np.random.default_rng(0)
    K, L, P, page_size, Dh, H = 2, 2, 9, 8, 16, 4
    k = jnp.asarray(rng.normal(size=(K, L, P, page_size, Dh)) * np.exp(rng.uniform(-4, 4, (K, L, P, 1, 1))))
    v = jnp.asarray(rng.normal(size=(K, L, P, page_size, Dh)), jnp.float32)
    (kq, ks), (vq, vs) = paged_attention.quantize_kv(k), paged_attention.quantize_kv(v)
    assert ks.shape == (K, L, P, page_size) and kq.dtype == jnp.float8_e4m3fn
    dequantize = lambda q, s: q.astype(jnp.float32) * s.astype(jnp.float32)[..., None]
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    bound = jnp.maximum(2.0**-4 * jnp.abs(k), 2.0**-10 * ks.astype(jnp.float32)[..., None])
    assert bool(jnp.all(jnp.abs(kd - k) <= bound))
    assert bool(jnp.all(ks.astype(jnp.float32) < 2 * jnp.max(jnp.abs(k), axis=-1) / 448))  # power of 2
    table = jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 0]], jnp.int32)
    positions = jnp.asarray([[27], [12]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 1, H, Dh)), jnp.float32)
    want = paged_attention.paged_attention_reference(q, kd, vd, 1, table, positions, block_pages=2)
    scales = dict(k_scale=ks, v_scale=vs)
    got = paged_attention.paged_attention_reference(q, kq, vq, 1, table, positions, block_pages=2, **scales)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    kernel = paged_attention.paged_decode_attention_pallas(q, kq, vq, 1, table, positions, interpret=True,
                                                           **scales)
    np.testing.assert_allclose(kernel, want, atol=1e-5, rtol=0)


def test_a_pool_of_fixed_bytes_holds_about_twice_the_tokens_in_fp8(tiny_qwen3):
    """Qwen3-1.7B's shape: pages from bytes (and the engine's real page bytes) give FP8 1.97x bfloat16's
    tokens; on the tiny model admission by free pages counts the larger FP8 pool."""
    shape = models.preset("qwen3-1.7b", compute_dtype="bfloat16")
    gib = 2**30
    bf16, fp8 = (pages_for_bytes(gib, shape, page_size=16, kv_dtype=kv) for kv in (None, "fp8"))
    assert fp8 / bf16 == pytest.approx(2 * 128 / 130, rel=1e-3)
    for kv in (None, "fp8"):
        state = jax.eval_shape(lambda kv=kv: init_state(shape, EngineConfig(num_slots=2, max_len=64,
                                                                            kv_dtype=kv)))
        assert state.pages.nbytes_per_page == 16 * paged_attention.kv_bytes_per_token(shape, kv)
    config, budget = tiny_qwen3.config, 40 * 16 * paged_attention.kv_bytes_per_token(tiny_qwen3.config)
    counts = {}
    for kv in (None, "fp8"):
        pages = pages_for_bytes(budget, config, page_size=16, kv_dtype=kv)
        core = EngineCore(tiny_qwen3.params, config, dataclasses.replace(
            ENGINE_CONFIG, num_slots=16, token_buckets=(16,), num_pages=pages, kv_dtype=kv))
        request = ([1] * 30, 1, SamplingParams(), 34, (0,))  # 4 pages each
        counts[kv] = core.admissible([request] * 16)
    assert counts[None] == 39 // 4 and counts["fp8"] == min(16, (pages - 1) // 4) > 1.5 * counts[None]


def test_bad_precision_input_is_rejected_before_any_work(tiny_qwen3, monkeypatch):
    for fields, message in ((dict(weight_dtype="int8"), "weight_dtype='int8'"),
                            (dict(kv_dtype="int4"), "kv_dtype='int4'"),
                            (dict(quantize_head=True), "quantize_head=True needs weight_dtype='fp8'"),
                            (dict(weight_dtype="fp8", weight_block=0), "weight_block must be a positive int"),
                            (dict(fp8_matmul="fast"), "fp8_matmul='fast'")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(ENGINE_CONFIG, **fields)
    assert dataclasses.replace(ENGINE_CONFIG, kv_dtype="bfloat16").cache_dtype == "bfloat16"  # the old name
    compiled = len(PROGRAMS)
    checks = ((dict(weight_dtype="fp8", weight_block=48),
               "FP8 weight block 48 does not divide weight layers/q_proj"),
              (dict(kv_dtype="fp8", attention="pallas_triton"),
               "attention='pallas_triton' cannot read FP8 KV pages"))
    for fields, message in checks:
        if fields.get("attention") == "pallas_triton" and paged_attention.pallas_reads_fp8():
            continue  # a GPU whose kernel reads FP8 pages
        with pytest.raises(ValueError, match=message):
            EngineCore(tiny_qwen3.params, tiny_qwen3.config, dataclasses.replace(ENGINE_CONFIG, **fields))
    # "auto" falls back where the kernel cannot read FP8 pages
    assert paged_attention.decode_attention("auto", "fp8") in ("blockwise", "pallas_triton")
    monkeypatch.setattr(platform, "float8_supported", lambda device=None: False)
    for field in ("weight_dtype", "kv_dtype"):
        with pytest.raises(ValueError, match=f"{field}='fp8' needs float8_e4m3fn, which JAX"):
            config = dataclasses.replace(ENGINE_CONFIG, **{field: "fp8"})
            EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    assert len(PROGRAMS) == compiled  # nothing was compiled for them
