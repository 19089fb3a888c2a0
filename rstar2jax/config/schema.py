"""Every run-config field, declared once: its default, the check its values must pass and what it means.

``config.rl_config()`` / ``sft_config()`` build the launchers' configs from these tables, ``--print_config``
and ``field_help`` read the meanings from them, and ``parse`` checks every value against them (then the rules
between fields, ``rstar2jax.config.rules``). The fields every config has are ``COMMON``, an SFT config's own
``SFT``; an RL config's own and a stage's are ``rstar2jax.config.schema_rl``'s ``RL`` and ``STAGE``.

Adding a field: one ``Field(default, check, meaning)`` entry in its table, and a field of the same name in
the typed option that carries it, which ``rstar2jax.config.parse`` fills by name: ``rl.x`` in
``RLIterationConfig`` (how a step's groups become a batch) or ``RLLoopOptions`` (the loop's),
``loss.x`` in ``RLLossConfig``, ``rollout.x`` in ``RolloutOptions``, ``data.x`` / ``sft.x`` / ``mesh.x`` /
``optimizer.x`` / ``checkpoint.x`` / ``logging.x`` / ``distributed.x`` in their options; a value another
type takes (an ``EngineConfig`` field, say) is passed on in ``parse`` explicitly. Parsing fails on a declared
field it builds nothing from, so none is forgotten. A rule between the field and others goes to
``rstar2jax.config.rules``; the config tests then give the field each bad value its check declares.
"""

from __future__ import annotations

import dataclasses

from rstar2jax.config.checks import (
    AT_LEAST_0,
    POSITIVE,
    Check,
    Field,
    choice,
    flag,
    integer,
    number,
    optional,
    text,
)
from rstar2jax.config.schema_rl import AUTO, RL, loss_option_fields
from rstar2jax.config.vocabulary import SCHEDULES
from rstar2jax.models.config import (
    ATTENTION_ALIASES,
    ATTENTION_IMPLEMENTATIONS,
    EXACT_KERNELS,
    REMAT_POLICIES,
    SUPPORTED_DTYPES,
)
from rstar2jax.models.lora import LORA_TARGETS
from rstar2jax.models.presets import PRESETS

DTYPE = choice(SUPPORTED_DTYPES)
#: A check of ``model.spec``'s mapping only: its fields are ``ModelConfig``'s, checked when it is built.
MODEL_FIELDS = Check(lambda v: hasattr(v, "keys"), "must be a mapping of ModelConfig fields", dict)
#: ``distributed.num_processes``: "auto" (or None) asks the cluster scheduler's environment.
PROCESSES = Check(lambda v: v in (AUTO, None) or POSITIVE(v),
                  "must be 'auto' (the cluster's environment says; None too) or a positive integer", object,
                  (0, -1, "x"))
#: What W&B refuses in a project or entity name.
WANDB_NAME = Check(lambda v: isinstance(v, str) and not set(v) & set("/\\#?%:") and len(v) <= 128,
                   "must be '' or a W&B name (at most 128 characters, none of / \\ # ? % :)", str,
                   ("team/project", "x" * 129))
TAGS = Check(lambda v: isinstance(v, list | tuple) and all(isinstance(t, str) and t for t in v),
             "must be a list of non-empty strings", tuple, (("",), ("a", 1)))
LORA_TARGET_LIST = Check(
    lambda v: isinstance(v, list | tuple) and len(v) > 0 and all(t in LORA_TARGETS for t in v)
    and len(set(v)) == len(v),
    f"must list projections, each once (any of {LORA_TARGETS})",
    tuple,
    (("no_such_projection",),),
)

