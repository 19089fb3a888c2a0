"""A policy in and out of folders: what serving, evaluation, chat and the trainer share. Loading one
(:func:`load_policy`: an HF folder, or a training run's folder and its checkpoint), exporting a run's latest
checkpoint as an HF folder (:func:`export_policy`), a LoRA policy's adapters and the record of their base
(``adapters``), and a policy's weights written or made fresh (``weights``).

Layering: ``policy`` sits above ``config`` (a run folder's options are parsed by it) and below the trainer
and the server. Importing it starts nothing: names load on use. Loading an HF folder needs no optimizer and
no checkpoint library; a run folder's checkpoint is read with orbax, imported then.
"""

import importlib

_NAMES = {
    "rstar2jax.policy.adapters": ["adapter_folder", "save_adapter"],
    "rstar2jax.policy.export": ["export_policy", "run_tokenizer"],
    "rstar2jax.policy.loader": ["Policy", "load_policy"],
    "rstar2jax.policy.weights": ["initial_params", "save_policy"],
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
