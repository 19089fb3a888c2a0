"""The rules between run-config fields, checked by ``parse`` after every field passed its own check: values
that are each allowed but contradict one another (``rl.keep`` above ``rl.samples_per_problem``, tokens of an
older policy without the rollout correction, a batch that does not split over the devices, ...). Each raises
``ConfigError`` naming the fields in one line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rstar2jax.train.options import ConfigError, StageOptions


def common_rules(v: Mapping[str, Any]) -> None:
    """Where the model comes from, and the processes of a multi-host run."""
    if not v["model.path"]:  # model.path wins over the others: --config.model.path=<a policy> starts from it
        sources = [name for name in ("config_json", "preset") if v[f"model.{name}"]]
        if len(v["model.spec"]) and sources != ["preset"]:  # spec fields refine a preset's
            sources += ["spec"]
        if len(sources) != 1:
            raise ConfigError(
                f"config.model: set exactly one of config_json / preset / spec (spec may refine a preset; "
                f"model.path wins over all of them), got {sources or 'none'}"
            )
    processes = v["distributed.num_processes"]
    if v["distributed.process_id"] >= processes:
        raise ConfigError(f"config.distributed.process_id={v['distributed.process_id']}: must be in [0, "
                          f"distributed.num_processes={processes})")
    if processes > 1 and not v["distributed.coordinator_address"]:
        raise ConfigError(f"config.distributed.coordinator_address='': must name process 0 (HOST:PORT) when "
                          f"distributed.num_processes={processes}")


def _selection_rules(v: Mapping[str, Any], stages: Sequence[StageOptions]) -> None:
    samples, keep = v["rl.samples_per_problem"], v["rl.keep"]
    if keep > samples:
        raise ConfigError(f"config.rl.keep={keep}: must be an integer in [1, rl.samples_per_problem="
                          f"{samples}]")
    for i, s in enumerate(stages):
        if v["rl.overlong_buffer"] > s.max_response_length:
            raise ConfigError(f"config.rl.overlong_buffer={v['rl.overlong_buffer']} is longer than "
                              f"stages[{i}].max_response_length={s.max_response_length}")
    if not v["batch.pack"]:
        rows = v["rl.prompts_per_step"] * keep
        multiple = v["num_microbatches"] * v["mesh.data"] * v["mesh.fsdp"]
        if rows % multiple:
            raise ConfigError(
                f"config.rl.prompts_per_step x rl.keep = {rows} rows must be a multiple of "
                f"num_microbatches x mesh.data x mesh.fsdp = {multiple} when batch.pack=False"
            )
    if v["model.lora.rank"] and v["model.lora.dropout"]:
        raise ConfigError(
            f"config.model.lora.dropout={v['model.lora.dropout']}: must be 0 in RL (a random policy makes "
            "the importance ratio pi / pi_old noise); dropout is for SFT"
        )


def _engine_rules(v: Mapping[str, Any], stages: Sequence[StageOptions]) -> None:
    """One problem's group of rollouts (and a hard filter's) decodes in the engine side by side; its KV pool
    holds at least one longest sequence."""
    slots = v["rollout.engine_slots"]
    if slots < v["rl.samples_per_problem"]:
        raise ConfigError(f"config.rollout.engine_slots={slots}: must be at least rl.samples_per_problem="
                          f"{v['rl.samples_per_problem']} (one problem's rollouts decode side by side)")
    for i, s in enumerate(stages):
        if s.hard_filter_rollouts > slots:
            raise ConfigError(f"config.stages[{i}].hard_filter_rollouts={s.hard_filter_rollouts}: must be at "
                              f"most rollout.engine_slots={slots} (a problem's rollouts decode side by side)")
    longest = max(s.engine_max_len for s in stages)
    tokens = v["rollout.kv_cache_tokens"]
    if 0 < tokens < longest:
        raise ConfigError(f"config.rollout.kv_cache_tokens={tokens}: must be 0 (every slot at full length) "
                          f"or hold one longest sequence, {longest} tokens (batch.max_prompt_length + the "
                          "longest stage's max_response_length, in whole KV pages)")


def _rollouts_across_updates(v: Mapping[str, Any]) -> None:
    """One-step off-policy and partial rollouts: not both, and the rollout correction on."""
    correction = v["loss.rollout_is_cap"] is not None or v["loss.rollout_mask"] is not None
    recompute = v["loss.old_logprobs"] == "recompute"
    if correction and not recompute:
        raise ConfigError(
            "config.loss.rollout_is_cap / loss.rollout_mask: rollout correction compares the trainer's "
            "log-probs with the sampler's; set loss.old_logprobs='recompute'"
        )
    off, budget = v["rl.off_policy_steps"], v["rollout.partial_token_budget"]
    if off and budget:
        raise ConfigError(
            "config.rl.off_policy_steps=1 and config.rollout.partial_token_budget > 0 do not combine: "
            "pick one way for rollouts to cross a policy update"
        )
    if not (off or budget):
        return
    option = "config.rl.off_policy_steps=1" if off else "config.rollout.partial_token_budget > 0"
    if not (recompute and correction):
        raise ConfigError(
            f"{option} trains on tokens an older policy sampled: it needs the rollout correction, "
            "loss.old_logprobs='recompute' with loss.rollout_is_cap and/or loss.rollout_mask set"
        )
    if budget and v["distributed.num_processes"] > 1:
        raise ConfigError(f"{option}: partial rollouts run in one process (distributed.num_processes=1)")


def rl_rules(v: Mapping[str, Any], stages: Sequence[StageOptions]) -> None:
    """An RL config's rules: selection and batch, the engine, rollouts across an update, the problems."""
    _selection_rules(v, stages)
    _engine_rules(v, stages)
    _rollouts_across_updates(v)
    if not v["data.source"] and not stages[0].dataset:
        raise ConfigError("config.data.source is empty and config.stages[0].dataset names no dataset")
