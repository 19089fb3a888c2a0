"""SMOKE TEST ONLY: random weights of a tiny Qwen3-shaped model on one CPU device, so every reward is 0 and
nothing is learned. It checks that the whole system runs end to end on a laptop (two short stages, the second
with the hard-problem filter and an optimizer reset; small batches). For a run that learns on a CPU, see
``python -m experiments.demo``; for the paper's recipe, ``paper_qwen3_14b.py``.

  python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --config.workdir=runs/tiny
"""

import pathlib

from rstar2jax import models
from rstar2jax.config.config import rl_config, sft_config, stage
from rstar2jax.eval import EVAL_SETS_DIR

SMOKE_TEST = (
    "tiny_cpu is a smoke test: a random 2-layer model, so rewards are 0 and nothing is learned "
    "(python -m experiments.demo trains one that learns)"
)
SMOKE_TEST_SFT = (
    "tiny_cpu:sft is a smoke test: a random 2-layer model trained for a few steps, to check that SFT runs "
    "(python -m experiments.demo trains one that learns)"
)


def _model(c):
    """Random weights of the tiny 2-layer Qwen3 preset with the real Qwen3 vocabulary (151,936 embedding rows)
    and tokenizer (bundled with the package), so real prompts and eval sets work."""
    c.model.preset = "tiny"
    c.model.spec.vocab_size = 151936
    c.model.spec.eos_token_ids = (151645, 151643)
    c.tokenizer = str(models.QWEN3_TOKENIZER_DIR)
    return c


def get_config(kind: str = "rl"):
    """``kind``: "rl" (python -m experiments.train_rl) or "sft" (python -m experiments.sft, on the shipped
    tool-use conversations unless --config.sft.data=... names other data)."""
    if kind == "sft":
        c = _model(sft_config())
        c.notice = SMOKE_TEST_SFT
        c.workdir = "runs/tiny_cpu_sft"
        c.sft.data = str(pathlib.Path(__file__).resolve().parents[1] / "data" / "sft_tool_use.jsonl")
        c.optimizer.learning_rate = 1e-3
        c.sft.epochs, c.sft.batch_size, c.sft.seq_len = 1, 8, 1024
        c.num_microbatches = 2
        c.checkpoint.save_every = 5
        return c
    if kind != "rl":
        raise ValueError(f"get_config: kind={kind!r}; expected 'rl' or 'sft'")
    c = _model(rl_config())
    c.notice = SMOKE_TEST
    c.workdir = "runs/tiny_cpu"
    c.data.source = str(EVAL_SETS_DIR / "aime24.jsonl")

    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 1
    c.num_microbatches = 2
    c.rl.prompts_per_step = 2
    c.rl.samples_per_problem = 4
    c.rl.keep = 2
    c.batch.max_prompt_length = 768  # the paper prompt with the tool schema is ~400-550 tokens
    c.rollout.engine_slots = 8
    c.filter_batch_size = 4
    c.stages = [
        stage("stage1", steps=2, max_response_length=64, max_turns=2),
        stage(
            "stage2",
            steps=2,
            max_response_length=96,
            max_turns=3,
            hard_filter_rollouts=2,
            reset_optimizer=True,
        ),
    ]
    c.checkpoint.save_every = 1
    return c
