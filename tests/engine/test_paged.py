"""Paged KV cache: attention against dense attention, the page allocator's invariants, sharing, poisoned
pages, a full pool, bad input, and random allocate/fork/free orders against the dense reference."""

import asyncio
import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax.engine import Engine, EngineCore, PageAllocator, SamplingParams, generate
from rstar2jax.engine.paged_attention import paged_attention_reference, paged_decode_attention_pallas
from tests.engine.conftest import ENGINE_CONFIG, teacher_forced

# Small pages and a pool that holds about two full sequences: sharing, waiting and page reuse all happen.
PAGED_CONFIG = dataclasses.replace(ENGINE_CONFIG, page_size=8, num_pages=17, attention_block=16,
                                   poison_freed_pages=True)


def _dense_attention(q, k, v, positions):
    """Softmax attention of q ``[B, T, H, D]`` over dense k/v ``[B, S, K, D]``, keys ``j <= position``."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k)
    mask = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]
    s = jnp.where(mask[:, :, None, None], s, -jnp.inf)
    out = jnp.einsum("btkgs,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(B, T, H, D)


def _random_pages(rng, batch, max_pages, num_pages, page_size, kv_heads, dim, layers=2, layer=1):
    """A layer-stacked pool (unused pages NaN), page tables of distinct pages, and the dense k/v they hold
    at ``layer`` (every other layer's pages hold other values)."""
    pool_k = np.full((kv_heads, layers, num_pages, page_size, dim), np.nan, np.float32)
    pool_v = np.full_like(pool_k, np.nan)
    pool_k[:, :, 0] = pool_v[:, :, 0] = 0.0  # the null page
    ids = rng.permutation(np.arange(1, num_pages))[: batch * max_pages].reshape(batch, max_pages)
    for other in range(layers):
        if other != layer:
            pool_k[:, other, 1:] = rng.normal(size=pool_k[:, other, 1:].shape)
            pool_v[:, other, 1:] = rng.normal(size=pool_v[:, other, 1:].shape)
    dense_k = rng.normal(size=(batch, max_pages * page_size, kv_heads, dim)).astype(np.float32)
    dense_v = rng.normal(size=dense_k.shape).astype(np.float32)
    for b in range(batch):
        for i, page in enumerate(ids[b]):
            span = slice(i * page_size, (i + 1) * page_size)
            pool_k[:, layer, page] = np.transpose(dense_k[b, span], (1, 0, 2))
            pool_v[:, layer, page] = np.transpose(dense_v[b, span], (1, 0, 2))
    return pool_k, pool_v, ids.astype(np.int32), dense_k, dense_v


@pytest.mark.parametrize("block_pages", [1, 3, 8])
def test_paged_attention_reference_equals_dense_attention(block_pages):
    """Rows of several queries (tiles) at their own positions, over one layer of a layer-stacked pool."""
    rng = np.random.default_rng(block_pages)
    B, T, H, K, D, page_size, max_pages = 3, 5, 4, 2, 8, 4, 6
    pool_k, pool_v, table, dense_k, dense_v = _random_pages(rng, B, max_pages, 24, page_size, K, D)
    # Rows end at different lengths; pages past a row's end hold NaN (another sequence's freed pages).
    lengths = np.array([3, 13, 24])
    for b, length in enumerate(lengths):
        used = -(-length // page_size)
        pool_k[:, 1, table[b, used:]] = np.nan
        pool_v[:, 1, table[b, used:]] = np.nan
    positions = np.stack([np.arange(n - T, n) for n in lengths])
    positions[0, :2] = -1  # padding queries
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    out = paged_attention_reference(jnp.asarray(q), jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.int32(1),
                                    jnp.asarray(table), jnp.asarray(positions, jnp.int32),
                                    block_pages=block_pages)
    expected = _dense_attention(q, dense_k, dense_v, np.maximum(positions, 0))
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(expected)[real], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[~real], 0.0)


def test_pallas_decode_kernel_equals_reference():
    """JAX's Pallas GPU paged-attention kernel, run in the Pallas interpreter on this CPU, on layer 1 of a
    stacked pool (its page ids offset by the layer)."""
    rng = np.random.default_rng(1)
    B, H, K, D, page_size, max_pages = 3, 4, 2, 16, 8, 4
    pool_k, pool_v, table, _, _ = _random_pages(rng, B, max_pages, 16, page_size, K, D)
    pool_k, pool_v = np.nan_to_num(pool_k), np.nan_to_num(pool_v)
    positions = np.array([[20], [5], [-1]], np.int32)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32)
    args = (q, jnp.asarray(pool_k), jnp.asarray(pool_v), 1, jnp.asarray(table), jnp.asarray(positions))
    out = paged_decode_attention_pallas(*args, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(paged_attention_reference(*args)), atol=1e-5)


