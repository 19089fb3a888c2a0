"""The rStar2-Agent recipe (paper §4-5): Qwen3-14B-Base, 512 prompts x 32 rollouts -> 16 kept by RoC,
AdamW lr 1e-6 (20 warm-up steps, then constant), three stages: 8K for 300 steps, 12K for 85, then 12K on the
hard problems (solved < 8/8) for 125 steps with 15 turns and an optimizer reset; 64 devices.

As shipped the model is the real Qwen3-14B shape with random weights (enough for --dry_run); to train, point
it at the base checkpoint and the 42K integer-answer problem set:

  python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b.py \
      --config.model.path=/ckpt/Qwen3-14B-Base --config.model.preset= \
      --config.data.source=/data/rl_42k.jsonl

Choices the paper leaves open (README §1.11) follow the released code: Bessel std + 1e-6, all-equal groups
rejected before the token normaliser, old log-probs recomputed by the trainer (one update per batch, as the
release's ppo_mini_batch_size = train_batch_size), tool tokens masked out of the loss.
"""

from rstar2jax import models
from rstar2jax.config.config import rl_config, sft_config, stage


def _model_and_mesh(c):
    c.model.preset = "qwen3-14b"  # the official Qwen3-14B config.json, bundled (models.PRESETS)
    c.model.param_dtype = "float32"  # master weights and AdamW moments
    c.model.compute_dtype = "bfloat16"
    c.model.remat_policy = "full"
    # Attention linear in memory (tokamax's kernels on NVIDIA GPUs, the blockwise XLA one elsewhere, e.g. the
    # CPU dry run); log-probs and entropy come from vocabulary chunks (no [rows, 12K, 152K] logits).
    c.model.attention = "auto"
    c.tokenizer = str(models.QWEN3_TOKENIZER_DIR)
    # 64 devices: FSDP over 8 x tensor parallel over 8 (40 heads and the 152K vocabulary split 8 ways).
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 8
    return c


def get_config(kind: str = "rl"):
    """``kind``: "rl" (the three RL stages) or "sft" (the non-reasoning SFT before them: 3 epochs, lr 5e-6,
    4% warm-up then cosine, batch 128)."""
    if kind == "sft":
        c = _model_and_mesh(sft_config())
        c.workdir = "runs/paper_qwen3_14b_sft"
        c.sft.data = (
            "data/sft_function_calls_and_chat.jsonl"  # ToolACE, APIGen-MT, Glaive, Magicoder, Tulu3...
        )
        c.sft.epochs, c.sft.batch_size, c.sft.seq_len, c.sft.warmup_fraction = 3, 128, 8192, 0.04
        c.optimizer.learning_rate = 5e-6
        c.num_microbatches = 16  # 128 packed rows over 8 FSDP shards: one row per shard per micro-batch
        return c
    if kind != "rl":
        raise ValueError(f"get_config: kind={kind!r}; expected 'rl' or 'sft'")
    c = _model_and_mesh(rl_config())
    c.workdir = "runs/paper_qwen3_14b"
    c.data.source = (
        "data/rstar2_agent_rl_42k.jsonl"  # 17K DAPO + 93K AoPS + 937 Project Euler, cleaned to 42K
    )
    c.data.integer_only = True  # the paper's RL set keeps integer answers only (rejected rows are reported)

    # 8192 trajectories per step in 1024 micro-batches of one row per FSDP shard.
    c.num_microbatches = 1024

    c.optimizer.learning_rate = 1e-6
    c.optimizer.warmup_steps = 20
    c.optimizer.schedule = "constant"
    c.optimizer.weight_decay = 0.01
    c.optimizer.max_grad_norm = 1.0

    c.loss.eps_low, c.loss.eps_high = 0.2, 0.28  # clip-higher; no KL, no entropy term
    c.loss.agg = "token_mean"  # 1 / sum |o_i| over the whole batch (Eq. 6)
    c.loss.old_logprobs = "recompute"
    c.loss.dual_clip = 3.0  # not in the paper; the released code on verl (clip_ratio_c = 3)
    c.loss.importance_sampling_level = "token"  # PPO/GRPO ratio; "sequence" is GSPO (gspo_eps 3e-4 / 4e-4)
    c.loss.kl_coef = 0.0  # KL removed (§2.2.1): no reference policy is kept
    # Rollout correction off, as in the paper; the usual setting is rollout_is_cap = 2 (token-level
    # truncated IS) and/or rollout_mask = "geometric" with rollout_mask_threshold = 2.
    c.loss.rollout_is_cap, c.loss.rollout_mask = None, None

    c.rl.prompts_per_step = 512
    c.rl.samples_per_problem = 32
    c.rl.keep = 16
    c.rl.roc_mode = "paper"
    c.rl.reject_equal_reward = True
    c.rl.std = "unbiased"
    c.rl.advantage_eps = 1e-6
    c.rl.format_penalty = "paper"  # Eq. 5; "release" is the released code's rule (README §1.3)
    # Truncated rollouts keep reward 0 and stay in the loss: overlong filtering raised truncation (§4.3).
    c.rl.mask_truncated = False
    c.rl.overlong_buffer = 0  # no DAPO soft overlong penalty

    c.batch.max_prompt_length = 2048
    c.batch.pack = False  # one trajectory per row; the worst case (every response at the limit) must fit
    c.rollout.temperature = 1.0
    c.rollout.engine_slots = 256
    c.filter_batch_size = 512

    c.stages = [
        stage("stage1_8k", steps=300, max_response_length=8192, max_turns=10),
        stage("stage2_12k", steps=85, max_response_length=12288, max_turns=10),
        stage(
            "stage3_hard_12k",
            steps=125,
            max_response_length=12288,
            max_turns=15,
            hard_filter_rollouts=8,
            reset_optimizer=True,
        ),
    ]
    c.checkpoint.save_every = 10
    c.checkpoint.keep = 3
    return c
