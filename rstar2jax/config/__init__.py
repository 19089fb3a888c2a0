"""A run's configuration: the field tables (``schema``, ``schema_rl``: every field's default, check and
meaning), the values a field may take (``vocabulary``), the rules between fields (``rules``), the one parser
(``rstar2jax.config.parse.parse``, also ``rstar2jax.train.parse``: a launcher's ConfigDict -> a frozen
:class:`RunOptions`), the typed options (``options``; the algorithm's :class:`RLIterationConfig` in
``algorithm``, the policy loss's :class:`RLLossConfig` in ``loss_config``), field help and the launchers'
``ml_collections`` configs (``config``); ``lazy``: the loader of the packages' lazy faces.

Layering: ``config`` sits above ``algo``, ``models``, ``engine`` and ``data`` (it builds their typed configs)
and below the schedules, the policy loader and the trainer, which read the options it builds. Importing it
starts nothing and loads no JAX: names load on use.
"""

from rstar2jax.config.lazy import LazyNames

_NAMES = {
    "rstar2jax.config.algorithm": ["RLIterationConfig"],
    "rstar2jax.config.checks": ["Check", "Field"],
    "rstar2jax.config.config": ["rl_config", "sft_config", "stage"],
    "rstar2jax.config.field_help": ["FIELD_HELP", "field_help"],
    "rstar2jax.config.loss_config": ["RLLossConfig"],
    "rstar2jax.config.options": [
        "ConfigError", "ModelSource", "OptimizerOptions", "PolicyOptions", "RunOptions", "StageOptions",
    ],  # fmt: skip
    "rstar2jax.config.parse_model": ["policy_options"],
}
_LAZY = LazyNames(globals(), _NAMES).install()
__all__ = sorted([*_LAZY.names])  # griffe (the API pages) reads a list here