#: Fields of every run config (RL and SFT), in the config's order.
COMMON: dict[str, Field] = {
    "seed": Field(0, AT_LEAST_0, "seed of the initial weights, data order and sampling"),
    "workdir": Field(
        "runs/default", text(empty=False),
        "the run's folder: checkpoints/, metrics.jsonl, tensorboard/; a rerun resumes from it",
    ),
    "notice": Field(
        "", text(),
        "a line the launchers print at start (e.g. that the config is only a smoke test)",
    ),
    "model.path": Field(
        "", text(),
        "HF checkpoint folder (config.json + safetensors) to start from; wins over the ones below",
        exists="path",
    ),
    "model.config_json": Field(
        "", text(),
        "or an HF config.json, or a preset name: random weights of that shape",
        exists="path",
    ),
    "model.preset": Field(
        "", Check(lambda v: v == "" or v in PRESETS, f"must be one of {PRESETS} (or '': none)", str, ("x",)),
        "or a named model shape (models.PRESETS), refined by model.spec fields: random weights",
    ),
    "model.spec": Field(
        {}, MODEL_FIELDS,
        "or inline ModelConfig fields (model_type, hidden_size, ...): random weights",
    ),
    "model.param_dtype": Field("float32", DTYPE, "dtype of the master weights and optimizer moments"),
    "model.compute_dtype": Field("float32", DTYPE, "dtype of activations and matmuls"),
    "model.remat_policy": Field(
        "none", choice(REMAT_POLICIES),
        "activation rematerialisation: none / full / ... (memory for compute)",
    ),
    "model.scan_layers": Field(
        True, flag(),
        "scan over stacked layers (faster compiles) instead of unrolling them",
    ),
    "model.attention": Field(
        "auto", choice((*ATTENTION_IMPLEMENTATIONS, *ATTENTION_ALIASES)),
        "training attention: auto (the first GPU kernel that passes its check, else blockwise) / blockwise / "
        "pallas_triton / jax_pallas_mha / tokamax / dense (old name: xla)",
    ),
    "model.attention_block_size": Field(
        512, Check(lambda v: POSITIVE(v) and v % 8 == 0, "must be a multiple of 8 (> 0)", int, (0, 12, "x")),
        "query/key block of the blockwise attention (a multiple of 8)",
    ),
    "model.exact_kernels": Field(
        "auto", choice(EXACT_KERNELS),
        "what exact numerics (rollout.numerics='exact') compute with: auto (Pallas Triton kernels on CUDA / "
        "ROCm GPUs, else XLA) / xla / pallas_triton (docs/exact_numerics.md)",
    ),
    "model.mlp_chunk_size": Field(
        0, AT_LEAST_0,
        "> 0: the MLP over rematerialised token chunks of this size (0: whole sequence)",
    ),
    "model.lora.rank": Field(
        0, AT_LEAST_0,
        "LoRA rank r (0: off, full fine-tuning); > 0 trains adapters, the base stays frozen",
    ),
    "model.lora.alpha": Field(
        32.0, number(0, open_low=True),
        "LoRA scale numerator: the adapters' path is multiplied by alpha / rank",
    ),
    "model.lora.targets": Field(
        LORA_TARGETS, LORA_TARGET_LIST,
        f"projections that get adapters (any of {LORA_TARGETS})",
    ),
    "model.lora.dropout": Field(
        0.0, number(0, 1, open_high=True),
        "dropout on the adapters' input (SFT only; RL needs a deterministic policy)",
    ),
    "model.lora.rslora": Field(False, flag(), "rank-stabilised scale alpha / sqrt(rank) (PEFT's use_rslora)"),
    "model.lora.dtype": Field(
        "float32", DTYPE,
        "dtype of the adapters and their optimizer moments (the base: model.param_dtype)",
    ),
    "model.lora.adapter": Field(
        "", text(),
        "a PEFT adapter folder to start from (continue training); empty: fresh adapters",
        exists="folder",
    ),
    "mesh.data": Field(1, POSITIVE, "data-parallel mesh axis size"),
    "mesh.fsdp": Field(1, POSITIVE, "fully-sharded data-parallel axis size (weights and optimizer sharded)"),
    "mesh.tensor": Field(
        1, POSITIVE,
        "tensor-parallel axis size (heads and MLP split); data x fsdp x tensor = devices",
    ),
    "optimizer.learning_rate": Field(1e-6, number(0, open_low=True), "AdamW peak learning rate"),
    "optimizer.warmup_steps": Field(
        20, AT_LEAST_0,
        "linear warm-up steps (-1 in SFT: sft.warmup_fraction of the run)",
    ),
    "optimizer.schedule": Field("constant", choice(SCHEDULES), "after warm-up: constant or cosine decay"),
    "optimizer.total_steps": Field(
        None, optional(POSITIVE),
        "steps the schedule spans (None: the run's length)",
    ),
    "optimizer.weight_decay": Field(0.01, number(0), "AdamW decoupled weight decay"),
    "optimizer.b1": Field(0.9, number(0, 1, open_high=True), "AdamW beta1"),
    "optimizer.b2": Field(0.999, number(0, 1, open_high=True), "AdamW beta2"),
    "optimizer.eps": Field(1e-8, number(0, open_low=True), "AdamW epsilon"),
    "optimizer.max_grad_norm": Field(
        1.0, optional(number(0, open_low=True)),
        "global gradient-norm clip (None: no clipping)",
    ),
    "num_microbatches": Field(
        1, POSITIVE,
        "gradient accumulation: each step's batch in this many sequential micro-batches",
    ),
    "checkpoint.save_every": Field(
        10, POSITIVE,
        "save a checkpoint every this many steps (and at the end, and on Ctrl-C)",
    ),
    "checkpoint.keep": Field(3, POSITIVE, "how many of the latest checkpoints to keep"),
    "checkpoint.async_save": Field(True, flag(), "write checkpoints in a background thread"),
    "logging.tensorboard": Field(True, flag(), "also write TensorBoard events to <workdir>/tensorboard"),
    "logging.progress": Field(
        True, flag(),
        "show progress (a bar on a terminal, else one line every progress_every steps)",
    ),
    "logging.progress_every": Field(
        10, POSITIVE,
        "steps between progress lines when the output is not a terminal",
    ),
    "logging.rollout_record": Field(
        None, optional(number(0, 1)),
        "RL: the fraction of each step's groups written to <workdir>/rollouts/ (docs/async.md); None: every "
        "group while a step samples at most 64 rollouts, else about 64 rollouts' worth",
    ),
    # Weights & Biases (docs/cluster.md): pip install -e '.[wandb]'; WANDB_MODE=offline: local files only.
    "logging.wandb.project": Field(
        "", WANDB_NAME,
        "Weights & Biases project to log the run to ('': off); process 0 logs, resumes continue the run",
    ),
    "logging.wandb.entity": Field("", WANDB_NAME, "Weights & Biases team or user ('': your default)"),
    "logging.wandb.name": Field("", text(), "Weights & Biases run name ('': the work folder's name)"),
    "logging.wandb.tags": Field((), TAGS, "Weights & Biases run tags"),
    # Multi-host (docs/cluster.md): under SLURM, Open MPI or a Kubernetes indexed Job "auto" is enough;
    # elsewhere every process gets the same config plus its own process_id.
    "distributed.coordinator_address": Field(
        "", text(),
        "multi-host: HOST:PORT of process 0 (empty: one process, or with num_processes 'auto' the "
        "cluster's)",
    ),
    "distributed.num_processes": Field(
        AUTO, PROCESSES,
        "multi-host: number of processes (hosts); 'auto': what SLURM / Open MPI / a Kubernetes indexed Job "
        "says (jax.distributed's own detection), one process elsewhere",
    ),
    "distributed.process_id": Field(
        0, AT_LEAST_0,
        "multi-host: this process's index, 0 .. num_processes - 1 (with 'auto': the cluster's)",
    ),
    # What the policy sees around a problem (PromptConfig), recorded in every exported policy folder. SFT data
    # written for this policy must use the same prompt (the demo copies its own prompt here).
    "prompt.paper": Field(
        None, optional(flag()),
        "None: the format recorded in model.path's folder (else the paper's); True: the paper's prompt "
        "(system text, the tool schema listed); False: the fields below",
    ),
    "prompt.system_prompt": Field("", text(), "system text when prompt.paper is False"),
    "prompt.user_prefix": Field("", text(), "text put before each problem when prompt.paper is False"),
    "prompt.list_tools": Field(
        True, flag(),
        "list the Python tool's schema in the prompt when prompt.paper is False",
    ),
    "tokenizer": Field(
        "", text(),
        "tokenizer folder (HF format, with its chat template); empty: model.path's own tokenizer, else pre-"
        "tokenised SFT data only",
        exists="folder",
    ),
}

