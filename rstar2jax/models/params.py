"""The parameter tree of a decoder: shapes, logical sharding axes and initialisers of every leaf.

Parameters are layer-stacked: every leaf under ``params["layers"]`` has a leading ``[num_layers]`` axis.
Weight layouts put the contraction (input) axes first (``q_proj``: ``[layers, embed, heads, head_dim]``,
``o_proj``: ``[layers, heads, head_dim, embed]``) so each projection is one einsum without transposes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from rstar2jax.models.config import ModelConfig

INIT_STDDEV = 0.02  # transformers' default ``initializer_range`` for these architectures


class ParamSpec(NamedTuple):
    """Shape, logical axis names and initialiser ("normal" | "ones" | "zeros") of one parameter leaf."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str


def param_specs(config: ModelConfig) -> dict:
    """The parameter tree of ``config`` with a :class:`ParamSpec` at each leaf (the one source of truth for
    shapes, sharding axes and initialisation)."""
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    H, K, Dh, V = config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
    layers = {
        "attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "q_proj": ParamSpec((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), "normal"),
        "k_proj": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "v_proj": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "o_proj": ParamSpec((L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "gate_proj": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "up_proj": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "down_proj": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
    }
    if config.qkv_bias:
        layers["q_bias"] = ParamSpec((L, H, Dh), ("layers", "heads", "head_dim"), "zeros")
        layers["k_bias"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["v_bias"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
    if config.qk_norm:
        layers["q_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("norm",), "ones"),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return specs


def is_param_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_logical_axes(config: ModelConfig) -> dict:
    """Same tree as the params, with a tuple of logical axis names at each leaf."""
    return jax.tree.map(lambda spec: spec.axes, param_specs(config), is_leaf=is_param_spec)
