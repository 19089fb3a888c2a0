"""A policy in and out of folders: what serving, evaluation, chat and the trainer share. Loading one
(:func:`load_policy`: an HF folder, or a training run's folder and its checkpoint), exporting a run's latest
checkpoint as an HF folder (:func:`export_policy`), a LoRA policy's adapters and the record of their base
(``adapters``), and a policy's weights written or made fresh (``weights``).

Layering: ``policy`` sits above ``config`` (a run folder's options are parsed by it) and below the trainer
and the server. Importing it starts nothing: names load on use. Loading an HF folder needs no optimizer and
no checkpoint library; a run folder's checkpoint is read with orbax, imported then.
"""

from rstar2jax.config.lazy import LazyNames

_NAMES = {
    "rstar2jax.policy.adapters": ["adapter_folder", "save_adapter"],
    "rstar2jax.policy.export": ["export_policy", "run_tokenizer"],
    "rstar2jax.policy.loader": ["Policy", "load_policy"],
    "rstar2jax.policy.weights": ["initial_params", "save_policy"],
}
_LAZY = LazyNames(globals(), _NAMES).install()
__all__ = sorted([*_LAZY.names])  # griffe (the API pages) reads a list here
