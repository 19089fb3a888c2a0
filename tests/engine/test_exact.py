"""Exact numerics (issue 52, ``ModelConfig.numerics="exact"``): every sampled token's engine log-prob equals
the trainer's bit for bit, in float32 and bfloat16, over random batch mixes, slot counts and trainer packings,
multi-turn sessions with tool outputs, forks and shared prompt pages, a page pool too small for every slot,
weights updated in flight (each token against its own version), micro-batched ``rl_step`` rows; the run
config's switch reaches the model and keeps pi_old the sampler's (no recompute pass, no TIS). LoRA:
``test_exact_lora``; FP8 rollouts: ``test_exact_fp8.py``.

Speed: every test runs the model config of ``docs/exact_numerics.md`` (with the engine tests' weights), one
of two engine configs and one trainer shape per dtype, so the whole file compiles a handful of programs."""

import asyncio
import dataclasses
import pathlib
import re
from unittest import mock

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import tiny_cpu
from rstar2jax import models
from rstar2jax.engine import Engine, EngineConfig, EngineCore, SamplingParams, generate
from rstar2jax.models import exact_kernels
from rstar2jax.train import ConfigError, TokenSequence, build_batch, init_train_state, make_rl_step, parse
from tests.train.scripted import set_fields

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "exact_numerics.md"
ROWS, ROW = 2, 256  # the trainer's packed rows: one compiled forward per dtype for every test
ONE_SLOT = EngineConfig(num_slots=1, max_len=64, token_buckets=(16,), eos_token_ids=())  # the guide's
# Four slots and 8 pages of 16 tokens: at most two full-length sequences fit, the others wait for pages and
# evict cached prefixes; freed pages are poisoned (NaN), so a stale read would show.
FOUR_SLOTS = dataclasses.replace(ONE_SLOT, num_slots=4, num_pages=9, poison_freed_pages=True)
SAMPLED = SamplingParams(temperature=1.0)
_sequence_logprobs = jax.jit(models.sequence_logprobs, static_argnums=1)


@pytest.fixture(scope="module")
def exact(tiny_qwen3):
    """dtype -> (config, params): the guide's model config in exact numerics, the engine tests' weights
    (large enough that a rounding difference changes log-probs)."""
    base = models.preset("tiny", numerics="exact")
    return {dtype: (dataclasses.replace(base, compute_dtype=dtype), tiny_qwen3.params)
            for dtype in ("float32", "bfloat16")}


def _trainer_logprobs(params, config, sequences, row_of) -> list[np.ndarray]:
    """The trainer's log-probs (``models.sequence_logprobs``, as the RL step computes them) of each sequence's
    tokens after its first, sequence ``i`` packed into row ``row_of[i]`` of ``ROWS`` rows of ``ROW``."""
    tokens, targets, positions, segments = (np.zeros((ROWS, ROW), np.int32) for _ in range(4))
    fill, where = [0] * ROWS, []
    for i, seq in enumerate(sequences):
        row, n = row_of[i], len(seq) - 1
        start = fill[row]
        assert start + n <= ROW
        tokens[row, start:start + n], targets[row, start:start + n] = seq[:-1], seq[1:]
        positions[row, start:start + n], segments[row, start:start + n] = np.arange(n), i + 1
        where.append((row, start, n))
        fill[row] += n
    logp, _ = _sequence_logprobs(params, config, *map(jnp.asarray, (tokens, targets)),
                                 positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments))
    logp = np.asarray(logp)
    return [logp[row, start:start + n] for row, start, n in where]


def _assert_sampled_are_the_trainers(params, config, records, row_of=None):
    """``records``: (prompt, response, loss_mask, logprobs); each sampled token's log-prob is the trainer's
    over the whole conversation, bit for bit."""
    sequences = [list(prompt) + list(response) for prompt, response, _, _ in records]
    trainer = _trainer_logprobs(params, config, sequences, row_of or [i % ROWS for i in range(len(records))])
    for (prompt, _, mask, logprobs), logp in zip(records, trainer, strict=True):
        sampled = np.flatnonzero(mask)
        np.testing.assert_array_equal(np.asarray(logprobs, np.float32)[sampled],
                                      logp[len(prompt) - 1 + sampled])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@hypothesis.settings(max_examples=2, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data())
