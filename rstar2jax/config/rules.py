"""The rules between run-config fields, checked by ``parse`` after every field passed its own check: values
that are each allowed but contradict one another (``rl.keep`` above ``rl.samples_per_problem``, tokens of an
older policy without the rollout correction, a batch that does not split over the devices, ...). Each raises
``ConfigError`` naming the fields in one line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rstar2jax.config.loss_config import correction_contradiction
from rstar2jax.config.options import ConfigError, StageOptions
from rstar2jax.config.schema_rl import AUTO, MISMATCH_IS_CAP


def off_policy_correction(option: str, schedule: str, max_staleness: int) -> str:
    """The correction ``rl.off_policy_correction=option`` asks for: "auto" is "decoupled" for the
    asynchronous schedule with stale tokens allowed (``max_staleness`` > 0), "none" otherwise."""
    if option == "auto":
        return "decoupled" if schedule == "async" and max_staleness > 0 else "none"
    return option


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
    if processes in (AUTO, None):  # the cluster's environment says, when the process starts
        if v["distributed.process_id"]:
            raise ConfigError(f"config.distributed.process_id={v['distributed.process_id']}: the cluster "
                              f"says each process's id when distributed.num_processes={processes!r}; set "
                              "num_processes too, or leave process_id 0")
        return
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
        multiple = v["rl.mini_batches"] * v["num_microbatches"] * v["mesh.data"] * v["mesh.fsdp"]
        if rows % multiple:
            raise ConfigError(
                f"config.rl.prompts_per_step x rl.keep = {rows} rows must be a multiple of num_microbatches "
                f"x mesh.data x mesh.fsdp x rl.mini_batches = {multiple} when batch.pack=False"
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


def _decoupled(v: Mapping[str, Any]) -> bool:
    """Whether the loss is the decoupled objective (``rl.off_policy_correction``, "auto" resolved)."""
    return off_policy_correction(v["rl.off_policy_correction"], v["rl.schedule"],
                                 v["rl.max_staleness"]) == "decoupled"


def _rollouts_across_updates(v: Mapping[str, Any]) -> None:
    """The loss's correction options agree (``loss_config.correction_contradiction``); one-step off-policy and
    partial rollouts: not both, and a correction on (the rollout correction, or the decoupled objective)."""
    correction = v["loss.rollout_is_cap"] is not None or v["loss.rollout_mask"] is not None
    recompute = v["loss.old_logprobs"] == "recompute"
    if contradiction := correction_contradiction(v["loss.old_logprobs"], v["loss.rollout_is_cap"],
                                                 v["loss.rollout_mask"], decoupled=_decoupled(v)):
        names, why = contradiction
        value = f"={v['loss.' + names[0]]}" if len(names) == 1 else ""
        raise ConfigError(f"config.loss.{' / loss.'.join(names)}{value}: {why}")
    off, budget = v["rl.off_policy_steps"], v["rollout.partial_token_budget"]
    if off and budget:
        raise ConfigError(
            "config.rl.off_policy_steps=1 and config.rollout.partial_token_budget > 0 do not combine: "
            "pick one way for rollouts to cross a policy update"
        )
    if not (off or budget):
        return
    option = "config.rl.off_policy_steps=1" if off else "config.rollout.partial_token_budget > 0"
    if not (recompute and correction) and not _decoupled(v):
        raise ConfigError(
            f"{option} trains on tokens an older policy sampled: it needs the rollout correction, "
            "loss.old_logprobs='recompute' with loss.rollout_is_cap and/or loss.rollout_mask set, or "
            "rl.off_policy_correction='decoupled'"
        )
    processes = v["distributed.num_processes"]
    if processes not in (AUTO, None):  # "auto": checked once the cluster said (runtime.prepare_process)
        partial_rollout_processes(budget, processes)


def partial_rollout_processes(budget: int, processes: int, launch: str = "") -> None:
    """Partial rollouts (``rollout.partial_token_budget`` > 0) run in one process; ``launch``: where the
    process count came from (a cluster's launch), for the message."""
    if budget and processes > 1:
        said = f"; {launch} says {processes}" if launch else ""
        raise ConfigError("config.rollout.partial_token_budget > 0: partial rollouts run in one process "
                          f"(distributed.num_processes=1{said})")


def _asynchronous(v: Mapping[str, Any]) -> None:
    """The asynchronous schedule: alone (no other way across an update), a correction for stale tokens, the
    optimizer state on the device (the trainer updates while the engine runs), split placement only with
    it (the decoupled objective's own cap: ``loss_config.correction_contradiction``)."""
    schedule, eta = v["rl.schedule"], v["rl.max_staleness"]
    if v["rl.placement"] == "split" and schedule != "async":
        raise ConfigError("config.rl.placement='split' sets devices apart for a producer that decodes beside "
                          f"the trainer: it needs rl.schedule='async' (got {schedule!r})")
    if schedule != "async":
        return
    for name, on in (("rl.off_policy_steps", v["rl.off_policy_steps"]),
                     ("rollout.partial_token_budget", v["rollout.partial_token_budget"])):
        if on:
            raise ConfigError(f"config.{name}={on} and config.rl.schedule='async' do not combine: the "
                              "asynchronous schedule is its own way across policy updates")
    corrected = _decoupled(v) or v["loss.rollout_is_cap"] is not None or v["loss.rollout_mask"] is not None
    if eta > 0 and not corrected:
        raise ConfigError(
            f"config.rl.off_policy_correction={v['rl.off_policy_correction']!r} with rl.schedule='async' and "
            f"rl.max_staleness={eta}: tokens up to {eta} policy versions old need a correction, "
            "rl.off_policy_correction='decoupled' (what 'auto' picks) or loss.rollout_is_cap / rollout_mask "
            "with loss.old_logprobs='recompute'"
        )
    if v["colocate.optimizer_memory"] == "host":
        raise ConfigError("config.colocate.optimizer_memory='host' and rl.schedule='async' do not combine: "
                          "the trainer updates while the engine decodes, so the optimizer state stays on the "
                          "device ('auto' or 'device')")
def precision_gap(weight_dtype: str | None, kv_dtype: str | None, compute_dtype: str) -> str:
    """How the rollout engine's precision differs from the trainer's ``compute_dtype`` ('' when it does not):
    e.g. "fp8 weights and fp8 KV pages" (an engine ``weight_dtype`` / ``kv_dtype`` of '' or None is the
    compute dtype)."""
    parts = [f"{dtype} {what}" for dtype, what in ((weight_dtype, "weights"), (kv_dtype, "KV pages"))
             if dtype and dtype != compute_dtype]
    return " and ".join(parts)


def mismatch_correction(v: Mapping[str, Any]) -> dict[str, Any]:
    """``loss.old_logprobs`` and ``loss.rollout_is_cap`` with "auto" resolved. A rollout in another precision
    than the trainer computes in (``rollout.weight_dtype`` / ``kv_dtype``: FP8) samples from slightly other
    probabilities, so it gets token-level TIS by default: pi_old recomputed by the trainer and token weights
    pi_train / pi_rollout capped at ``MISMATCH_IS_CAP``; turning every correction off then takes
    ``loss.allow_uncorrected_mismatch=True``. Under the decoupled objective (the asynchronous schedule's
    default) "auto" is no cap: its behaviour weight pi_prox / pi_behav, truncated at
    ``loss.decoupled_is_cap``, is already the token-level TIS against the sampler's (FP8) log-probs.
    Otherwise "auto" is the sampler's log-probs and no cap. With ``rollout.numerics="exact"`` the trainer
    computes through the rollout's precision (FP8 included): no gap."""
    # Exact numerics: the trainer computes through the rollout's precision (FP8 included), so no gap.
    gap = "" if v["rollout.numerics"] == "exact" else precision_gap(
        v["rollout.weight_dtype"], v["rollout.kv_dtype"], v["model.compute_dtype"])
    source, cap, mask = v["loss.old_logprobs"], v["loss.rollout_is_cap"], v["loss.rollout_mask"]
    allowed = v["loss.allow_uncorrected_mismatch"]
    decoupled = _decoupled(v)
    uncorrected = cap is None and mask is None and not allowed and not decoupled
    where = f"the rollout samples with {gap} while the trainer computes in {v['model.compute_dtype']}"
    if gap and cap == AUTO and source == "sampler":
        raise ConfigError(
            f"config.loss.old_logprobs='sampler': {where}; the token-level TIS that corrects it by default "
            "(loss.rollout_is_cap='auto') needs old_logprobs='recompute' (or 'auto'); to train uncorrected "
            "set loss.rollout_is_cap=None and loss.allow_uncorrected_mismatch=True"
        )
    if gap and uncorrected:
        raise ConfigError(
            f"config.loss.rollout_is_cap=None: {where}, and no rollout correction is on; keep one "
            f"(loss.rollout_is_cap='auto' is token-level TIS at C = {MISMATCH_IS_CAP:g}) or set "
            "loss.allow_uncorrected_mismatch=True to train uncorrected"
        )
    if cap == AUTO:
        cap = MISMATCH_IS_CAP if gap and not decoupled else None
    if source == AUTO:
        source = "recompute" if gap else "sampler"
    return {"loss.old_logprobs": source, "loss.rollout_is_cap": None if cap is None else float(cap)}


def rl_rules(v: Mapping[str, Any], stages: Sequence[StageOptions]) -> None:
    """An RL config's rules: selection and batch, the engine, rollouts across an update, the asynchronous
    schedule, the problems."""
    _selection_rules(v, stages)
    _engine_rules(v, stages)
    _rollouts_across_updates(v)
    _asynchronous(v)
    if not v["data.source"] and not stages[0].dataset:
        raise ConfigError("config.data.source is empty and config.stages[0].dataset names no dataset")
