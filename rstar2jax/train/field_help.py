"""What each run-config field means: the table ``--print_config`` and the config errors read, kept apart from
ml_collections (nothing here imports it). The help of a field with a fixed set of values lists exactly those
values, generated from the tuple the library checks them against.
"""

from __future__ import annotations

import re

from rstar2jax import algo
from rstar2jax.models.lora import LORA_TARGETS


def choices(meanings: dict[str, str], allowed: tuple[str, ...]) -> str:
    """``a (meaning) / b (meaning)`` over ``allowed`` in its order; ``meanings`` must cover exactly those
    values (a value added to the library without a meaning here fails at import, not silently in the help)."""
    if set(meanings) != set(allowed):
        raise ValueError(f"meanings for {sorted(meanings)}, but the allowed values are {allowed}")
    return " / ".join(f"{value} ({meanings[value]})" for value in allowed)


ROC_MODE_HELP = "RoC down-sampling: " + choices(
    {
        "paper": "half the negatives at random, positives drawn with weight 1 / penalty",
        "release": "the released code's proportional split, positives lowest penalty first",
        "uniform": "plain GRPO, uniformly at random",
    },
    algo.ROC_MODES,
)
FORMAT_PENALTY_HELP = "RoC answer-format penalty: " + choices(
    {"paper": "Eq. 5", "release": "the released code's rule"}, algo.FORMAT_PENALTIES
)
STD_HELP = "group std of the advantages: " + choices(
    {
        "population": "divide by n",
        "unbiased": "Bessel, divide by n - 1, as the released (verl) code's torch.std; the default",
    },
    algo.STD_MODES,
)

