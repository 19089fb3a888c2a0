"""The old home of a run's policy helpers, kept for the path the README documents: export is
``rstar2jax.policy.export``, loading ``rstar2jax.policy.loader``, rollouts ``train.rollouts``, evaluation
``rstar2jax.eval``."""

from rstar2jax.policy.export import export_policy as export_policy  # noqa: F401 (the documented old path)
