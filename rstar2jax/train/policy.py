"""The old home of a run's policy helpers, kept for the path the README documents: export is
``train.export``, rollouts ``train.rollouts``, loading ``train.loader``, evaluation ``rstar2jax.eval``."""

from rstar2jax.train.export import export_policy as export_policy  # noqa: F401 (the documented old path)
