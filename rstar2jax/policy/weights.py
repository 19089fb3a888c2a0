"""A policy's weights in and out of folders: a run's initial parameters (:func:`initial_params`: an HF folder
or random weights), an HF folder written atomically (:func:`save_policy`) and where a run folder keeps its
checkpoints (:data:`CHECKPOINT_DIR`)."""

from __future__ import annotations

import pathlib
import shutil

import jax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.config.options import ModelSource


def initial_params(source: ModelSource, model_config: models.ModelConfig, mesh: Mesh | None):
    """Pretrained weights from ``source.path``, else random weights of ``model_config`` (seeded by
    ``source.seed``)."""
    if source.path:
        _, params = models.load_pretrained(
            source.path,
            dtype=model_config.param_dtype,
            compute_dtype=model_config.compute_dtype,
            mesh=mesh,
            remat_policy=model_config.remat_policy,
            scan_layers=model_config.scan_layers,
            attention=model_config.attention,
            attention_block_size=model_config.attention_block_size,
            mlp_chunk_size=model_config.mlp_chunk_size,
        )
        return params
    return models.init_params(model_config, jax.random.PRNGKey(source.seed), mesh=mesh)


#: Checkpoint step folders go to ``<workdir>/CHECKPOINT_DIR``.
CHECKPOINT_DIR = "checkpoints"


def save_policy(
    params, model_config: models.ModelConfig, out: str | pathlib.Path, *, tokenizer=None, prompt=None
):
    """Writes ``params`` as an HF folder at ``out`` (config.json, safetensors and, when given, the tokenizer
    with its chat template and the conversation format ``prompt``, a ``PromptConfig``, as
    ``rstar2jax_prompt.json``): the form ``config.model.path`` reads, so RL can start from it. The folder is
    written beside ``out`` and renamed into place, so a crash never leaves a half policy. With several
    processes the parameters are gathered and process 0 writes. Returns ``out`` as a path."""
    out = pathlib.Path(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return out
    temporary = out.with_name(out.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    models.save_pretrained(params, model_config, temporary, tokenizer=tokenizer, prompt=prompt)
    shutil.rmtree(out, ignore_errors=True)
    temporary.replace(out)
    return out