#: What each config field means (``--print_config`` lists them; a test keeps this complete). Stage fields are
#: under ``stages.*``, inline model fields under ``model.spec.*``.
FIELD_HELP = {
    "seed": "seed of the initial weights, data order and sampling",
    "notice": "a line the launchers print at start (e.g. that the config is only a smoke test)",
    "workdir": "the run's folder: checkpoints/, metrics.jsonl, tensorboard/; a rerun resumes from it",
    "tokenizer": "tokenizer folder (HF format, with its chat template); empty: model.path's own tokenizer, "
    "else pre-tokenised SFT data only",
    "model.path": "HF checkpoint folder (config.json + safetensors) to start from; wins over the ones below",
    "model.config_json": "or an HF config.json, or a preset name: random weights of that shape",
    "model.preset": "or a named model shape (models.PRESETS), refined by model.spec fields: random weights",
    "model.spec": "or inline ModelConfig fields (model_type, hidden_size, ...): random weights",
    "model.spec.*": "a ModelConfig field of the inline model",
    "model.param_dtype": "dtype of the master weights and optimizer moments",
    "model.compute_dtype": "dtype of activations and matmuls",
    "model.remat_policy": "activation rematerialisation: none / full / ... (memory for compute)",
    "model.scan_layers": "scan over stacked layers (faster compiles) instead of unrolling them",
    "model.attention": "training attention: auto (the first GPU kernel that passes its check, else "
    "blockwise) / blockwise / pallas_triton / jax_pallas_mha / tokamax / dense (old name: xla)",
    "model.attention_block_size": "query/key block of the blockwise attention (a multiple of 8)",
    "model.mlp_chunk_size": "> 0: the MLP over rematerialised token chunks of this size (0: whole sequence)",
    "model.lora.rank": "LoRA rank r (0: off, full fine-tuning); > 0 trains adapters, the base stays frozen",
    "model.lora.alpha": "LoRA scale numerator: the adapters' path is multiplied by alpha / rank",
    "model.lora.targets": f"projections that get adapters (any of {LORA_TARGETS})",
    "model.lora.dropout": "dropout on the adapters' input (SFT only; RL needs a deterministic policy)",
    "model.lora.rslora": "rank-stabilised scale alpha / sqrt(rank) (PEFT's use_rslora)",
    "model.lora.dtype": "dtype of the adapters and their optimizer moments (the base: model.param_dtype)",
    "model.lora.adapter": "a PEFT adapter folder to start from (continue training); empty: fresh adapters",
    "mesh.data": "data-parallel mesh axis size",
    "mesh.fsdp": "fully-sharded data-parallel axis size (weights and optimizer sharded)",
    "mesh.tensor": "tensor-parallel axis size (heads and MLP split); data x fsdp x tensor = devices",
    "optimizer.learning_rate": "AdamW peak learning rate",
    "optimizer.warmup_steps": "linear warm-up steps (-1 in SFT: sft.warmup_fraction of the run)",
    "optimizer.schedule": "after warm-up: constant or cosine decay",
    "optimizer.total_steps": "steps the schedule spans (None: the run's length)",
    "optimizer.weight_decay": "AdamW decoupled weight decay",
    "optimizer.b1": "AdamW beta1",
    "optimizer.b2": "AdamW beta2",
    "optimizer.eps": "AdamW epsilon",
    "optimizer.max_grad_norm": "global gradient-norm clip (None: no clipping)",
    "num_microbatches": "gradient accumulation: each step's batch in this many sequential micro-batches",
    "checkpoint.save_every": "save a checkpoint every this many steps (and at the end, and on Ctrl-C)",
    "checkpoint.keep": "how many of the latest checkpoints to keep",
    "checkpoint.async_save": "write checkpoints in a background thread",
    "logging.tensorboard": "also write TensorBoard events to <workdir>/tensorboard",
    "logging.progress": "show progress (a bar on a terminal, else one line every progress_every steps)",
    "logging.progress_every": "steps between progress lines when the output is not a terminal",
    "distributed.coordinator_address": "multi-host: HOST:PORT of process 0 (empty: one process)",
    "distributed.num_processes": "multi-host: number of processes (hosts)",
    "distributed.process_id": "multi-host: this process's index, 0 .. num_processes - 1",
    "data.source": "RL problems: a .jsonl/.json/.parquet file, a datasets folder or a hub name",
    "data.split": "split to read from dataset dicts and hub datasets",
    "data.problem_field": "column of the problem text (empty: problem / question / prompt)",
    "data.answer_field": "column of the gold answer, dotted for nested (empty: answer / ... / "
    "reward_model.ground_truth)",
    "data.solution_field": "column of a worked solution whose last \\boxed{} is the answer (empty: solution)",
    "data.id_field": "column of the problem id (empty: id / unique_id / ...; else the row index)",
    "data.integer_only": "keep only problems with integer answers (rejected rows are counted and shown)",
    "data.limit": "use at most this many problems (None: all)",
    "prompt.paper": "None: the format recorded in model.path's folder (else the paper's); True: the paper's "
    "prompt (system text, the tool schema listed); False: the fields below",
    "prompt.system_prompt": "system text when prompt.paper is False",
    "prompt.user_prefix": "text put before each problem when prompt.paper is False",
    "prompt.list_tools": "list the Python tool's schema in the prompt when prompt.paper is False",
    "loss.eps_low": "PPO clip range below 1 (ratio >= 1 - eps_low)",
    "loss.eps_high": "PPO clip range above 1 (clip-higher: ratio <= 1 + eps_high)",
    "loss.dual_clip": "dual-clip bound c > 1 for negative advantages (default 3 as verl; None: off)",
    "loss.agg": "loss aggregation: token_mean (paper), per-sequence means, verl / Dr. GRPO sum-norm",
    "loss.entropy_coef": "entropy bonus coefficient (paper: 0)",
    "loss.temperature": "sampling temperature the trainer divides logits by (match rollout.temperature)",
    "loss.old_logprobs": "pi_old from the sampler's log-probs or recomputed by the trainer",
    "loss.importance_sampling_level": "ratio per token (PPO/GRPO) or per sequence (GSPO, geometric mean)",
    "loss.gspo_eps_low": "GSPO clip range below 1 (used when importance_sampling_level = sequence)",
    "loss.gspo_eps_high": "GSPO clip range above 1 (used when importance_sampling_level = sequence)",
    "loss.kl_coef": "KL penalty to a frozen copy of the initial policy (paper: 0, no reference kept)",
    "loss.kl": "KL estimator: k1 / k2 / k3, + for the straight-through gradient of k2",
    "loss.rollout_is_cap": "rollout correction: cap C of token weights pi_train / pi_rollout (None: off)",
    "loss.rollout_mask": "rollout correction: drop sequences whose (geometric) ratio leaves [1/C', C']",
    "loss.rollout_mask_threshold": "rollout correction: C' of rollout_mask",
    "rl.prompts_per_step": "problems per RL step",
    "rl.samples_per_problem": "rollouts sampled per problem (2G)",
    "rl.keep": "rollouts kept per problem by Resample-on-Correct (G)",
    "rl.roc_mode": ROC_MODE_HELP,
    "rl.min_negatives": "RoC keeps at least this many incorrect rollouts when available",
    "rl.min_positives": "RoC keeps at least this many correct rollouts when available",
    "rl.reject_equal_reward": "drop groups whose kept rollouts all have the same reward",
    "rl.roc_eps": "tie-breaking epsilon of the RoC penalty ordering",
    "rl.estimator": "advantage estimator (grpo: group-normalised reward)",
    "rl.std": STD_HELP,
    "rl.advantage_eps": "added to the group std before dividing",
    "rl.format_penalty": FORMAT_PENALTY_HELP,
    "rl.mask_truncated": "truncated responses carry no loss (they still count in their group's advantages)",
    "rl.overlong_buffer": "DAPO soft overlong penalty over the last N tokens of the budget (0: off)",
    "rl.overlong_penalty_factor": "DAPO soft overlong penalty at the budget (reward - factor)",
    "rl.off_policy_steps": "1: roll out step n+1 with step n's parameters before step n's update (one-step "
    "off-policy, needs loss.old_logprobs='recompute' and a rollout correction); 0: on-policy",
    "rl.max_nonfinite_steps": "a step with a non-finite loss or gradient skips its update; this many in a "
    "row stop the run (exit 3, the last checkpoint kept)",
    "batch.max_prompt_length": "longest prompt in tokens (longer problems are rejected)",
    "batch.pack": "pack several trajectories per row; False: one per row (worst case must fit)",
    "rollout.temperature": "sampling temperature of rollouts",
    "rollout.top_p": "nucleus sampling (1: off)",
    "rollout.top_k": "top-k sampling (0: off)",
    "rollout.max_tool_calls_per_turn": "tool calls run per assistant turn",
    "rollout.tool_timeout": "seconds a tool call may run",
    "rollout.tool_output_chars": "tool output kept per call (characters)",
    "rollout.sandbox_url": "code sandbox URL (empty: start a local one for the run)",
    "rollout.sandbox_workers": "workers of the local sandbox",
    "rollout.sandbox_outage_s": "seconds tool calls wait (retrying with back-off) for a sandbox that does "
    "not answer; past it the run stops (exit 3) keeping the last finished step's checkpoint",
    "rollout.engine_slots": "concurrent sequences in the generation engine",
    "rollout.kv_cache_tokens": "tokens the KV page pool holds (0: engine_slots x the longest sequence)",
    "rollout.partial_token_budget": "partial rollouts: > 0 stops a step's rollouts after this many sampled "
    "tokens, trains on the finished groups and resumes the rest next step (0: off; needs the rollout "
    "correction)",
    "rollout.partial_segment_tokens": "partial rollouts: tokens a session samples between budget checks",
    "colocate.optimizer_memory": "where optimizer moments wait during rollout: auto / host (pinned) / device",
    "device_memory_gib": "per-device memory the plan is checked against (None: what the device reports)",
    "filter_batch_size": "problems per batch of the hard-problem filter's rollouts",
    "stages": "the RL stages, run in order",
    "stages.name": "stage name (in logs and checkpoints)",
    "stages.steps": "RL steps of the stage",
    "stages.max_response_length": "response budget in tokens (all turns and tool outputs)",
    "stages.max_turns": "assistant turns per rollout",
    "stages.dataset": "the stage's problems (empty: the previous stage's, the first: data.source)",
    "stages.hard_filter_rollouts": "k > 0: at the stage start drop problems the policy solves k/k",
    "stages.reset_optimizer": "fresh optimizer moments and schedule at the stage start",
    "sft.data": "SFT data: JSONL of chats (messages, tools) or pre-tokenised input_ids + loss_mask",
    "sft.epochs": "passes over the SFT data",
    "sft.batch_size": "SFT examples per step (packed into rows of sft.seq_len)",
    "sft.seq_len": "packed row length in tokens",
    "sft.warmup_fraction": "warm-up share of the run when optimizer.warmup_steps is -1",
    "sft.steps": "SFT steps (None: epochs x examples / batch_size)",
}


def field_help(path: str, extra: dict[str, str] | None = None) -> str | None:
    """The meaning of config field ``path`` (``stages[2].steps`` reads ``stages.steps``), looked up in
    ``extra`` first, then in ``FIELD_HELP`` with leading components dropped until one matches (a demo
    config's ``rl.rl.keep`` is ``rl.keep``); ``a.*`` entries cover every field under ``a``. None when no
    table knows it."""
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    for table, starts in ((extra or {}, 1), (FIELD_HELP, len(parts))):
        for start in range(starts):
            if (name := ".".join(parts[start:])) in table:
                return table[name]
            for end in range(len(parts) - 1, start, -1):  # "model.spec.*" covers model.spec.hidden_size
                if (group := ".".join(parts[start:end]) + ".*") in table:
                    return table[group]
    return None
