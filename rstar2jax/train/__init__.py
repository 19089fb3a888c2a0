"""SFT and RL steps, optimizer, mesh, orbax checkpoints, metrics, policy export and evaluation.

Importing this package does not start JAX's backends, so launchers can still request emulated devices
(``request_host_devices``) or join a multi-host run (``initialize_distributed``) afterwards.
"""

from rstar2jax.data.batch import Batch, TokenSequence, build_batch, trajectory_sequence
from rstar2jax.data.sft_data import load_sft_sequences
from rstar2jax.train import lora  # the module: LoRA runs (train.lora.FrozenBase, adapter_folder, ...)
from rstar2jax.train.checkpoint import Checkpointer, CheckpointError, CheckpointWriteError
from rstar2jax.train.cluster import ClusterLaunch, cluster_launch
from rstar2jax.train.config import rl_config, sft_config, stage
from rstar2jax.train.dry_run import check_memory_plan, dry_run, format_dry_run
from rstar2jax.train.faults import EmptyRollout, NonFiniteUpdates, RunFault
from rstar2jax.train.loss_config import RLLossConfig
from rstar2jax.train.metrics import MetricsLogger
from rstar2jax.train.options import ConfigError, PolicyOptions, RunOptions, StageOptions
from rstar2jax.train.parse import parse
from rstar2jax.train.parse_model import policy_options
from rstar2jax.train.rl import filter_hard_problems, rl_iteration
from rstar2jax.train.rl_loop import train_rl
from rstar2jax.train.run import Interrupted, RunPaths, StopSignal
from rstar2jax.train.runtime import (
    check_rollout_precision,
    initialize_distributed,
    mesh_from_config,
    prepare_process,
    request_host_devices,
)
from rstar2jax.train.schedule import OneStepOffPolicy, Partial, RolloutSchedule, Synchronous
from rstar2jax.train.schedule_choice import make_schedule
from rstar2jax.train.schedule_state import ScheduleInvariantError
from rstar2jax.train.selection import RLIterationConfig, rollout_metrics, select_and_build_batch
from rstar2jax.train.sft_loop import train_sft
from rstar2jax.train.state import (
    TrainState,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    reset_optimizer,
)
from rstar2jax.train.steps import (
    make_rl_step,
    make_sft_step,
    rl_loss,
    rl_step,
    sft_loss,
    sft_step,
    state_shardings,
    trainable_params,
)
from rstar2jax.train.updates import accumulate_gradients, with_adapters
from rstar2jax.train.wandb_run import WandbRun, check_wandb

__all__ = [
    "Batch",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "ClusterLaunch",
    "ConfigError",
    "EmptyRollout",
    "Interrupted",
    "MetricsLogger",
    "NonFiniteUpdates",
    "RLIterationConfig",
    "RLLossConfig",
    "OneStepOffPolicy",
    "Partial",
    "RolloutSchedule",
    "StopSignal",
    "Synchronous",
    "RunFault",
    "ScheduleInvariantError",
    "RunOptions",
    "RunPaths",
    "StageOptions",
    "TokenSequence",
    "TrainState",
    "WandbRun",
    "accumulate_gradients",
    "lora",
    "trainable_params",
    "with_adapters",
    "build_batch",
    "check_memory_plan",
    "check_rollout_precision",
    "check_wandb",
    "cluster_launch",
    "dry_run",
    "filter_hard_problems",
    "format_dry_run",
    "init_train_state",
    "initialize_distributed",
    "learning_rate_schedule",
    "load_sft_sequences",
    "make_optimizer",
    "make_rl_step",
    "make_schedule",
    "make_sft_step",
    "mesh_from_config",
    "parse",
    "prepare_process",
    "request_host_devices",
    "reset_optimizer",
    "rl_config",
    "rl_iteration",
    "policy_options",
    "PolicyOptions",
    "rl_loss",
    "rl_step",
    "rollout_metrics",
    "select_and_build_batch",
    "sft_config",
    "sft_loss",
    "sft_step",
    "stage",
    "state_shardings",
    "train_rl",
    "train_sft",
    "trajectory_sequence",
]
