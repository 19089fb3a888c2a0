"""A run's configuration: the field tables (``schema``, ``schema_rl``: every field's default, check and
meaning), the values a field may take (``vocabulary``), the rules between fields (``rules``), the one parser
(``rstar2jax.config.parse.parse``, also ``rstar2jax.train.parse``: a launcher's ConfigDict -> a frozen
:class:`RunOptions`), the typed options (``options``; the algorithm's :class:`RLIterationConfig` and
:class:`RLLossConfig` in ``algorithm``), field help and the launchers' ``ml_collections`` configs
(``config``).

Layering: ``config`` sits above ``algo``, ``models``, ``engine`` and ``data`` (it builds their typed configs)
and below the schedules, the policy loader and the trainer, which read the options it builds. Importing it
starts nothing and loads no JAX: names load on use.
"""

import importlib

_NAMES = {
    "rstar2jax.config.algorithm": ["RLIterationConfig", "RLLossConfig"],
    "rstar2jax.config.checks": ["Check", "Field"],
    "rstar2jax.config.config": ["rl_config", "sft_config", "stage"],
    "rstar2jax.config.field_help": ["FIELD_HELP", "field_help"],
    "rstar2jax.config.options": [
        "ConfigError", "ModelSource", "OptimizerOptions", "PolicyOptions", "RunOptions", "StageOptions",
    ],  # fmt: skip
    "rstar2jax.config.parse_model": ["policy_options"],
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_MODULE_OF[name])
    for attr in _NAMES[_MODULE_OF[name]]:  # the module's other names too: one import, one lookup
        globals()[attr] = getattr(module, attr)
    return globals()[name]


def __dir__():
    return __all__
