"""The default RL step keeps its numbers bit for bit: the demo's options (float32, the paper's loss with the
sampler's log-probs as pi_old, AdamW at 5e-4 with clipping at 1, no weight decay) on a tiny model, two steps,
against values recorded from commit 3aa2ea6 (before the loss registry, ``compute_policy_loss`` and
``train.updates``). Re-record (only for a new JAX / XLA, never to absorb a change of the step): run
``default_step_numbers()`` of this file with PYTHONPATH at that commit (where the batch's field
``sampler_logp`` is still called ``old_logp``)."""

import hashlib
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.train import RLLossConfig, build_batch, init_train_state, make_optimizer, make_rl_step
from tests.train.conftest import FAST_COMPILE, copy_tree, random_sequences, tiny_model_config

# The bits are those of one compiler on one processor: elsewhere (a GPU, another JAX, an ARM CPU) the step's
# numbers are checked by the tolerance tests of test_steps.py, not here.
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or jax.__version__ != "0.10.2" or platform.machine() != "x86_64",
    reason="bits recorded with jax 0.10.2 on an x86 CPU",
)

# Recorded from 3aa2ea6 (jax 0.10.2, x86 CPU, the tests' XLA flags of tests/conftest.py): metric ->
# float.hex per step, and the params' SHA-256 prefix after step 2.
RECORDED = {
    "step1": {
        "approx_kl": "0x1.08bef80000000p+0",
        "clip_frac": "0x1.bbbbbc0000000p-3",
        "clip_frac_high": "0x0.0p+0",
        "clip_frac_low": "0x1.bbbbbc0000000p-3",
        "dual_clip_frac": "0x0.0p+0",
        "entropy": "0x1.36218e0000000p+2",
        "grad_norm": "0x1.92d57e0000000p+0",
        "loss": "0x1.d000a20000000p-1",
        "mismatch_abs_log_ratio": "0x1.08bf020000000p+0",
        "mismatch_k3_kl": "0x1.857c400000000p-1",
        "mismatch_outside_band": "0x1.2222220000000p-2",
        "pg_loss": "0x1.d000a20000000p-1",
        "ratio_mean": "0x1.73fe4c0000000p-1",
        "tokens": "0x1.e000000000000p+5",
        "update_skipped": "0x0.0p+0",
    },
    "step2": {
        "approx_kl": "0x1.115db60000000p+0",
        "clip_frac": "0x1.bbbbbc0000000p-3",
        "clip_frac_high": "0x0.0p+0",
        "clip_frac_low": "0x1.bbbbbc0000000p-3",
        "dual_clip_frac": "0x0.0p+0",
        "entropy": "0x1.3621280000000p+2",
        "grad_norm": "0x1.6b010a0000000p+0",
        "loss": "0x1.b75b800000000p-1",
        "mismatch_abs_log_ratio": "0x1.11fa9e0000000p+0",
        "mismatch_k3_kl": "0x1.85a9d40000000p-1",
        "mismatch_outside_band": "0x1.2222220000000p-2",
        "pg_loss": "0x1.b75b800000000p-1",
        "ratio_mean": "0x1.62ee6e0000000p-1",
        "tokens": "0x1.e000000000000p+5",
        "update_skipped": "0x0.0p+0",
    },
    "params": "5caa3650e277e53e",
}


def _demo_like_batch(config, params):
    """16 packed sequences: the sampler's log-probs of 3 in 4 are the trainer's plus 1e-6 noise (the demo's
    float32 regime, ratios ~1), the rest far off (clip and dual clip fire)."""
    batch = build_batch(random_sequences(0, 16), seq_len=32, num_rows=8, with_rl_fields=True)
    logits, _ = models.forward(params, config, batch.tokens, positions=batch.positions,
                               segment_ids=batch.segment_ids)
    trainer = np.asarray(models.token_logprobs(logits, batch.targets))
    noise = 1e-6 * np.random.default_rng(1).standard_normal(trainer.shape).astype(np.float32)
    near = (np.arange(trainer.shape[0]) % 4 != 0)[:, None]
    sampler = np.where(near, trainer + noise, np.asarray(batch.sampler_logp))
    sampler = np.where(np.asarray(batch.loss_mask) > 0, sampler, 0.0).astype(np.float32)
    return batch.replace(sampler_logp=sampler)


def default_step_numbers() -> dict:
    """{"step1": {metric: hex}, "step2": {...}, "params": sha256 prefix after step 2}."""
    config = tiny_model_config()
    params = models.init_params(config, jax.random.PRNGKey(0))
    batch = _demo_like_batch(config, params)
    optimizer = make_optimizer(5e-4, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0)
    step = make_rl_step(config, optimizer, RLLossConfig(), compiler_options=FAST_COMPILE)
    state, out = init_train_state(copy_tree(params), optimizer, 0), {}
    for name in ("step1", "step2"):
        state, metrics = step(state, batch)
        out[name] = {k: float(v).hex() for k, v in sorted(metrics.items())}
    leaves = jax.tree.leaves(jax.tree.map(jnp.asarray, state.params))
    out["params"] = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]
    return out


def test_default_rl_step_numbers_equal_the_recorded_ones():
    assert default_step_numbers() == RECORDED
