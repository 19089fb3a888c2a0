"""The run config's words: the values a field may take, declared where the config is, so the tables
(``schema``, ``schema_rl``) sit below the code they configure. The trainer, the schedules and the loss import
these tuples from here."""

#: ``rl.schedule``: synchronous (refined by one-step off-policy or partial rollouts) or the asynchronous
#: producer (``rstar2jax.schedules.async_schedule``).
ROLLOUT_SCHEDULES = ("synchronous", "async")
#: ``rl.placement``: where the asynchronous producer's engines run (``rstar2jax.schedules.placement``).
PLACEMENTS = ("colocated", "split")
#: ``rl.off_policy_correction``: "auto" or one of :data:`OFF_POLICY_CORRECTIONS`.
OFF_POLICY_CORRECTION_OPTIONS = ("auto", "none", "decoupled")
#: How the loss corrects for tokens an older policy sampled (``RLLossConfig.off_policy_correction``):
#: "decoupled" is AReaL's objective (``algo.decoupled_policy_loss``); "none" leaves it to the rollout
#: correction fields (TIS / MIS), when set.
OFF_POLICY_CORRECTIONS = ("none", "decoupled")
#: ``rl.loss.old_logprobs``: where the loss's pi_old comes from (``RLLossConfig.old_logprobs``).
OLD_LOGPROB_SOURCES = ("sampler", "recompute")
#: ``rl.offload``: where the optimizer state waits during rollout (``rstar2jax.schedules.colocate``).
OFFLOAD_OPTIONS = ("auto", "host", "device")
#: ``optimizer.schedule``: the learning-rate schedules (``rstar2jax.train.state.learning_rate_schedule``).
SCHEDULES = ("constant", "cosine")