def test_engine_logprobs_are_the_trainers_bit_for_bit(exact, dtype, data):
    """Random prompts (count, lengths) and trainer packing: sampled at temperature 1 on one slot and on four
    (where they wait for pages), each token's engine log-prob is the trainer's exactly, and the tokens and
    log-probs do not depend on the slot count."""
    config, params = exact[dtype]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    prompts = [rng.integers(0, 256, n).tolist() for n in rng.integers(2, 40, data.draw(st.integers(1, 6)))]
    row_of = data.draw(st.lists(st.integers(0, ROWS - 1), min_size=len(prompts), max_size=len(prompts)))
    runs = [generate(params, config, prompts, max_new_tokens=10, temperature=1.0, engine_config=engine,
                     seed=7) for engine in (ONE_SLOT, FOUR_SLOTS)]
    records = [(p, g.tokens, [1] * len(g.tokens), g.logprobs) for p, g in zip(prompts, runs[0], strict=True)]
    _assert_sampled_are_the_trainers(params, config, records, row_of)
    assert [g.tokens for g in runs[1]] == [g.tokens for g in runs[0]]
    assert [g.logprobs for g in runs[1]] == [g.logprobs for g in runs[0]]


def test_multi_turn_forks_and_shared_prompts_are_exact(exact):
    """Groups sharing a prompt prefix (the prefix cache) fork, sample, take tool outputs and sample again, in
    parallel, in bfloat16, on a pool that holds two of them at a time: every sampled token's log-prob is the
    trainer's bit for bit over the whole conversation."""
    config, params = exact["bfloat16"]
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 17).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (3, 9)] + [rng.integers(0, 256, 5).tolist()]
    records = []

    async def rollout(session, j):
        await session.generate(max_new_tokens=3 + j)
        session.append(rng.integers(0, 256, 4).tolist())  # a tool output
        await session.generate(max_new_tokens=4)
        records.append((session.prompt_ids, session.response_ids, session.loss_mask, session.logprobs))
        session.close()

    async def group(engine, prompt):  # opened and run together: 6 sessions share 4 slots
        sessions = await engine.open(prompt, n=2, sampling=SAMPLED, max_tokens=24)
        await asyncio.gather(*[rollout(s, j) for j, s in enumerate(sessions)])

    async def scenario():
        async with Engine(params, config, FOUR_SLOTS) as engine:
            await asyncio.gather(*[group(engine, p) for p in prompts])

    asyncio.run(scenario())
    assert len(records) == 6
    _assert_sampled_are_the_trainers(params, config, records)


def _drain(core):
    while core.num_active:
        for record, chunk in core.step():
            record.receive(chunk)


@pytest.mark.parametrize("on_update", ["recompute", "keep"])
def test_weights_updated_in_flight_each_token_is_its_versions(exact, on_update):
    """New weights while sequences decode (``on_update="recompute"``: every key/value prefilled again; with
    ``"keep"`` the new weights change only what no key/value depends on): each sampled token's log-prob is
    the trainer's under the weights of the version that sampled it, bit for bit, both versions present."""
    config, old = exact["float32"]
    layers = old["layers"]
    head_only = {**old, "final_norm": old["final_norm"] * 1.5,
                 "layers": {**layers, "down_proj": layers["down_proj"].at[-1].multiply(-2.0)}}
    new = jax.tree.map(lambda x: x * 1.05, old) if on_update == "recompute" else head_only
    core = EngineCore(old, config, FOUR_SLOTS)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 20)]
    records = [record for group in core.admit([(p, 1, SAMPLED, 44, (i,)) for i, p in enumerate(prompts)])
               for record in group]
    for record in records:  # a few decode chunks: the update lands between two of them
        core.start(record, max_new_tokens=40)
    while not all(record.response_ids for record in records):
        for record, chunk in core.step():
            record.receive(chunk)
    core.update_weights(new, 1, on_update=on_update)
    _drain(core)
    for version, params in ((0, old), (1, new)):
        tagged = [(r.prompt_ids, r.response_ids, np.asarray(r.policy_versions) == version, r.logprobs)
                  for r in records]
        assert any(mask.any() for _, _, mask, _ in tagged)
        _assert_sampled_are_the_trainers(params, config, tagged)


def _rl_batch(prompts, gens):
    """The ``rl_step``'s batch of engine samples: each prompt and its sampled tokens (the loss on those, with
    the sampler's log-probs; advantages -0.5 / 0.5 in turn), packed into 4 rows of 64."""
    sequences = [TokenSequence(tokens=p + g.tokens, loss_mask=[0] * len(p) + [1] * len(g.tokens),
                               logprobs=[0.0] * len(p) + list(g.logprobs), advantage=float(i % 2) - 0.5)
                 for i, (p, g) in enumerate(zip(prompts, gens, strict=True))]
    return build_batch(sequences, seq_len=64, num_rows=4, pack=True, with_rl_fields=True)


