"""An RL run config's own fields (GRPO-RoC; the paper's defaults where it gives them) and a stage's: see
``rstar2jax.config.schema``, which adds them to the fields every run config has."""

from __future__ import annotations

from rstar2jax import algo
from rstar2jax.config.algorithm import RLIterationConfig
from rstar2jax.config.checks import (
    AT_LEAST_0,
    POSITIVE,
    Check,
    Field,
    choice,
    choices,
    flag,
    integer,
    number,
    optional,
    text,
    url,
)
from rstar2jax.config.vocabulary import (
    OFF_POLICY_CORRECTION_OPTIONS,
    OFFLOAD_OPTIONS,
    OLD_LOGPROB_SOURCES,
    PLACEMENTS,
    ROLLOUT_SCHEDULES,
)
from rstar2jax.engine.plan import ON_UPDATE
from rstar2jax.models.config import (
    ATTENTION_ALIASES,
    DECODE_ATTENTION_IMPLEMENTATIONS,
    FP8,
    FP8_MATMULS,
    NUMERICS,
    SUPPORTED_DTYPES,
)

#: ``loss.old_logprobs`` / ``loss.rollout_is_cap``: chosen from the rollout's precision (``rules``).
AUTO = "auto"
#: The token-level TIS cap ``loss.rollout_is_cap="auto"`` gives a run whose rollout samples in another
#: precision than the trainer computes in (verl's default cap C = 2).
MISMATCH_IS_CAP = 2.0

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

#: ``loss.rollout_is_cap``: "auto", None or a cap C > 1 (a placeholder of any type: overrides parse as
#: literals, so ``--config.loss.rollout_is_cap=3`` is a number and ``=auto`` the word).
_CAP = number(1, open_low=True)
IS_CAP = Check(lambda v: v in (AUTO, None) or _CAP(v), "must be 'auto', a number > 1 or None", object,
               _CAP.bad)
#: ``rollout.attention``: the decode implementations and their old names.
DECODE_ATTENTION = DECODE_ATTENTION_IMPLEMENTATIONS + tuple(
    old for old, new in ATTENTION_ALIASES.items() if new in DECODE_ATTENTION_IMPLEMENTATIONS)

_ITERATION = RLIterationConfig()  # the iteration's defaults (rl.*), stated once there
SCHEDULE_HELP = "how rollouts and updates take turns: " + choices(
    {
        "synchronous": "each step rolls out its problems, then updates (rl.off_policy_steps, "
        "rollout.partial_token_budget refine it)",
        "async": "a producer rolls out continuously beside the trainer, at most rl.max_staleness policy "
        "versions behind",
    },
    ROLLOUT_SCHEDULES,
)
CORRECTION_HELP = "how the loss corrects for tokens an older policy sampled: " + choices(
    {
        "auto": "decoupled under rl.schedule='async' (max_staleness > 0), none otherwise",
        "decoupled": "AReaL's decoupled PPO: clip against the update's starting policy, weight tokens by "
        "min(pi_prox / pi_behaviour, loss.decoupled_is_cap)",
        "none": "no decoupled objective (loss.rollout_is_cap / loss.rollout_mask, TIS / MIS, when set)",
    },
    OFF_POLICY_CORRECTION_OPTIONS,
)
PLACEMENT_HELP = "where the asynchronous producer's engine runs: " + choices(
    {
        "colocated": "on the trainer's devices, with its own inference-dtype copy of the weights",
        "split": "on rl.rollout_devices devices of each process set apart from the train mesh; new weights "
        "are copied device to device while it decodes",
    },
    PLACEMENTS,
)
TOOL_LIST = Check(
    lambda v: isinstance(v, list | tuple) and len(v) > 0 and all(isinstance(t, str) and t for t in v)
    and len(set(v)) == len(v),
    "must list tools, each once: 'python', a registered tool or 'module:function'", tuple,
    ((), ("python", "python")),
)
#: A registered advantage estimator (looked up when checked: a user's module may have added one) or
#: ``module:function``, loaded when the config is parsed.
ESTIMATOR = Check(
    lambda v: isinstance(v, str) and (v in algo.ADVANTAGE_ESTIMATORS or all(v.partition(":")[::2])),
    "must be a registered advantage estimator (algo.ADVANTAGE_ESTIMATORS) or 'module:function'", str,
    ("no_such_estimator",),
)
FUNCTION_NAME = Check(
    lambda v: isinstance(v, str) and (v == "" or all(v.partition(":")[::2])),
    "must be '' or 'module:function'", str, ("no_function",),
)