def _check_allocator(pool: PageAllocator, num_pages: int) -> None:
    """Reference counts equal the rows holding each page; free and cached pages are exactly the unheld ones,
    and cached ones are registered."""
    counts = np.zeros(num_pages, np.int64)
    for slot, held in enumerate(pool.held):
        row = pool.table[slot]
        assert (row[held:] == 0).all() and (row[:held] > 0).all()
        np.add.at(counts, row[:held], 1)
    np.testing.assert_array_equal(pool.refcount, counts)
    free, cached = set(pool.free_pages), set(pool.cached_pages)
    assert len(free) == len(pool.free_pages) and 0 not in free and not free & cached
    assert free | cached == {p for p in range(1, num_pages) if counts[p] == 0}
    assert all(pool.is_registered(page) for page in cached)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.sampled_from(["grow", "fork", "release", "share", "shrink"]),
                                     st.integers(0, 5), st.integers(1, 40)), max_size=40))
def test_page_allocator_keeps_its_invariants(ops):
    num_pages, page_size, num_slots = 64, 4, 6
    pool = PageAllocator(num_pages, page_size, num_slots, 10)
    lengths = [0] * num_slots
    prompts = {}
    for op, slot, n in ops:
        try:
            if op == "grow":
                n = min(lengths[slot] + n, 40)
                pool.grow(slot, n)
                lengths[slot] = max(lengths[slot], n)
            elif op == "fork" and lengths[slot]:
                dsts = [d for d in range(num_slots) if not pool.held[d]][: n % 3 + 1]
                copies = pool.fork(slot, dsts, lengths[slot])
                assert len(copies) == len(dsts)
                pending = (lengths[slot] - 1) // page_size
                for dst, (page, copy) in zip(dsts, copies, strict=True):
                    assert page == pool.table[slot, pending] and pool.refcount[copy] == 1
                    np.testing.assert_array_equal(pool.table[dst, :pending], pool.table[slot, :pending])
                    lengths[dst] = lengths[slot]
            elif op == "shrink" and lengths[slot]:  # pages given ahead of a decode that stopped sooner
                pool.grow(slot, min(lengths[slot] + n, 40))
                freed = pool.shrink(slot, lengths[slot])
                assert pool.held[slot] == -(-lengths[slot] // page_size)
                assert all(pool.refcount[page] == 0 for page in freed)
            elif op == "release":
                pool.register(slot, list(range(lengths[slot])), lengths[slot] - 1)
                pool.release(slot)
                lengths[slot] = 0
            elif op == "share" and not pool.held[slot]:
                tokens = prompts.get(n % 3) or list(range(n % 3, n % 3 + 30))
                prompts[n % 3] = tokens
                pages = pool.match(tokens)
                pool.attach(slot, pages)
                pool.grow(slot, len(tokens))
                pool.register(slot, tokens, len(tokens) - 1)
                lengths[slot] = len(tokens)
        except RuntimeError as error:  # the pool ran out: nothing may have changed half-way
            assert "exhausted" in str(error)
        except ValueError as error:
            assert "holds" in str(error) or "shares" in str(error)
        _check_allocator(pool, num_pages)


def _check_against_dense(tiny, prompt, response, loss_mask, logprobs, entropies=None, greedy=True):
    """Every sampled token has the log-prob (and entropy) of a full (dense, cache-free) forward over the
    record, and is its greedy choice if ``greedy``."""
    reference = teacher_forced(tiny.params, tiny.config, prompt + response)
    sampled = np.flatnonzero(loss_mask)
    positions = len(prompt) + sampled - 1
    if greedy:
        np.testing.assert_array_equal(np.asarray(response)[sampled], reference[positions].argmax(-1))
    picked = reference[positions, np.asarray(response)[sampled]]
    np.testing.assert_allclose(np.asarray(logprobs)[sampled], picked, atol=1e-5)
    if entropies is not None:
        expected = -np.sum(np.exp(reference[positions]) * reference[positions], axis=-1)
        np.testing.assert_allclose(np.asarray(entropies)[sampled], expected, atol=1e-4)


@hypothesis.settings(max_examples=3, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.data())
def test_random_fork_and_free_orders_match_the_dense_reference(tiny_qwen3, data):
    """Groups of random sizes open (sharing prompt prefixes), generate, take tool output and close in random
    orders on a pool of 16 pages of 8 tokens with freed pages poisoned (NaN): every sampled token and log-prob
    equals the dense reference's, and every page comes back."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    shared_prefix = rng.integers(0, 256, 17).tolist()
    plans = [
        dict(prompt=(shared_prefix if data.draw(st.booleans()) else []) + rng.integers(0, 256, n).tolist(),
             n=data.draw(st.integers(1, 3)), turns=data.draw(st.integers(0, 2)),
             delays=[data.draw(st.sampled_from([0.0, 0.002, 0.01])) for _ in range(3)])
        for n in rng.integers(1, 12, data.draw(st.integers(2, 4))).tolist()
    ]
    records = []

    async def rollout(session, plan, j):
        for turn in range(plan["turns"]):
            await session.generate(max_new_tokens=2 + (turn + j) % 4)
            await asyncio.sleep(plan["delays"][turn])
            session.append(rng.integers(0, 256, 3).tolist())
        await session.generate(max_new_tokens=5)
        records.append((session.prompt_ids, session.response_ids, session.loss_mask, session.logprobs,
                        session.entropies))
        session.close()

    async def group(engine, plan):
        sessions = await engine.open(plan["prompt"], n=plan["n"], sampling=SamplingParams(temperature=0.0),
                                     max_tokens=24)
        await asyncio.gather(*[rollout(s, plan, j) for j, s in enumerate(sessions)])

    async def scenario():
        engine = Engine(tiny_qwen3.params, tiny_qwen3.config, PAGED_CONFIG)
        async with engine:
            await asyncio.gather(*[group(engine, plan) for plan in plans])
        return engine.core

    core = asyncio.run(scenario())  # leaving the engine sends the last releases
    assert len(records) == sum(p["n"] for p in plans)
    for record in records:
        _check_against_dense(tiny_qwen3, *record)
    assert core.pages.num_used == 0 and core.num_reserved_pages == 0
    assert np.isnan(np.asarray(core.state.pages.k[:, :, 1:])).any()  # freed pages were poisoned


def _run(core):
    """Step the core until it is idle, handing the chunks to their records."""
    while core.num_active:
        for record, chunk in core.step():
            record.receive(chunk)


def test_fork_shares_the_prompt_pages(tiny_qwen3):
    config = dataclasses.replace(ENGINE_CONFIG, page_size=8, prefix_sharing=False)
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    # 23 tokens: two full pages and the pending token's page (positions 16..22), so the step that forks the
    # samples also gives them their next page.
    prompt = list(range(1, 24))
    (group,) = core.admit([(prompt, 4, SamplingParams(temperature=1.0), 20, (0,))])  # samples differ
    assert core.pages.num_used == 2 + 4  # the full pages once, a copy of the last page per sample
    table = core.pages.table[[r.slot for r in group]]
    assert (table[:, :2] == table[0, :2]).all() and len(set(table[:, 2])) == 4
    assert (core.pages.refcount[table[0, :2]] == 4).all()
    for record in group:
        core.start(record, max_new_tokens=12)
    _run(core)
    # 35 tokens each: two more private pages per sample (those given ahead of the decode went back at the
    # pause).
    assert core.pages.num_used == 2 + 4 * 3
    for record in group:
        _check_against_dense(tiny_qwen3, record.prompt_ids, record.response_ids, record.loss_mask,
                             record.logprobs, record.entropies, greedy=False)
        core.close(record)
    assert core.pages.num_used == 0 and core.num_free_pages == config.pool_pages - 1


def test_a_prefix_in_the_pool_is_not_prefilled_again(tiny_qwen3):
    config = dataclasses.replace(ENGINE_CONFIG, page_size=8)
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    system = list(range(30, 55))  # 25 tokens: 3 whole pages
    first, second = system + [7, 8], system + [9, 10, 11]
    greedy = SamplingParams(temperature=0.0)
    ((a,),) = core.admit([(first, 1, greedy, 10, (0,))])
    _run(core)  # the first prompt's pages are written and registered
    ((b,),) = core.admit([(second, 1, greedy, 10, (1,))])
    assert (a.cached_tokens, b.cached_tokens) == (0, 24)  # 24 shared tokens' keys/values, the rest prefilled
    assert core.stats["cached_tokens"] == 24
    np.testing.assert_array_equal(core.pages.table[b.slot, :3], core.pages.table[a.slot, :3])
    for record in (a, b):
        core.start(record, max_new_tokens=8)
    _run(core)
    for record in (a, b):
        _check_against_dense(tiny_qwen3, record.prompt_ids, record.response_ids, record.loss_mask,
                             record.logprobs, record.entropies)


def test_a_full_pool_makes_work_wait_and_loses_nothing(tiny_qwen3):
    prompts = [np.random.default_rng(i).integers(0, 256, 5 + 3 * i).tolist() for i in range(6)]
    tight = dataclasses.replace(ENGINE_CONFIG, page_size=8, num_pages=9)  # 8 pages: two sequences at a time
    waited = generate(tiny_qwen3.params, tiny_qwen3.config, prompts, max_new_tokens=12, engine_config=tight)
    roomy = generate(tiny_qwen3.params, tiny_qwen3.config, prompts, max_new_tokens=12,
                     engine_config=ENGINE_CONFIG)
    assert [r.tokens for r in waited] == [r.tokens for r in roomy]
    assert all(len(r.tokens) == 12 and len(r.entropies) == 12 for r in waited)
    np.testing.assert_allclose([r.logprobs for r in waited], [r.logprobs for r in roomy], atol=1e-5)


def test_bad_input_is_rejected_before_any_work(tiny_qwen3):
    with pytest.raises(ValueError, match="page_size=24 must divide max_len=64"):
        dataclasses.replace(ENGINE_CONFIG, page_size=24)
    with pytest.raises(ValueError, match="attention_block"):
        dataclasses.replace(ENGINE_CONFIG, page_size=16, attention_block=24)
    with pytest.raises(ValueError, match="num_pages"):
        dataclasses.replace(ENGINE_CONFIG, num_pages=1)
    with pytest.raises(ValueError, match="attention="):
        dataclasses.replace(ENGINE_CONFIG, attention="flash")
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, dataclasses.replace(ENGINE_CONFIG, num_pages=4))
    with pytest.raises(ValueError, match="needs 4 KV pages of 16 tokens; the pool holds only 3"):
        core.check_request([1] * 40, 1, 10)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        core.check_request([1] * 4, 1, 0)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        generate(tiny_qwen3.params, tiny_qwen3.config, [[1, 2]], max_new_tokens=-1,
                 engine_config=ENGINE_CONFIG)
    assert core.pages.num_used == 0 and core.num_free_slots == ENGINE_CONFIG.num_slots


def test_decode_chunk_and_return_on_stop_do_not_change_outputs(tiny_qwen3):
    """One step per dispatch, many steps on the device, returning at every stop or not: same tokens."""
    prompts = [np.random.default_rng(10 + i).integers(0, 256, 4 + 5 * i).tolist() for i in range(3)]
    outputs = []
    for chunk, return_on_stop in ((1, True), (4, True), (4, False)):
        config = dataclasses.replace(ENGINE_CONFIG, decode_chunk=chunk, return_on_stop=return_on_stop)
        results = generate(tiny_qwen3.params, tiny_qwen3.config, prompts, max_new_tokens=9, temperature=1.0,
                           seed=5, stop=[[7]], engine_config=config)
        outputs.append([(r.tokens, r.finish_reason) for r in results])
    assert outputs[0] == outputs[1] == outputs[2]


def test_pallas_interpret_engine_matches_jnp(tiny_qwen3):
    prompts = [np.random.default_rng(20).integers(0, 256, 11).tolist()]
    run = lambda attention: generate(
        tiny_qwen3.params, tiny_qwen3.config, prompts, max_new_tokens=4,
        engine_config=dataclasses.replace(ENGINE_CONFIG, attention=attention))[0]
    jnp_result, kernel_result = run("jnp"), run("pallas_interpret")
    assert kernel_result.tokens == jnp_result.tokens
    np.testing.assert_allclose(kernel_result.logprobs, jnp_result.logprobs, atol=1e-5)


@pytest.mark.parametrize(("kv_dtype", "atol"), [(None, 1e-5), ("fp8", 2e-3)])
def test_prefix_cache_reuse_equals_a_cold_run_and_evicts_nothing_in_use(tiny_qwen3, kv_dtype, atol):
    """A chat's second turn attaches the first turn's pages (prompt and answer) from the prefix cache and
    samples exactly what an engine without the cache samples; meanwhile other work fills the small pool, so
    unheld cached pages are evicted (least recently used) but no page in use is, and freed pages are
    poisoned with NaN (a stale read would show). FP8 pages too (their scales poisoned, copied and attached
    with them): a token's key/value computed in a prefill chunk rather than a decode step may round to the
    neighbouring float8 value, hence the looser log-prob tolerance."""
    config = dataclasses.replace(PAGED_CONFIG, num_pages=13, kv_dtype=kv_dtype)  # 12 pages of 8 tokens
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(3)
    first = rng.integers(0, 256, 21).tolist()
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    ((a,),) = core.admit([(first, 1, greedy, 12, (0,))])
    core.start(a, max_new_tokens=12)
    _run(core)
    core.close(a)  # 33 tokens, 32 of them with keys/values: its 4 full pages stay cached
    assert core.pages.num_cached == 4 and core.pages.num_used == 0
    second = first + a.response_ids + rng.integers(0, 256, 5).tolist()
    ((b,),) = core.admit([(second, 1, greedy, 20, (1,))])
    assert b.cached_tokens == 32 and core.pages.num_cached == 0  # 4 pages attached, the rest prefilled
    slot = b.slot
    held = set(core.pages.table[slot, :4].tolist())
    core.start(b, max_new_tokens=10)  # then it pauses, holding its pages
    # Other prompts meanwhile: the pool runs out of free pages and evicts cached ones.
    for i in range(3):
        ((c,),) = core.admit([(rng.integers(0, 256, 9).tolist(), 1, greedy, 8, (2 + i,))])
        core.start(c, max_new_tokens=8)
        _run(core)
        core.close(c)
        assert held <= set(core.pages.table[slot].tolist())  # b's attached pages stayed b's
    assert core.pages.evicted > 0
    poisoned = [np.asarray(leaf[:, :, 1:], np.float32) for leaf in jax.tree.leaves(core.state.pages)]
    assert all(np.isnan(leaf).any() for leaf in poisoned)  # k, v (and FP8 scales) of freed pages
    cold = generate(tiny_qwen3.params, tiny_qwen3.config, [second], max_new_tokens=10,
                    engine_config=dataclasses.replace(config, prefix_sharing=False))[0]
    assert b.response_ids == cold.tokens
    np.testing.assert_allclose(b.logprobs, cold.logprobs, atol=atol)
