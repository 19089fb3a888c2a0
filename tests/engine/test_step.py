"""The ragged step against the dense reference: random mixes of prefill chunks, appended tool outputs and
decode tokens of several sequences in each step, on a small page pool whose freed pages are poisoned with NaN,
driven directly through :class:`StepBuilder` (no scheduler)."""

import dataclasses

import numpy as np
import pytest

from rstar2jax.engine import (
    FINISH_REASON_NAMES,
    NO_TOKEN,
    PAUSED,
    RUNNING,
    EngineConfig,
    PageAllocator,
    StepBuilder,
    StepLayout,
    init_state,
)
from rstar2jax.engine.config import pages_for
from rstar2jax.engine.step import compile_step
from tests.engine.conftest import teacher_forced

CONFIG = EngineConfig(num_slots=4, max_len=64, page_size=8, attention_block=16, prefill_tile=8,
                      decode_chunk=3, num_pages=24, poison_freed_pages=True, token_buckets=(32,),
                      eos_token_ids=())


class _Sequence:
    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.kv = 0  # positions with keys/values written
        self.sampled = []  # positions of sampled tokens
        self.running = False


def _update(builder, slot, seq, *, clear, running, segment_end=0):
    W = CONFIG.max_stop_len
    recent = ([NO_TOKEN] * W + seq.tokens)[-W:]
    builder.update(slot, clear=clear, status=RUNNING if running else PAUSED, seq_len=len(seq.tokens),
                   last_token=seq.tokens[-1], recent=recent, seed=slot, temperature=0.0, top_p=1.0, top_k=0,
                   budget_end=CONFIG.max_len, segment_start=len(seq.tokens), segment_end=segment_end,
                   stop_seqs=NO_TOKEN)


def _check(tiny, seq):
    logprobs = teacher_forced(tiny.params, tiny.config, seq.tokens)
    for position, logprob in seq.sampled:
        assert seq.tokens[position] == logprobs[position - 1].argmax()
        np.testing.assert_allclose(logprob, logprobs[position - 1, seq.tokens[position]], atol=2e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_steps_match_the_dense_reference(tiny_qwen3, seed):
    rng = np.random.default_rng(seed)
    params, config = tiny_qwen3.params, tiny_qwen3.config
    layout = StepLayout.of(CONFIG, 32)
    state = init_state(config, CONFIG)
    program = compile_step(state, params, layout, True)
    pages = PageAllocator.of(dataclasses.replace(CONFIG, prefix_sharing=False))
    seqs: dict[int, _Sequence] = {}
    finished, freed, mixed_steps = [], [], 0
    for _ in range(24):
        builder = StepBuilder(layout)
        builder.poison(freed)
        freed = []
        decoding, runs = [], []
        for slot in range(CONFIG.num_slots):
            seq = seqs.get(slot)
            if seq is None:
                if rng.random() < 0.6:  # a new prompt; its pages cleared and given
                    seq = seqs[slot] = _Sequence(rng.integers(0, 256, rng.integers(1, 30)))
                    _update(builder, slot, seq, clear=True, running=False)
                    for col, page in pages.grow(slot, len(seq.tokens)):
                        builder.entry(slot, col, page)
                continue
            if seq.running:
                decoding.append(slot)
            elif seq.kv < len(seq.tokens) - 1:  # prefill a random chunk
                runs.append((slot, int(rng.integers(1, len(seq.tokens) - seq.kv))))
            elif len(seq.tokens) > 40 or rng.random() < 0.15:  # done: free its pages (poisoned next step)
                finished.append(seqs.pop(slot))
                freed += pages.release(slot)
                builder.update(slot, clear=True, status=0, seq_len=0, last_token=0, recent=NO_TOKEN, seed=0,
                               temperature=0.0, top_p=1.0, top_k=0, budget_end=0, segment_start=0,
                               segment_end=0, stop_seqs=NO_TOKEN)
            elif rng.random() < 0.4:  # a tool output appended: prefilled with the old pending token
                seq.tokens += rng.integers(0, 256, rng.integers(1, 7)).tolist()
                for col, page in pages.grow(slot, len(seq.tokens)):
                    builder.entry(slot, col, page)
            else:  # a segment of a few tokens starts now
                seq.running = True
                _update(builder, slot, seq, clear=False, running=True,
                        segment_end=len(seq.tokens) + int(rng.integers(1, 6)))
                decoding.append(slot)
        rows = {builder.decode(slot): slot for slot in decoding}
        for slot, n in runs:
            seq = seqs[slot]
            n = min(n, layout.tokens - builder.num_tokens, (layout.tiles - builder.num_tiles) * layout.tile)
            if n > 0:
                builder.run(slot, seq.kv, seq.tokens[seq.kv : seq.kv + n])
                seq.kv += n
        iterations = 1 if runs else CONFIG.decode_chunk
        builder.decode_iterations(iterations - 1)
        mixed_steps += bool(runs and decoding)
        for slot in decoding:  # pages for every token the step may sample
            for col, page in pages.grow(slot, len(seqs[slot].tokens) + iterations):
                builder.entry(slot, col, page)
        state, out_i, out_f = program(state, params, builder.ints, builder.floats)
        out_i, out_f = np.asarray(out_i), np.asarray(out_f)
        for row, slot in rows.items():
            seq = seqs[slot]
            for i in np.flatnonzero(out_i[:, row, 0] >= 0):
                seq.tokens.append(int(out_i[i, row, 0]))
                seq.sampled.append((len(seq.tokens) - 1, float(out_f[i, row, 0])))
                if out_i[i, row, 1]:
                    assert FINISH_REASON_NAMES[int(out_i[i, row, 1])] == "length"
                    seq.running = False
            seq.kv = len(seq.tokens) - 1
    sequences = finished + list(seqs.values())
    assert sum(len(s.sampled) for s in sequences) > 20 and mixed_steps > 2
    for seq in sequences:
        _check(tiny_qwen3, seq)
    for slot in seqs:  # free the rest: a step poisons every page freed before it
        freed += pages.release(slot)
    builder = StepBuilder(layout)
    builder.poison(freed)
    state, _, _ = program(state, params, builder.ints, builder.floats)
    assert freed and np.isnan(np.asarray(state.pages.k[:, :, freed])).all()


def test_pages_for():
    assert [pages_for(n, 8) for n in (1, 8, 9, 16)] == [1, 1, 2, 2]