def _names_a_loss(mode) -> bool:
    try:
        algo.get_policy_loss(mode)
    except ValueError:
        return False
    return True


def _option_check(option: str, default) -> Check:
    """The check of registered-loss option ``option``: each declaring loss's (``PolicyLoss.resolve``)."""
    declaring = [entry for entry in algo.POLICY_LOSSES.values() if option in entry.options]

    def accepts(value) -> bool:
        try:
            for entry in declaring:
                entry.resolve({option: value})
        except ValueError:
            return False
        return True

    expectations = [entry.checks[option][1] for entry in declaring if option in entry.checks]
    kind = "a number" if isinstance(default, int | float) and not isinstance(default, bool) else "valid"
    refused = tuple(v for v in (-1.0, 0.0, float("inf"), "x") if not accepts(v))
    return Check(accepts, " and ".join(expectations) or f"must be {kind}",
                 type(default) if default is not None else object, refused)


def loss_option_fields(declared) -> dict[str, Field]:
    """``loss.<option>`` fields of the registered losses' options that ``declared`` (field paths) lacks:
    default and check from the loss (``algo.register_policy_loss``), so a loss needs no schema entry."""
    return {
        f"loss.{option}": Field(default, _option_check(option, default),
                                f"option of policy loss {losses} (loss.mode; docs/losses.md)")
        for option, (default, losses) in algo.registered_loss_options().items()
        if f"loss.{option}" not in declared
    }


STAGE_LIST = Check(lambda v: isinstance(v, list | tuple) and len(v) > 0, "must list at least one stage", list)

