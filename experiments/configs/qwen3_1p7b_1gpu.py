"""Qwen3-1.7B GRPO-RoC on one 80 GB GPU: rollout and training colocated, 8K responses, groups of 2G = 16.

Sized so the memory plan fits one H100 / A100 80 GB (check it on any machine, no GPU needed):

  python -m experiments.train_rl --config=experiments/configs/qwen3_1p7b_1gpu.py --dry_run

which prints the per-device plan of both phases and writes it to ``<workdir>/memory_plan.json``. To train,
point it at the base checkpoint, its tokenizer and a problem set:

  python -m experiments.train_rl --config=experiments/configs/qwen3_1p7b_1gpu.py \\
      --config.model.path=/ckpt/Qwen3-1.7B-Base --config.model.preset= \\
      --config.tokenizer=/ckpt/Qwen3-1.7B-Base --config.data.source=/data/rl.jsonl

How it fits: float32 master weights (6.4 GiB) and AdamW moments (12.8 GiB) are needed only by the update,
so the moments wait in pinned host memory while the engine runs (``colocate.optimizer_memory="host"``); the
engine decodes from a bfloat16 cast of the weights with a KV page pool of 256K tokens (28 GiB at 112 KiB per
token), which exists only while the engine runs. Training runs micro-batches of
10K-token rows with full rematerialisation and chunked vocabulary log-probs.
"""

from rstar2jax import models
from rstar2jax.config.config import rl_config, stage


def get_config():
    c = rl_config()
    c.workdir = "runs/qwen3_1p7b_1gpu"
    c.model.preset = "qwen3-1.7b"  # random weights until model.path is set
    c.tokenizer = str(models.QWEN3_TOKENIZER_DIR)  # Qwen3's tokenizer (the same for every size)
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "bfloat16"
    c.model.remat_policy = "full"
    c.data.source = "data/rl_problems.jsonl"  # your problem set (README: bring your own data)
    c.data.integer_only = True

    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    c.device_memory_gib = 80.0
    c.colocate.optimizer_memory = "host"

    c.rl.prompts_per_step = 32
    c.rl.samples_per_problem = 16  # 2G
    c.rl.keep = 8  # G
    c.rl.roc_mode = "paper"

    c.batch.max_prompt_length = 2048
    c.batch.pack = True
    c.num_microbatches = 64  # 256 kept trajectories of up to 10K tokens: 4 rows of 10K per micro-batch

    c.rollout.engine_slots = 128
    c.rollout.kv_cache_tokens = 256 * 1024
    c.rollout.temperature = 1.0

    c.optimizer.learning_rate = 1e-6
    c.optimizer.warmup_steps = 20
    c.stages = [stage("stage1_8k", steps=300, max_response_length=8192, max_turns=10)]
    return c
