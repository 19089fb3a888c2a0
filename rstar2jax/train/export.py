"""The old home of a run's policy export, kept for the path the README documents:
``rstar2jax.policy.export``."""

from rstar2jax.policy.export import export_policy as export_policy  # noqa: F401 (the documented old path)
