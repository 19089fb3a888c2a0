"""Decoder-only transformer (Qwen3 / Qwen2 / Llama) as pure functions over a nested-dict parameter pytree.

The layer-stacked params (see ``params.py``) run under one ``jax.lax.scan`` (``config.scan_layers``) or an
unrolled loop over the same tree. Matmuls run in ``config.compute_dtype``; norms, RoPE, softmax and logits in
float32. Attention groups query heads per kv head instead of repeating keys and values.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from rstar2jax.models import exact, exact_kernels
from rstar2jax.models.attention import attention, dense_attention
from rstar2jax.models.config import ModelConfig
from rstar2jax.models.kv_cache import KVCache
from rstar2jax.models.logprobs import token_logprobs_and_entropy
from rstar2jax.models.lora import lora_delta, merge_layer
from rstar2jax.models.params import INIT_STDDEV, is_param_spec, param_specs
from rstar2jax.models.quantization import (
    cast_floats,
    einsum,
    quantized_head,
    straight_through_kv,
    straight_through_layer,
    straight_through_weight,
)
from rstar2jax.models.sharding import cache_shapes, constrain, param_shardings


def _init_leaf(key: jax.Array, shape: tuple[int, ...], init: str, dtype: str) -> jax.Array:
    if init == "normal":
        return (INIT_STDDEV * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jnp.full(shape, 1.0 if init == "ones" else 0.0, dtype)


def init_params(config: ModelConfig, key: jax.Array, *, mesh: jax.sharding.Mesh | None = None) -> dict:
    """Random weights for ``config`` in ``config.param_dtype``: N(0, 0.02) matrices, unit norms, zero biases.

    Leaves are made one at a time, so peak memory is the params plus one leaf's float32 temporaries. With
    ``mesh``, every leaf is created directly in its :func:`param_shardings` placement; the values depend only
    on ``key``, not on the mesh.
    """
    leaves, treedef = jax.tree.flatten(param_specs(config), is_leaf=is_param_spec)
    shardings = [None] * len(leaves) if mesh is None else jax.tree.leaves(param_shardings(config, mesh))
    keys = jax.random.split(key, len(leaves))
    made = [
        jax.jit(_init_leaf, static_argnums=(1, 2, 3), out_shardings=sharding)(
            leaf_key, spec.shape, spec.init, config.param_dtype
        )
        for leaf_key, spec, sharding in zip(keys, leaves, shardings, strict=True)
    ]
    return jax.tree.unflatten(treedef, made)


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies ``theta^(-2i/head_dim)`` ``[head_dim // 2]`` float32, with ``llama3`` scaling:
    wavelengths longer than ``original_max / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max / high_freq_factor`` kept, and the band between interpolated smoothly."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_scaling is not None:
        scaling = dict(config.rope_scaling)
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original_max = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv_freq
        smooth = (original_max / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > original_max / low,
            inv_freq / factor,
            np.where(wavelen < original_max / high, inv_freq, smoothed),
        )
    return inv_freq.astype(np.float32)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis; statistics in float32, result in x.dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x`` ``[B, T, N, Dh]`` with ``cos``/``sin`` ``[B, T, 1, Dh/2]`` (float32 math)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Logical axes of activations (effective only under ``jax.set_mesh``, see ``sharding.constrain``).
_RESIDUAL_AXES = ("batch", "length", "activation_embed")
_HEADS_AXES = ("batch", "length", "heads", "head_dim")
_KV_HEADS_AXES = ("batch", "length", "kv_heads", "head_dim")
_MLP_AXES = ("batch", "length", "mlp")
_LOGITS_AXES = ("batch", "length", "vocab")


def _decoder_layer(config: ModelConfig, x, layer, rope, mask, kv_write):
    """One pre-norm block. ``layer``: this layer's params; ``rope``: (cos, sin); ``mask``: the segment ids
    ``[B, T]`` without a cache (:func:`attention.attention`), the ``[B, T, S]`` bool mask with a
    :class:`KVCache`, None with a paged cache; ``kv_write``: None (no cache), (cache_k, cache_v, layer_index,
    write_index) with the whole cache (:class:`KVCache` layout), or (paged_cache, layer_index) for a cache
    object that writes and attends itself (see :func:`forward`). Returns (x, the updated cache:
    (new_cache_k, new_cache_v), the paged cache object, or None).

    Activations are named for remat policies (``jax.ad_checkpoint.checkpoint_name``): the projections'
    outputs ``query``, ``key``, ``value``, ``attention_out``, ``mlp_gate``, ``mlp_up``, ``mlp_out``, and the
    attention context (softmax-weighted values, before the output projection) ``attention_context``.

    The layer's new keys/values are scattered into the whole cache at ``write_index`` of ``layer_index``:
    threaded through the layer loop as a carry, the cache is then updated in place instead of being sliced
    out and restacked (a full copy of the cache per call)."""
    dtype = x.dtype
    # Integer leaves (LoRA dropout keys) and an engine's FP8 weights (models.quantization) stay as they are.
    layer = cast_floats(layer, dtype)
    eps = config.rms_norm_eps
    cos, sin = rope

    h = _rms_norm(x, layer["attn_norm"], eps)
    q = checkpoint_name(constrain(_project(h, layer, "q_proj", "btd,dhk->bthk"), _HEADS_AXES), "query")
    k = checkpoint_name(constrain(_project(h, layer, "k_proj", "btd,dhk->bthk"), _KV_HEADS_AXES), "key")
    v = checkpoint_name(constrain(_project(h, layer, "v_proj", "btd,dhk->bthk"), _KV_HEADS_AXES), "value")
    if config.qkv_bias:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    if config.qk_norm:
        q, k = _rms_norm(q, layer["q_norm"], eps), _rms_norm(k, layer["k_norm"], eps)
    scale = config.head_dim**-0.5  # folded into the query's rotation: free
    q, k = _apply_rope(q, cos * scale, sin * scale), _apply_rope(k, cos, sin)

    new_kv = None
    if kv_write is not None and len(kv_write) == 2:  # a paged cache writes and attends, masking by position
        attn, new_kv = kv_write[0].write_and_attend(kv_write[1], q, k, v)
    elif kv_write is None:
        attn = attention(
            q, k, v, mask, implementation=config.attention, block_size=config.attention_block_size
        )
    else:
        cache_k, cache_v, layer_index, write_index = kv_write
        rows = jnp.arange(x.shape[0])[:, None]
        # The index arrays (rows, write_index) broadcast to [B, T] and are split by slices, so the updated
        # block is [B, T, K, Dh] in both: k and v as computed.
        cache_k = cache_k.at[layer_index, rows, :, write_index].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[layer_index, rows, :, :, write_index].set(v.astype(cache_v.dtype), mode="drop")
        new_kv = (cache_k, cache_v)
        k, v = cache_k[layer_index].astype(dtype), cache_v[layer_index].astype(dtype)
        attn = dense_attention(q, k, v, mask)
    attn = checkpoint_name(attn, "attention_context")
    out = checkpoint_name(_project(attn, layer, "o_proj", "bthk,hkd->btd"), "attention_out")
    x = constrain(x + out, _RESIDUAL_AXES)

    h = _rms_norm(x, layer["mlp_norm"], eps)
    x = constrain(x + _mlp(config, h, layer), _RESIDUAL_AXES)
    return x, new_kv


def _project(x, layer, name: str, spec: str, chunk_index=None, matmul=einsum):
    """``matmul(spec, x, layer[name])`` (default: ``quantization.einsum``, an FP8 weight through its FP8 path;
    exact numerics may pass ``exact_kernels.einsum``), plus the LoRA path of ``name`` when ``layer`` carries
    adapters (``layer["lora"]``, see ``models.lora.attach``; ``chunk_index``: an MLP chunk's, for dropout)."""
    y = matmul(spec, x, layer[name])
    delta = lora_delta(x, layer["lora"], name, spec, chunk_index) if "lora" in layer else None
    return y if delta is None else y + delta


def _mlp(config: ModelConfig, h, layer, matmul=einsum):
    """SwiGLU MLP (its products by ``matmul``, as :func:`_project` takes it); with ``config.mlp_chunk_size``
    dividing T (< T), over token chunks by ``lax.map``, each chunk rematerialised, so its
    ``[B, T, intermediate]`` activations exist one chunk at a time."""

    def mlp(h, chunk_index=None):
        gate = constrain(_project(h, layer, "gate_proj", "btd,df->btf", chunk_index, matmul), _MLP_AXES)
        up = constrain(_project(h, layer, "up_proj", "btd,df->btf", chunk_index, matmul), _MLP_AXES)
        gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
        out = _project(jax.nn.silu(gate) * up, layer, "down_proj", "btf,fd->btd", chunk_index, matmul)
        return checkpoint_name(out, "mlp_out")

    B, T, D = h.shape
    chunk = config.mlp_chunk_size
    if not chunk or T <= chunk or T % chunk:
        return mlp(h)
    chunks = jnp.swapaxes(h.reshape(B, T // chunk, chunk, D), 0, 1)
    out = jax.lax.map(jax.checkpoint(lambda c: mlp(*c)), (chunks, jnp.arange(T // chunk)))
    return jnp.swapaxes(out, 0, 1).reshape(B, T, D)


_PROJECTIONS = ("query", "key", "value", "attention_out", "mlp_gate", "mlp_up", "mlp_out")
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_projections": jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS),
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_context"),
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _check_inputs(config: ModelConfig, tokens, positions, segment_ids, cache) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    for name, value in (("positions", positions), ("segment_ids", segment_ids)):
        if value is not None and value.shape != tokens.shape:
            raise ValueError(f"{name} shape {value.shape} must equal tokens shape {tokens.shape}")
    if isinstance(cache, KVCache):
        expected = cache_shapes(config, tokens.shape[0], cache.max_len)
        if (cache.k.shape, cache.v.shape) != expected:
            raise ValueError(
                f"cache k/v shapes {cache.k.shape}/{cache.v.shape} do not match {expected[0]}/{expected[1]} "
                "(num_layers, batch, num_kv_heads, max_len, head_dim)/(..., head_dim, max_len)"
            )


@functools.partial(jax.jit, static_argnames=("config",))
def forward(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits of a decoder-only LM.

    Args:
      params: tree from :func:`init_params` / ``load_pretrained``, or with its layers unstacked by
        :func:`unstack_layers` (then the layers run unrolled whatever ``config.scan_layers`` says), or
        with LoRA adapters attached by ``models.lora.attach`` (each adapted projection adds its low-rank
        path).
      config: the model's :class:`ModelConfig` (static).
      tokens: int32 ``[B, T]``; ids outside ``[0, vocab)`` (e.g. a -1 pad) are clipped, so padding can never
        put NaNs into the keys and values that masked attention multiplies by zero.
      positions: int32 ``[B, T]`` RoPE positions; default ``arange(T)`` in every row.
      segment_ids: int32 ``[B, T]``; without a cache a token attends to earlier tokens (by index) of its own
        segment, a contiguous run of one id, so packed sequences stay apart; 0 marks padding (attention:
        ``models.attention``, implementation ``config.attention``). With a cache, tokens of segment 0 are not
        written into it.
      cache: :class:`KVCache`, a paged cache, or None. A paged cache is any pytree with a method
        ``write_and_attend(layer_index, q, k, v) -> (attention output, updated cache)`` (q ``[B, T, H, Dh]``
        scaled, k/v ``[B, T, K, Dh]``) that stores keys/values and masks by position itself, such as
        ``rstar2jax.engine.paged_attention.PagedCacheView`` (carried through the layer loop: ``lax.scan``
        with a traced layer index over stacked params, or unrolled with an int one). With a
        :class:`KVCache` the key/value of token ``(b, t)`` is written at cache index
        ``positions[b, t]`` (indices outside ``[0, max_len)`` are dropped) and the query at position ``p``
        attends to entries ``j <= p`` of its own row: a T>1 chunk is a prefill, T=1 a decode step, and every
        row may sit at its own length.

    Returns:
      (logits float32 ``[B, T, vocab]``, updated cache or None).
    """
    x, new_cache = _trunk(params, config, tokens, positions, segment_ids, cache)
    head, layout = output_head(params, config)
    spec = "btd,vd->btv" if layout == "vd" else "btd,dv->btv"
    logits = einsum(spec, x, head, preferred_element_type=jnp.float32)
    return constrain(logits, _LOGITS_AXES), new_cache


def forward_hidden(params: dict, config: ModelConfig, tokens: jax.Array, *, positions: jax.Array,
                   cache) -> tuple[jax.Array, Any]:
    """The final normed hidden states ``[B, T, D]`` (compute dtype) of :func:`forward` with a ``cache`` and
    the updated cache, without the output head: for a caller that needs logits at a few positions only (the
    generation engine's step, whose prefill tokens need none). Not jitted: it runs inside the caller's
    program."""
    return _trunk(params, config, tokens, positions, None, cache)


def output_head(params: dict, config: ModelConfig) -> tuple[jax.Array, str]:
    """(the output head in ``config.compute_dtype``, its layout): ``lm_head`` ``[D, V]`` ("dv"), or the tied
    embedding ``[V, D]`` ("vd"); an engine's FP8 head (``models.quantization``: ``[D, V]``, "dv") as it is,
    multiplied by ``quantization.einsum``."""
    head = quantized_head(params)
    if head is not None:
        return head, "dv"
    dtype = jnp.dtype(config.compute_dtype)
    if config.tie_word_embeddings:
        return params["embed"].astype(dtype), "vd"
    return params["lm_head"].astype(dtype), "dv"


@functools.partial(jax.jit, static_argnames=("config",))
def hidden_states(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The final normed hidden states ``[B, T, D]`` (compute dtype) that :func:`forward` multiplies by the
    output head; arguments as :func:`forward`'s, without a cache."""
    return _trunk(params, config, tokens, positions, segment_ids, None)[0]


def sequence_logprobs(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    targets: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Per position, ``log softmax(logits / temperature)[targets]`` and the entropy of that softmax (float32
    ``[B, T]`` each), computed from :func:`hidden_states` by ``logprobs.token_logprobs_and_entropy``: no
    ``[B, T, V]`` array in the forward or the backward pass."""
    x = hidden_states(params, config, tokens, positions=positions, segment_ids=segment_ids)
    # The head in its stored dtype: token_logprobs_and_entropy casts it chunk by chunk to x's dtype.
    head, layout = (params["embed"], "vd") if config.tie_word_embeddings else (params["lm_head"], "dv")
    if config.numerics == "exact":
        if config.rollout_precision.quantize_head:  # the FP8 engine's head, [D, V] in the compute dtype
            head = head.astype(x.dtype)
            head = straight_through_weight(1, config.rollout_precision.weight_block,
                                           head.T if layout == "vd" else head)
            layout = "dv"
        logp, entropy = exact_kernels.token_logprobs(x.reshape(-1, x.shape[-1]), head, targets.reshape(-1),
                                                     head_layout=layout, temperature=temperature,
                                                     kernels=exact_kernels.resolve(config))
        return logp.reshape(targets.shape), entropy.reshape(targets.shape)
    return token_logprobs_and_entropy(x, head, targets, temperature=temperature, head_layout=layout)


def _trunk(params, config: ModelConfig, tokens, positions, segment_ids, cache):
    """Embedding, decoder layers and the final norm: (x ``[B, T, D]``, updated cache or None)."""
    _check_inputs(config, tokens, positions, segment_ids, cache)
    B, T = tokens.shape
    dtype = jnp.dtype(config.compute_dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if config.numerics == "exact":
        return _exact_trunk(params, config, tokens, positions, segment_ids, cache)

    angles = positions[..., None, None].astype(jnp.float32) * rope_inverse_frequencies(config)
    rope = (jnp.cos(angles), jnp.sin(angles))

    paged = cache is not None and not isinstance(cache, KVCache)
    if cache is None:
        mask = segment_ids  # attention.attention builds the causal, per-segment structure
    elif paged:
        mask = None
    else:
        mask = jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None]
        writable = positions >= 0 if segment_ids is None else (positions >= 0) & (segment_ids != 0)
        write_index = jnp.where(writable, positions, cache.max_len)  # max_len: out of range, dropped

    def block(x, layer, layer_index, kv):
        kv_write = None if kv is None else (kv, layer_index) if paged else (*kv, layer_index, write_index)
        return _decoder_layer(config, x, layer, rope, mask, kv_write)

    if config.remat_policy != "none":
        block = jax.checkpoint(
            block, policy=_REMAT_POLICIES[config.remat_policy], prevent_cse=not config.scan_layers
        )

    x = constrain(jnp.take(params["embed"], tokens, axis=0, mode="clip").astype(dtype), _RESIDUAL_AXES)
    kv = None if cache is None else cache if paged else (cache.k, cache.v)
    x, kv = _run_layers(params, config, block, x, kv)
    x = _rms_norm(x, params["final_norm"], config.rms_norm_eps)
    new_cache = None if cache is None else kv if paged else KVCache(k=kv[0], v=kv[1])
    return x, new_cache


def _exact_trunk(params, config: ModelConfig, tokens, positions, segment_ids, cache):
    """:func:`_trunk` with exact numerics (``models.exact``): per-token work over fixed row tiles, attention
    by ``exact.attend_tile`` (a paged cache attends itself, as its ``attention`` says); no KVCache. Without a
    cache, the weights, keys and values are rounded as ``config.rollout_precision`` says (FP8: quantized as
    the engine's, gradient straight through; ``models.quantization``)."""
    if isinstance(cache, KVCache):
        raise ValueError("numerics='exact' runs without a cache or with a paged cache, not a KVCache")
    B, T = tokens.shape
    dtype, eps = jnp.dtype(config.compute_dtype), config.rms_norm_eps
    precision = config.rollout_precision
    inverse_frequencies = rope_inverse_frequencies(config)
    # XLA's programs or the Pallas kernels (exact_kernels.resolve: the engine's step and the trainer ask it)
    kernels = exact_kernels.resolve(config)
    matmul = einsum if kernels == "xla" else exact_kernels.einsum
    tiled_rows = functools.partial(exact.tiled_rows, tile=exact_kernels.tile_rows(kernels))

    def pre_attention(layer, x, pos, matmul=matmul):  # x [R, D], pos [R] -> q (scaled), k, v [R, heads, Dh]
        h = _rms_norm(x, layer["attn_norm"], eps)[None]
        q, k, v = (_project(h, layer, f"{name}_proj", "btd,dhk->bthk", matmul=matmul) for name in "qkv")
        if config.qkv_bias:
            q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
        if config.qk_norm:
            q, k = _rms_norm(q, layer["q_norm"], eps), _rms_norm(k, layer["k_norm"], eps)
        angles = pos[None, :, None, None].astype(jnp.float32) * inverse_frequencies
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        scale = config.head_dim**-0.5
        return _apply_rope(q, cos * scale, sin * scale)[0], _apply_rope(k, cos, sin)[0], v[0]

    def post_attention(layer, x, attn, matmul=matmul):  # a tile: x [R, D], attn [R, H, Dh] -> x [R, D]
        x = x + _project(attn[None], layer, "o_proj", "bthk,hkd->btd", matmul=matmul)[0]
        return x + _mlp(config, _rms_norm(x, layer["mlp_norm"], eps)[None], layer, matmul)[0]

    def block(x, layer, layer_index, kv):
        layer = cast_floats(merge_layer(layer, dtype), dtype)  # LoRA: merged from the uncast weights
        layer = straight_through_layer(layer, precision)  # an FP8 rollout's weights (models.quantization)
        q, k, v = tiled_rows(pre_attention, x, positions.reshape(-1), consts=(layer,),
                             backward=functools.partial(pre_attention, matmul=einsum))
        if kv is None:  # the keys and values as the rollout's pages hold them
            k, v = straight_through_kv(k, precision.kv_dtype), straight_through_kv(v, precision.kv_dtype)
            shaped = [a.reshape(B, T, *a.shape[1:]) for a in (q, k, v)]
            attn = exact_kernels.packed_attention(*shaped, segment_ids, kernels).reshape(q.shape)
        else:
            attn, kv = kv.write_and_attend(layer_index, q[None], k[None], v[None])
            attn = attn[0]
        return tiled_rows(post_attention, x, attn, consts=(layer,),
                          backward=functools.partial(post_attention, matmul=einsum)), kv

    if config.remat_policy != "none":
        block = jax.checkpoint(block, policy=_REMAT_POLICIES[config.remat_policy])
    x = jnp.take(params["embed"], tokens.reshape(-1), axis=0, mode="clip").astype(dtype)
    x, cache = _run_layers(params, config, block, x, cache)
    x = tiled_rows(lambda norm, x: _rms_norm(x, norm, eps), x, consts=(params["final_norm"],))
    return x.reshape(B, T, -1), cache


def _run_layers(params, config: ModelConfig, block, x, kv):
    """(x, kv) after ``block(x, layer, layer_index, kv)`` over the layers: scanned, or unrolled."""
    unstacked = layers_are_unstacked(params)  # one buffer per layer
    if unstacked and len(params["layers"]) != config.num_layers:
        raise ValueError(f"params hold {len(params['layers'])} unstacked layers, the config "
                         f"{config.num_layers}")
    if config.scan_layers and not unstacked:

        def scan_step(carry, layer_inputs):
            x, kv = carry
            layer, layer_index = layer_inputs
            return block(x, layer, layer_index, kv), None

        layer_indices = jnp.arange(config.num_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(scan_step, (x, kv), (params["layers"], layer_indices))
        return x, kv
    layers = params["layers"] if unstacked else _split_layers(params["layers"], config.num_layers)
    for i, layer in enumerate(layers):
        x, kv = block(x, layer, i, kv)
    return x, kv


def _split_layers(stacked, num_layers: int) -> list:
    """The per-layer trees of layer-stacked params, for an unrolled layer loop.

    One split per stacked leaf (its gradient is one concatenate) rather than L slices (whose gradients would
    be L full-size pads summed together: quadratic in the number of layers).
    """
    leaves, treedef = jax.tree.flatten(stacked)
    parts = [jax.lax.split(leaf, [1] * num_layers, axis=0) for leaf in leaves]
    return [jax.tree.unflatten(treedef, [part[i][0] for part in parts]) for i in range(num_layers)]


def layers_are_unstacked(params: dict) -> bool:
    """Whether ``params["layers"]`` is a tuple of per-layer trees (:func:`unstack_layers`), not stacked."""
    return isinstance(params["layers"], list | tuple)


def unstack_layers(params: dict, dtype=None) -> dict:
    """``params`` with ``params["layers"]`` split into a tuple of per-layer trees, one buffer per weight, and
    every weight cast to ``dtype`` if given; :func:`forward` accepts either layout and, with ``dtype`` its
    ``config.compute_dtype`` (it casts every weight to that anyway), computes the same logits.

    For many forwards over the same weights (a decode loop): a matmul that reads a weight through a slice of
    the layer-stacked tree may copy the slice first (XLA:CPU does, for every layer of every step), tripling
    the memory traffic of a small-batch step. Unstacking copies the weights once instead, and casts them once
    rather than per forward. The result holds a second copy of the layer weights.
    """
    if layers_are_unstacked(params):
        raise ValueError("params['layers'] is already unstacked")
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(jax.tree.map(lambda p, i=i: p[i], stacked) for i in range(num_layers))
    return {**params, "layers": layers}


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log softmax(logits)[..., targets]``: float32 ``[B, T]`` from logits ``[B, T, V]`` and int targets.

    The target logit is picked with an iota comparison rather than a gather, so the gradient is an
    elementwise select that fuses with the softmax instead of a scatter into a ``[B, T, V]`` buffer.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on leading dims")
    logits = logits.astype(jnp.float32)
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    picked = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    return picked - jax.nn.logsumexp(logits, axis=-1)