#: An RL run's own fields (GRPO-RoC; the paper's defaults where it gives them), after ``COMMON``'s.
RL: dict[str, Field] = {
    "data.source": Field(
        "", text(),
        "RL problems: a .jsonl/.json/.parquet file, a datasets folder or a hub name",
        exists="problems",
    ),
    "data.split": Field("train", text(empty=False), "split to read from dataset dicts and hub datasets"),
    "data.problem_field": Field(
        "", text(),
        "column of the problem text (empty: problem / question / prompt)",
    ),
    "data.answer_field": Field(
        "", text(),
        "column of the gold answer, dotted for nested (empty: answer / ... / reward_model.ground_truth)",
    ),
    "data.solution_field": Field(
        "", text(),
        "column of a worked solution whose last \\boxed{} is the answer (empty: solution)",
    ),
    "data.id_field": Field(
        "", text(),
        "column of the problem id (empty: id / unique_id / ...; else the row index)",
    ),
    "data.integer_only": Field(
        False, flag(),
        "keep only problems with integer answers (rejected rows are counted and shown)",
    ),
    "data.limit": Field(None, optional(POSITIVE), "use at most this many problems (None: all)"),
    "loss.mode": Field(
        "ppo", Check(_names_a_loss, "must name a registered policy loss (algo.POLICY_LOSSES) or be "
                     "'module:function'", str, ("no_such_loss", "no_such_module:loss")),
        "the policy loss: ppo (the paper's clipped surrogate, dual clip), gspo, decoupled, cispo, sapo, a "
        "name registered with algo.register_policy_loss, or module:function; its options are loss.<option> "
        "(docs/losses.md)",
    ),
    "loss.eps_low": Field(
        0.2, number(0, 1, open_low=True, open_high=True),
        "PPO clip range below 1 (ratio >= 1 - eps_low)",
    ),
    "loss.eps_high": Field(
        0.28, number(0, open_low=True),
        "PPO clip range above 1 (clip-higher: ratio <= 1 + eps_high)",
    ),
    "loss.dual_clip": Field(
        3.0, optional(number(1, open_low=True)),
        "dual-clip bound c > 1 for negative advantages (default 3 as verl and the released code; None: off)",
    ),
    "loss.agg": Field(
        "token_mean", choice(algo.AGG_MODES),
        "loss aggregation: token_mean (paper), per-sequence means, verl / Dr. GRPO sum-norm",
    ),
    "loss.entropy_coef": Field(0.0, number(0), "entropy bonus coefficient (paper: 0)"),
    "loss.old_logprobs": Field(
        AUTO, choice((AUTO, *OLD_LOGPROB_SOURCES)),
        "pi_old from the sampler's log-probs or recomputed by the trainer; auto: recompute when the rollout "
        "samples in another precision than the trainer computes in (rollout.weight_dtype / kv_dtype, e.g. "
        "FP8), else sampler",
    ),
    "loss.importance_sampling_level": Field(
        "token", choice(algo.IS_LEVELS),
        "ratio per token (PPO/GRPO) or per sequence (GSPO, geometric mean)",
    ),
    "loss.gspo_eps_low": Field(
        3e-4, number(0, 1, open_low=True, open_high=True),
        "GSPO clip range below 1 (used when importance_sampling_level = sequence)",
    ),
    "loss.gspo_eps_high": Field(
        4e-4, number(0, open_low=True),
        "GSPO clip range above 1 (used when importance_sampling_level = sequence)",
    ),
    "loss.kl_coef": Field(
        0.0, number(0),
        "KL penalty to a frozen copy of the initial policy (paper: 0, no reference kept)",
    ),
    "loss.kl": Field(
        "k3", choice(algo.KL_ESTIMATORS),
        "KL estimator: k1 / k2 / k3, + for the straight-through gradient of k2",
    ),
    "loss.rollout_is_cap": Field(
        AUTO, IS_CAP,
        "rollout correction, token-level truncated importance sampling (needs old_logprobs='recompute'): "
        "cap C of token weights pi_train / pi_rollout (None: off); auto: C = 2 when the rollout samples in "
        "another precision than the trainer computes in (FP8), else off",
    ),
    "loss.rollout_mask": Field(
        None, optional(choice(algo.SEQUENCE_RATIOS)),
        "rollout correction: drop sequences whose (geometric) ratio leaves [1/C', C']",
    ),
    "loss.decoupled_is_cap": Field(
        5.0, number(1, open_low=True),
        "decoupled objective (rl.off_policy_correction): cap C of the token weights pi_prox / pi_behaviour",
    ),
    "loss.rollout_mask_threshold": Field(
        2.0, number(1, open_low=True),
        "rollout correction: C' of rollout_mask",
    ),
    "loss.allow_uncorrected_mismatch": Field(
        False, flag(),
        "True: a rollout in another precision than the trainer's (FP8) may train with every rollout "
        "correction off (loss.rollout_is_cap=None, no rollout_mask); the run warns once",
    ),
    "rl.prompts_per_step": Field(512, POSITIVE, "problems per RL step"),
    "rl.ppo_epochs": Field(
        1, POSITIVE,
        "passes over each step's batch, against the policy the step started from (1: the release's one "
        "update; > 1 lets the clip act)",
    ),
    "rl.mini_batches": Field(
        1, POSITIVE,
        "optimizer updates per pass: the batch in this many strided mini-batches (the optimizer and its "
        "schedule count updates; warm-up and total steps stay in RL steps)",
    ),
    "rl.samples_per_problem": Field(
        _ITERATION.samples_per_problem, integer(low=2),
        "rollouts sampled per problem (2G)",
    ),
    "rl.keep": Field(_ITERATION.keep, POSITIVE, "rollouts kept per problem by Resample-on-Correct (G)"),
    "rl.roc_mode": Field(_ITERATION.roc_mode, choice(algo.ROC_MODES), ROC_MODE_HELP),
    "rl.min_negatives": Field(
        _ITERATION.min_negatives, AT_LEAST_0,
        "RoC keeps at least this many incorrect rollouts when available",
    ),
    "rl.min_positives": Field(
        _ITERATION.min_positives, AT_LEAST_0,
        "RoC keeps at least this many correct rollouts when available",
    ),
    "rl.reject_equal_reward": Field(
        _ITERATION.reject_equal_reward, flag(),
        "drop groups whose kept rollouts all have the same reward",
    ),
    "rl.roc_eps": Field(
        _ITERATION.roc_eps, number(0, open_low=True),
        "tie-breaking epsilon of the RoC penalty ordering",
    ),
    "rl.estimator": Field(
        _ITERATION.estimator, ESTIMATOR,
        "advantage estimator: a registered one (grpo: group-normalised reward; algo.ADVANTAGE_ESTIMATORS) or "
        "module:function (docs/extending.md)",
    ),
    "rl.std": Field(_ITERATION.std, choice(algo.STD_MODES), STD_HELP),
    "rl.advantage_eps": Field(
        _ITERATION.advantage_eps, number(0, open_low=True),
        "added to the group std before dividing",
    ),
    "rl.format_penalty": Field(_ITERATION.format_penalty, choice(algo.FORMAT_PENALTIES), FORMAT_PENALTY_HELP),
    "rl.mask_truncated": Field(
        _ITERATION.mask_truncated, flag(),
        "truncated responses carry no loss (they still count in their group's advantages)",
    ),
    "rl.overlong_buffer": Field(
        _ITERATION.overlong_buffer, AT_LEAST_0,
        "DAPO soft overlong penalty over the last N tokens of the budget (0: off)",
    ),
    "rl.overlong_penalty_factor": Field(
        _ITERATION.overlong_penalty_factor, number(0),
        "DAPO soft overlong penalty at the budget (reward - factor)",
    ),
    "rl.off_policy_steps": Field(
        0, integer(0, 1),
        "1: roll out step n+1 with step n's parameters before step n's update (one-step off-policy, needs "
        "loss.old_logprobs='recompute' and a rollout correction); 0: on-policy",
    ),
    "rl.schedule": Field("synchronous", choice(ROLLOUT_SCHEDULES), SCHEDULE_HELP),
    "rl.max_staleness": Field(
        1, AT_LEAST_0,
        "async: eta, the most policy versions a trained token may lag the parameters it updates (a "
        "guarantee: admission waits; 0 gives the synchronous schedule's batches)",
    ),
    "rl.off_policy_correction": Field("auto", choice(OFF_POLICY_CORRECTION_OPTIONS), CORRECTION_HELP),
    "rl.placement": Field("colocated", choice(PLACEMENTS), PLACEMENT_HELP),
    "rl.rollout_devices": Field(
        1, POSITIVE,
        "split placement: devices of each process the rollout engines take (one engine per device); the "
        "train mesh takes the others",
    ),
    "rl.max_nonfinite_steps": Field(
        3, POSITIVE,
        "a step with a non-finite loss or gradient skips its update; this many in a row stop the run (exit "
        "3, the last checkpoint kept)",
    ),
    "batch.max_prompt_length": Field(
        1024, POSITIVE,
        "longest prompt in tokens (longer problems are rejected)",
    ),
    "batch.pack": Field(
        True, flag(),
        "pack several trajectories per row; False: one per row (worst case must fit)",
    ),
    "rollout.temperature": Field(
        1.0, number(0, open_low=True),
        "sampling temperature of rollouts, also the one the trainer divides logits by (it scores what the "
        "sampler drew from)",
    ),
    "rollout.top_p": Field(1.0, number(0, 1, open_low=True), "nucleus sampling (1: off)"),
    "rollout.top_k": Field(0, AT_LEAST_0, "top-k sampling (0: off)"),
    "rollout.max_tool_calls_per_turn": Field(1, POSITIVE, "tool calls run per assistant turn"),
    "rollout.tool_timeout": Field(10.0, number(0, open_low=True), "seconds a tool call may run"),
    "rollout.tool_output_chars": Field(2048, POSITIVE, "tool output kept per call (characters)"),
    "rollout.sandbox_url": Field("", url(), "code sandbox URL (empty: start a local one for the run)"),
    "rollout.sandbox_workers": Field(2, POSITIVE, "workers of the local sandbox"),
    "rollout.sandbox_outage_s": Field(
        300.0,
        number(0, open_low=True, expectation="must be a positive number "
                                      "of seconds"),
        "seconds tool calls wait (retrying with back-off) for a sandbox that does not answer; past it the "
        "run stops (exit 3) keeping the last finished step's checkpoint",
    ),
    "rollout.tools": Field(
        ("python",), TOOL_LIST,
        "the model's tools, each listed in the prompt: python (the sandbox's), a registered tool or "
        "module:function (a function with type hints and an Args: docstring; docs/extending.md)",
    ),
    "reward.fn": Field(
        "", FUNCTION_NAME,
        "module:function scoring a finished trajectory from (trajectory, problem) in place of the answer "
        "verifier (run in its worker processes, under its timeout); empty: the verifier",
    ),
    "rollout.engine_slots": Field(64, POSITIVE, "concurrent sequences in the generation engine"),
    "rollout.kv_cache_tokens": Field(
        0, AT_LEAST_0,
        "tokens the KV page pool holds (0: engine_slots x the longest sequence)",
    ),
    # Low-precision rollout (issue 41): the engine's own copy of the weights and its KV pages; the trainer's
    # weights and compute dtype stay as they are.
    "rollout.weight_dtype": Field(
        "", choice(("", FP8)),
        "the engine's copy of the linear layers' weights: '' (model.compute_dtype) or fp8 (float8_e4m3fn in "
        "weight_block x weight_block blocks with float32 scales, made at every weight update: 0.59x the "
        "bfloat16 engine weights at Qwen3-1.7B)",
    ),
    "rollout.kv_dtype": Field(
        "", choice(("", FP8, *SUPPORTED_DTYPES)),
        "KV page dtype: '' (model.compute_dtype), fp8 (float8_e4m3fn with a scale per head and token slot: "
        "a pool of the same bytes holds 1.97x the bfloat16 tokens) or a float dtype",
    ),
    "rollout.quantize_head": Field(
        False, flag(),
        "with weight_dtype=fp8, the output head in FP8 too (default: the compute dtype; the head is the "
        "main source of mismatch)",
    ),
    "rollout.weight_block": Field(
        128, POSITIVE,
        "FP8 weight block edge (DeepSeek-V3 / verl: 128); must divide both sides of every quantized weight",
    ),
    "rollout.fp8_matmul": Field(
        "auto", choice(FP8_MATMULS),
        "FP8 weights' matmuls: auto (float8 dots where the backend has them: H100/H200, MI300; else "
        "dequantize, then multiply) / native / reference",
    ),
    "rollout.attention": Field(
        "auto", choice(DECODE_ATTENTION),
        "the engine's paged decode attention: auto (the Pallas kernel on CUDA GPUs, else blockwise) / "
        "blockwise / pallas_triton",
    ),
    "rollout.numerics": Field(
        "default", choice(NUMERICS),
        "default / exact: the engine and the trainer compute with the same batch-invariant programs, so the "
        "sampler's log-probs are the trainer's bit for bit (pi_old without a recompute pass; slower: "
        "docs/exact_numerics.md); with FP8 weights or KV pages (rollout.weight_dtype / kv_dtype) the "
        "trainer's forward runs the same quantized weights and keys/values, its gradient passed straight "
        "through",
    ),
    "rollout.partial_token_budget": Field(
        0, AT_LEAST_0,
        "partial rollouts: > 0 stops a step's rollouts after this many sampled tokens, trains on the "
        "finished groups and resumes the rest next step (0: off; needs the rollout correction)",
    ),
    "rollout.on_update": Field(
        "keep", choice(ON_UPDATE),
        "async: sequences running when new weights arrive decode on over their keys/values (keep) or "
        "prefill them again with the new weights (recompute)",
    ),
    "rollout.partial_segment_tokens": Field(
        64, POSITIVE,
        "partial rollouts: tokens a session samples between budget checks",
    ),
    # Colocated rollout and training (rstar2jax.schedules.colocate); the engine's KV page pool exists only
    # during rollout.
    "colocate.optimizer_memory": Field(
        "auto", choice(OFFLOAD_OPTIONS),
        "where optimizer moments wait during rollout: auto (host on accelerators, device on CPU) / host "
        "(pinned) / device",
    ),
    "device_memory_gib": Field(
        None, optional(number(0, open_low=True)),
        "per-device memory the plan is checked against (None: what the device reports)",
    ),
    "filter_batch_size": Field(64, POSITIVE, "problems per batch of the hard-problem filter's rollouts"),
    "stages": Field([], STAGE_LIST, "the RL stages, run in order"),
}

#: The fields of one RL stage (``config.stages[i]``, written with ``config.stage``).
STAGE: dict[str, Field] = {
    "name": Field("", text(empty=False), "stage name (in logs and checkpoints)"),
    "steps": Field(1, POSITIVE, "RL steps of the stage"),
    "max_response_length": Field(1, POSITIVE, "response budget in tokens (all turns and tool outputs)"),
    "max_turns": Field(1, POSITIVE, "assistant turns per rollout"),
    "dataset": Field(
        "", text(),
        "the stage's problems (empty: the previous stage's, the first: data.source)",
        exists="problems",
    ),
    "hard_filter_rollouts": Field(
        0, AT_LEAST_0,
        "k > 0: at the stage start drop problems the policy solves k/k",
    ),
    "reset_optimizer": Field(False, flag(), "fresh optimizer moments and schedule at the stage start"),
}

