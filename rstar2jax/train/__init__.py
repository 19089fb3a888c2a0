"""The trainer: SFT and RL steps, the train state and optimizer, the SFT and RL loops, the run's lifecycle
(checkpoints, metrics, faults, the stop signal), the mesh and devices, the trainer's rollout function
(``train.rollouts``) and LoRA runs (``train.lora``).

The run's options come from :mod:`rstar2jax.config`, the rollout schedules from :mod:`rstar2jax.schedules`
and loading or exporting a policy from :mod:`rstar2jax.policy`; their names stay importable from here too
(``train.parse``, ``train.RunOptions``, ``train.make_schedule``, ...), as the launchers use them.

Importing this package starts nothing (names load on use) and does not start JAX's backends, so launchers
can still request emulated devices (``request_host_devices``) or join a multi-host run
(``initialize_distributed``) afterwards.
"""

from rstar2jax.config.lazy import LazyNames

_NAMES = {
    "rstar2jax.config.algorithm": ["RLIterationConfig"],
    "rstar2jax.config.config": ["rl_config", "sft_config", "stage"],
    "rstar2jax.config.loss_config": ["RLLossConfig"],
    "rstar2jax.config.options": ["ConfigError", "PolicyOptions", "RunOptions", "StageOptions"],
    "rstar2jax.config.parse": ["parse"],
    "rstar2jax.config.parse_model": ["policy_options"],
    "rstar2jax.data.batch": ["Batch", "TokenSequence", "build_batch", "trajectory_sequence"],
    "rstar2jax.data.sft_data": ["load_sft_sequences"],
    "rstar2jax.schedules.schedule": ["OneStepOffPolicy", "Partial", "RolloutSchedule", "Synchronous"],
    "rstar2jax.schedules.schedule_choice": ["make_schedule"],
    "rstar2jax.schedules.schedule_state": ["ScheduleInvariantError"],
    "rstar2jax.train.checkpoint": ["CheckpointError", "CheckpointWriteError", "Checkpointer"],
    "rstar2jax.train.cluster": ["ClusterLaunch", "cluster_launch"],
    "rstar2jax.train.dry_run_report": ["check_memory_plan", "dry_run", "format_dry_run"],
    "rstar2jax.train.faults": ["EmptyRollout", "NonFiniteUpdates", "RunFault"],
    "rstar2jax.train.metrics": ["MetricsLogger"],
    "rstar2jax.train.rl": ["filter_hard_problems", "rl_iteration"],
    "rstar2jax.train.rl_loop": ["train_rl"],
    "rstar2jax.train.run": ["Interrupted", "RunPaths", "StopSignal"],
    "rstar2jax.train.runtime": [
        "check_mesh", "check_rollout_precision", "initialize_distributed", "mesh_from_config",
        "prepare_process", "request_host_devices",
    ],  # fmt: skip
    "rstar2jax.train.selection": ["rollout_metrics", "select_and_build_batch"],
    "rstar2jax.train.sft_loop": ["train_sft"],
    "rstar2jax.train.state": [
        "TrainState", "init_train_state", "learning_rate_schedule", "make_optimizer", "reset_optimizer",
    ],  # fmt: skip
    "rstar2jax.train.steps": [
        "make_rl_step", "make_sft_step", "rl_loss", "rl_step", "sft_loss", "sft_step", "state_shardings",
        "trainable_params",
    ],  # fmt: skip
    "rstar2jax.train.updates": ["accumulate_gradients", "with_adapters"],
    "rstar2jax.train.wandb_run": ["WandbRun", "check_wandb"],
}
#: Modules of this package the README documents as ``train.<module>`` (loaded on first use, like the names).
_MODULES = ("export", "lora", "policy", "rollouts")
_LAZY = LazyNames(globals(), _NAMES, _MODULES).install()
__all__ = sorted([*_LAZY.names, "lora"])