#: An SFT run's own fields (non-reasoning SFT; paper: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128).
SFT: dict[str, Field] = {
    "sft.data": Field(
        "", text(empty=False),
        "SFT data: JSONL of chats (messages, tools) or pre-tokenised input_ids + loss_mask",
        exists="data",
    ),
    "sft.epochs": Field(3, POSITIVE, "passes over the SFT data"),
    "sft.batch_size": Field(128, POSITIVE, "SFT examples per step (packed into rows of sft.seq_len)"),
    "sft.seq_len": Field(4096, POSITIVE, "packed row length in tokens"),
    "sft.warmup_fraction": Field(
        0.04, number(0, 1, open_high=True),
        "warm-up share of the run when optimizer.warmup_steps is -1",
    ),
    "sft.steps": Field(None, optional(POSITIVE), "SFT steps (None: epochs x examples / batch_size)"),
}
#: What an SFT run changes in ``COMMON``'s fields.
SFT_COMMON = {
    "optimizer.learning_rate": dataclasses.replace(COMMON["optimizer.learning_rate"], default=5e-6),
    "optimizer.schedule": dataclasses.replace(COMMON["optimizer.schedule"], default="cosine"),
    "optimizer.warmup_steps": dataclasses.replace(COMMON["optimizer.warmup_steps"], default=-1,
                                                  check=integer(low=-1)),
}

KINDS = ("rl", "sft")


def fields(kind: str) -> dict[str, Field]:
    """Every field of a ``kind`` ("rl" | "sft") run config, in the config's order (a stage's: ``STAGE``)."""
    if kind == "rl":  # and the options of the registered policy losses the table lacks
        return {**COMMON, **RL, **loss_option_fields(RL)}
    if kind == "sft":
        return {**COMMON, **SFT_COMMON, **SFT}
    raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