def test_rl_step_mismatch_metrics_read_zero_on_micro_batched_packed_rows(exact):
    """Engine samples packed into rows and split into two micro-batches: the ``rl_step`` recomputes the
    trainer's log-probs of the loss tokens and its sampler-vs-trainer mismatch metrics read exactly 0."""
    config, params = exact["float32"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 12, 3, 20, 8)]
    gens = generate(params, config, prompts, max_new_tokens=8, temperature=1.0, engine_config=FOUR_SLOTS,
                    seed=2)
    batch = _rl_batch(prompts, gens)
    optimizer = optax.sgd(1e-3)
    step = make_rl_step(config, optimizer, num_microbatches=2)
    _, metrics = step(init_train_state(jax.tree.map(jnp.copy, params), optimizer, 0), batch)
    assert float(metrics["tokens"]) == 8 * len(prompts)
    assert float(metrics["mismatch_abs_log_ratio"]) == float(metrics["mismatch_k3_kl"]) == 0.0


def test_run_config_switch_reaches_the_model_and_keeps_pi_old_the_samplers():
    """``rollout.numerics='exact'``: the policy's model (the engine's and the trainer's) computes exactly,
    'auto' pi_old is the sampler's (no recompute pass) without TIS; with an FP8 rollout too, the trainer
    computing through its precision (``test_exact_fp8.py``)."""
    config = tiny_cpu.get_config()
    default, exact = parse(config), parse(set_fields(config, {"rollout.numerics": "exact"}))
    assert (default.policy.model.numerics, exact.policy.model.numerics) == ("default", "exact")
    assert (exact.rl.loss.old_logprobs, exact.rl.loss.rollout_is_cap) == ("sampler", None)
    fp8 = parse(set_fields(config, {"rollout.numerics": "exact", "rollout.kv_dtype": "fp8"}))
    assert fp8.policy.model.rollout_precision.kv_dtype == "fp8"
    assert (fp8.rl.loss.old_logprobs, fp8.rl.loss.rollout_is_cap) == ("sampler", None)
    with pytest.raises(ValueError, match="numerics='fast'"):
        dataclasses.replace(default.policy.model, numerics="fast")


def test_run_config_picks_the_exact_kernels():
    """``model.exact_kernels`` reaches the policy's model (default ``"auto"``); an unknown name is a
    ConfigError naming the field."""
    config = set_fields(tiny_cpu.get_config(), {"rollout.numerics": "exact"})
    assert parse(config).policy.model.exact_kernels == "auto"
    forced = parse(set_fields(config, {"model.exact_kernels": "pallas_triton"})).policy.model
    assert (forced.numerics, forced.exact_kernels) == ("exact", "pallas_triton")
    with pytest.raises(ConfigError, match="model.exact_kernels"):
        parse(set_fields(config, {"model.exact_kernels": "triton"}))


def test_the_guide_runs():
    """docs/exact_numerics.md: its Python block (an engine's log-probs against the trainer's) runs."""
    (block,) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.DOTALL)
    exec(compile(block, str(GUIDE), "exec"), {})  # noqa: S102 (the guide's own code)


def test_pallas_kernels_engine_logprobs_are_the_trainers(exact):
    """``exact_kernels="pallas_triton"`` forced (Pallas' interpreter on CPU: the GPU kernels' programs), in
    bfloat16: the engine (four slots sharing a small pool) and the trainer both run the kernels, and every
    sampled token's log-prob is the trainer's bit for bit."""
    config, params = exact["bfloat16"]
    config = dataclasses.replace(config, exact_kernels="pallas_triton")
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 2)]
    kernels = ("attention", "row_matmul")
    spies = [mock.patch.object(exact_kernels, name, wraps=getattr(exact_kernels, name)) for name in kernels]
    with spies[0] as attention, spies[1] as row_matmul:
        gens = generate(params, config, prompts, max_new_tokens=6, temperature=1.0, engine_config=FOUR_SLOTS,
                        seed=4)
        assert attention.called and row_matmul.called  # traced into the engine's step
        attention.reset_mock()
        row_matmul.reset_mock()
        records = [(p, g.tokens, [1] * len(g.tokens), g.logprobs) for p, g in zip(prompts, gens, strict=True)]
        _assert_sampled_are_the_trainers(params, config, records)
        assert attention.called and row_matmul.called  # and into the trainer's forward
