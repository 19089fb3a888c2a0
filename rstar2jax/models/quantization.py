"""FP8 weights for decoding: float8_e4m3fn values with 128 x 128 block scales, and the matmuls that use them.

A weight ``W`` ``[*lead, *in, *out]`` (``lead``: the layer axis of stacked weights; ``in``: the axes a
projection contracts, which ``models.params`` puts first; ``out``: the rest) is a matrix ``[IN, OUT]`` per
lead index, quantized in ``b x b`` blocks (``b`` = 128 by default, as DeepSeek-V3 and verl do)::

    s_ij = max |W_block(i, j)| / 448        (float32 scales [*lead, IN / b, OUT / b])
    Q    = round_e4m3(W / s)                (float8_e4m3fn, W's shape)       W^ = Q s

e4m3 rounds to nearest with 3 mantissa bits above its normal floor 2^-6 and in steps of 2^-9 below it, and
``|W / s| <= 448`` never saturates, so every element obeys ``|W^ - W| <= max(2^-4 |W|, 2^-10 s)``
(:func:`error_bound`).

A projection ``y = x W`` (``x`` ``[M, IN]``) runs one of two ways (:class:`Fp8Weight` ``native``):

* reference (any backend): ``y = x dequantize(W)`` in ``x``'s dtype;
* native (backends with FP8 matmuls, ``models.platform.fp8_matmul_native``): ``x`` is quantized per 1 x b
  group along ``IN`` too (``s^x_mk = max |x_m, group k| / 448``), and
  ``y_mn = sum_k s^x_mk s_k,n/b (Qx_m,k . Q_k,n)``: a float8 dot batched over the ``IN / b`` groups,
  accumulated in float32, then scaled and summed. It differs from the reference by at most
  ``sum_i (2^-4 |x_i| + 2^-10 s^x) |W^_in|``.

The trainer's weights are never touched: :func:`quantize_params` builds the engine's own copy.

FP8 KV pages (``engine.paged_attention``) hold each key or value vector as float8 with a power-of-two scale
(:func:`quantize_kv`, read back by :func:`dequantize_kv`).

An exact model (``ModelConfig.numerics="exact"``) whose rollout samples in FP8
(``ModelConfig.rollout_precision``) trains through the same quantized path: the trainer quantizes each
layer's weights as the engine's copy is quantized (:func:`straight_through_layer`: the same
:func:`quantize_weight` of the same values, multiplied by the same :func:`einsum`), its head
(:func:`straight_through_weight`) and its keys and values (:func:`straight_through_kv`). The forward is the
quantized computation itself, bit for bit; the gradient is the unquantized product's against the dequantized
weight, passed straight through the rounding to the trainer's weights and activations (a ``jax.custom_vjp``:
``w + stop_gradient(q - w)`` would not be ``q`` bit for bit).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.models import platform
from rstar2jax.models.config import FP8, ModelConfig, RolloutPrecision
from rstar2jax.models.params import param_specs

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_RELATIVE_ERROR = 2.0**-4  # half a unit in the last place of a 3-bit mantissa, relative
FP8_SUBNORMAL_ERROR = 2.0**-10  # half the subnormal step 2^-9, in units of the scale
DEFAULT_BLOCK = 128
KV_SCALE_DTYPE = jnp.bfloat16  # powers of two: exact in bfloat16

#: The projections an FP8 engine quantizes, with how many axes (after the layer axis) each contracts.
LINEAR_WEIGHTS: Mapping[str, int] = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1,
                                     "up_proj": 1, "down_proj": 1}


@flax.struct.dataclass
class Fp8Weight:
    """A block-quantized weight (module docstring).

    Attributes:
      values: float8_e4m3fn, the weight's shape ``[*lead, *in, *out]``.
      scales: float32 ``[*lead, IN / block, OUT / block]``.
      in_axes, out_axes: how many axes of ``values`` (after the lead axes) a matmul contracts and keeps.
      block: the block edge ``b``.
      native: multiply in float8 (activations quantized per 1 x b group) rather than dequantize first.
    """

    values: jax.Array
    scales: jax.Array
    in_axes: int = flax.struct.field(pytree_node=False, default=1)
    out_axes: int = flax.struct.field(pytree_node=False, default=1)
    block: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)
    native: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def lead_axes(self) -> int:
        return self.values.ndim - self.in_axes - self.out_axes

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(IN, OUT): the weight as the matrix a matmul multiplies."""
        dims = self.values.shape[self.lead_axes:]
        return math.prod(dims[: self.in_axes]), math.prod(dims[self.in_axes:])


def is_fp8_weight(x) -> bool:
    return isinstance(x, Fp8Weight)


def error_bound(x: jax.Array, scale) -> jax.Array:
    """The largest ``|dequantize(quantize(x)) - x|`` e4m3 allows for elements ``x`` quantized with ``scale``
    (broadcast against ``x``): ``max(2^-4 |x|, 2^-10 scale)``."""
    return jnp.maximum(FP8_RELATIVE_ERROR * jnp.abs(x), FP8_SUBNORMAL_ERROR * scale)


def to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``round_e4m3(x / scale)``; ``x / scale`` is clipped to +-448 first (float32 rounding of the scale can
    put an element a hair past it, and e4m3fn has no infinity: it would become NaN)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def _block_view(x: jax.Array, lead: int, in_axes: int, block: int) -> jax.Array:
    """``x`` ``[*lead, *in, *out]`` as ``[*lead, IN / b, b, OUT / b, b]``."""
    lead_shape = x.shape[:lead]
    rows, cols = math.prod(x.shape[lead:lead + in_axes]), math.prod(x.shape[lead + in_axes:])
    return x.reshape(*lead_shape, rows // block, block, cols // block, block)


def check_block(name: str, shape: tuple[int, ...], in_axes: int, block: int) -> None:
    """Raise ValueError naming ``name`` when ``block`` does not divide both sides of its matrix view."""
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"the FP8 weight block must be a positive int, got {block!r}")
    rows, cols = math.prod(shape[:in_axes]), math.prod(shape[in_axes:])
    if rows % block or cols % block:
        raise ValueError(f"FP8 weight block {block} does not divide weight {name} {tuple(shape)} "
                         f"(a {rows} x {cols} matrix); choose a block that divides both sides")


def quantize_weight(w: jax.Array, *, in_axes: int, lead: int = 0, block: int = DEFAULT_BLOCK,
                    native: bool = False) -> Fp8Weight:
    """``w`` ``[*lead, *in, *out]`` quantized in ``block x block`` blocks (module docstring). Blocks of
    zeros get scale 1."""
    check_block("w", w.shape[lead:], in_axes, block)
    view = _block_view(w.astype(jnp.float32), lead, in_axes, block)
    amax = jnp.max(jnp.abs(view), axis=(-3, -1))  # [*lead, IN / b, OUT / b]
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = to_fp8(view, scales[..., :, None, :, None]).reshape(w.shape)
    return Fp8Weight(values, scales, in_axes=in_axes, out_axes=w.ndim - lead - in_axes, block=block,
                     native=native)


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """``Q s`` in ``dtype``, ``w``'s shape."""
    view = _block_view(w.values, w.lead_axes, w.in_axes, w.block).astype(jnp.float32)
    return (view * w.scales[..., :, None, :, None]).reshape(w.shape).astype(dtype)


def quantize_groups(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Activations ``x`` ``[M, IN]`` quantized per 1 x ``block`` group: (float8 ``[M, IN / b, b]``, float32
    scales ``[M, IN / b]``)."""
    groups = x.astype(jnp.float32).reshape(x.shape[0], x.shape[1] // block, block)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return to_fp8(groups, scales[..., None]), scales


def matmul(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """``x`` ``[M, IN]`` times one layer's weight (no lead axes) as a matrix ``[IN, OUT]``: ``[M, OUT]``
    float32, native or reference as ``w.native`` says (module docstring)."""
    if w.lead_axes:
        raise ValueError(f"matmul takes one layer's weight; got values {w.shape} with {w.lead_axes} lead "
                         "axes")
    rows, cols = w.matrix_shape
    if not w.native:
        return jnp.matmul(x, dequantize(w, x.dtype).reshape(rows, cols), preferred_element_type=jnp.float32)
    b = w.block
    xq, x_scales = quantize_groups(x, b)  # [M, KB, b], [M, KB]
    wq = w.values.reshape(rows // b, b, cols)  # [KB, b, OUT]
    partial = jax.lax.dot_general(xq, wq, (((2,), (1,)), ((1,), (0,))),
                                  preferred_element_type=jnp.float32)  # [KB, M, OUT]
    partial = partial.reshape(rows // b, x.shape[0], cols // b, b) * w.scales[:, None, :, None]
    return jnp.einsum("kmnb,mk->mnb", partial, x_scales).reshape(x.shape[0], cols)


def einsum(spec: str, x: jax.Array, w, *, preferred_element_type=None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a plain ``w``; for an :class:`Fp8Weight` the same product through
    :func:`matmul`: ``spec``'s weight subscripts must list the contracted axes first (``"btd,dhk->bthk"``,
    ``"bthk,hkd->btd"``); for a :class:`StraightThroughFp8` its quantized copy's product, with the gradient
    straight through to its weight. The result has ``x``'s dtype, or ``preferred_element_type``."""
    if isinstance(w, StraightThroughFp8):
        return _straight_through_einsum(spec, preferred_element_type, x, w.weight, w.quantized)
    if not isinstance(w, Fp8Weight):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    if not w.native:
        return jnp.einsum(spec, x, dequantize(w, x.dtype), preferred_element_type=preferred_element_type)
    inputs, out = spec.replace(" ", "").split("->")
    x_subs, w_subs = inputs.split(",")
    contracted, kept = w_subs[: w.in_axes], w_subs[w.in_axes:]
    free = "".join(c for c in x_subs if c not in contracted)
    if len(w_subs) != w.values.ndim or w.lead_axes or set(contracted) - set(x_subs) or set(contracted) & set(
            out) or set(kept) & set(x_subs) or sorted(free + kept) != sorted(out):
        raise ValueError(f"einsum {spec!r} does not contract the first {w.in_axes} axes of an FP8 weight of "
                         f"shape {w.shape}")
    # x as [M, IN]: its free axes, then the contracted ones in the weight's order.
    x_t = jnp.einsum(f"{x_subs}->{free}{contracted}", x)
    free_shape = x_t.shape[: len(free)]
    rows, cols = w.matrix_shape
    y = matmul(x_t.reshape(math.prod(free_shape), rows), w)
    y = y.reshape(*free_shape, *w.values.shape[w.in_axes:])
    return jnp.einsum(f"{free}{kept}->{out}", y).astype(preferred_element_type or x.dtype)


def cast_floats(tree, dtype):
    """``tree`` with its floating leaves cast to ``dtype``; FP8 weights and integer leaves as they are."""

    def cast(leaf):
        if isinstance(leaf, Fp8Weight) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return leaf.astype(dtype)

    return jax.tree.map(cast, tree, is_leaf=is_fp8_weight)


def check_weight_blocks(config: ModelConfig, block: int, head: bool = False) -> None:
    """Raise ValueError naming the first weight :func:`quantize_params` would quantize whose matrix view
    ``block`` does not divide (before any array is made)."""
    specs = param_specs(config)
    for name, in_axes in LINEAR_WEIGHTS.items():
        check_block(f"layers/{name}", specs["layers"][name].shape[1:], in_axes, block)
    if head:
        check_block("output head", (config.hidden_size, config.vocab_size), 1, block)


_quantize = jax.jit(quantize_weight, static_argnames=("in_axes", "lead", "block", "native"))
_quantize_transposed = jax.jit(lambda w, block, native: quantize_weight(w.T, in_axes=1, block=block,
                                                                          native=native),
                               static_argnames=("block", "native"))


def quantize_params(params: dict, config: ModelConfig, *, block: int = DEFAULT_BLOCK, head: bool = False,
                    native: bool = False) -> dict:
    """The engine's copy of ``params`` with every projection of :data:`LINEAR_WEIGHTS` an
    :class:`Fp8Weight` (one compiled quantization per weight, so the peak is one weight's temporaries) and,
    with ``head``, the output head too (as ``lm_head`` ``[D, V]``, quantized from the tied embedding's
    transpose when embeddings are tied; the embedding itself stays for the lookup). Other leaves are
    ``params``' own buffers. Stacked (``[L, ...]``) or unstacked (a tuple of per-layer trees) layers."""
    check_weight_blocks(config, block, head)

    def layer(tree, lead):
        return {name: _quantize(w, in_axes=LINEAR_WEIGHTS[name], lead=lead, block=block, native=native)
                if name in LINEAR_WEIGHTS and not isinstance(w, Fp8Weight) else w for name, w in tree.items()}

    layers = params["layers"]
    out = dict(params)
    out["layers"] = (tuple(layer(t, 0) for t in layers) if isinstance(layers, list | tuple)
                     else layer(layers, 1))
    if head and not isinstance(params.get("lm_head"), Fp8Weight):
        out["lm_head"] = (_quantize_transposed(params["embed"], block, native) if config.tie_word_embeddings
                          else _quantize(params["lm_head"], in_axes=1, block=block, native=native))
    return out


def quantized_head(params: dict) -> Fp8Weight | None:
    """The FP8 output head ``[D, V]`` of an engine's weights, or None."""
    head = params.get("lm_head")
    return head if isinstance(head, Fp8Weight) else None


def fp8_weight_bytes(num_elements: int, block: int) -> int:
    """Bytes of a block-quantized weight of ``num_elements``: one per value, a float32 scale per block."""
    return num_elements + 4 * -(-num_elements // (block * block))


def fp8_matmul_is_native(fp8_matmul: str) -> bool:
    """Whether FP8 weights multiply in float8 under ``fp8_matmul`` (``EngineConfig.fp8_matmul``): "native",
    or "auto" where the backend has FP8 matmuls (``platform.fp8_matmul_native``)."""
    return fp8_matmul == "native" or (fp8_matmul == "auto" and platform.fp8_matmul_native())


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys or values ``[..., Dh]`` as float8_e4m3fn with a power-of-two scale per vector
    (``engine.paged_attention``'s module docstring): (values, ``KV_SCALE_DTYPE`` scales ``[...]``)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    _, exponent = jnp.frexp(amax / 448.0)  # amax / 448 = m 2^e with m in [0.5, 1): 2^e covers it (0 -> 1)
    scale = jnp.ldexp(jnp.float32(1.0), jnp.clip(exponent, -126, 127))
    return to_fp8(x, scale[..., None]), scale.astype(KV_SCALE_DTYPE)


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """:func:`quantize_kv`'s vectors back in ``dtype``: ``q s``, exact in float32 and bfloat16 (a 3-bit
    mantissa times a power of two). What exact attention reads from FP8 pages and the exact trainer attends
    to, so both see the same keys and values."""
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


@flax.struct.dataclass
class StraightThroughFp8:
    """A trainer's weight that multiplies as an FP8 engine's copy of it (:func:`straight_through_layer`):
    :func:`einsum` runs ``quantized``'s product (native or reference, as the engine does) and differentiates
    it as the product with ``dequantize(quantized)``, the weight's gradient going to ``weight``.

    Attributes:
      weight: the trainer's weight, in the compute dtype.
      quantized: :func:`quantize_weight` of it (not differentiated).
    """

    weight: jax.Array
    quantized: Fp8Weight


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _straight_through_einsum(spec, preferred, x, weight, quantized):
    del weight  # the forward is the quantized product; the weight gets its gradient
    return einsum(spec, x, quantized, preferred_element_type=preferred)


def _straight_through_einsum_fwd(spec, preferred, x, weight, quantized):
    return _straight_through_einsum(spec, preferred, x, weight, quantized), (x, weight, quantized)


def _straight_through_einsum_bwd(spec, preferred, residuals, cotangent):
    x, weight, quantized = residuals
    plain = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=preferred)
    _, vjp = jax.vjp(plain, x, dequantize(quantized, x.dtype))
    d_x, d_w = vjp(cotangent)
    return d_x, d_w.astype(weight.dtype), jax.tree.map(jnp.zeros_like, quantized)


_straight_through_einsum.defvjp(_straight_through_einsum_fwd, _straight_through_einsum_bwd)


def straight_through_layer(layer: dict, precision: RolloutPrecision) -> dict:
    """One layer's weights (no lead axes, in the compute dtype, as an exact trainer multiplies them) with
    every projection of :data:`LINEAR_WEIGHTS` a :class:`StraightThroughFp8` quantized as
    :func:`quantize_params` quantizes the engine's copy, when ``precision`` has FP8 weights; the layer as it
    is otherwise. Weights already FP8 (an engine's) stay as they are; LoRA adapters are merged first
    (``models.lora.merge_layer``), so the merged weight is quantized, as the engine's merged copy is."""
    if precision.weight_dtype != FP8:
        return layer
    native = fp8_matmul_is_native(precision.fp8_matmul)

    def quantized(name, w):
        check_block(f"layers/{name}", w.shape, LINEAR_WEIGHTS[name], precision.weight_block)
        q = quantize_weight(jax.lax.stop_gradient(w), in_axes=LINEAR_WEIGHTS[name],
                            block=precision.weight_block, native=native)
        return StraightThroughFp8(w, q)

    return {name: quantized(name, w) if name in LINEAR_WEIGHTS and not isinstance(w, Fp8Weight) else w
            for name, w in layer.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def straight_through_weight(in_axes: int, block: int, w: jax.Array) -> jax.Array:
    """``dequantize(quantize_weight(w))`` in ``w``'s dtype, the gradient passed straight through to ``w``:
    an exact trainer's FP8 output head (the engine multiplies by its dequantized FP8 head)."""
    return dequantize(quantize_weight(w, in_axes=in_axes, block=block), w.dtype)


straight_through_weight.defvjp(lambda in_axes, block, w: (straight_through_weight(in_axes, block, w), None),
                               lambda in_axes, block, _, cotangent: (cotangent,))


@jax.custom_vjp
def _straight_through_fp8_kv(x: jax.Array) -> jax.Array:
    return dequantize_kv(*quantize_kv(x), x.dtype)


_straight_through_fp8_kv.defvjp(lambda x: (_straight_through_fp8_kv(x), None),
                                lambda _, cotangent: (cotangent,))


def straight_through_kv(x: jax.Array, kv_dtype: str | None) -> jax.Array:
    """Keys or values ``[..., Dh]`` as pages of ``kv_dtype`` store them and attention reads them back (FP8:
    :func:`quantize_kv` then :func:`dequantize_kv`; a float dtype: rounded to it; None: as they are), in
    ``x``'s dtype, the gradient straight through."""
    if kv_dtype is None:
        return x
    if kv_dtype == FP8:
        return _straight_through_fp8_kv(x)
    return x.astype(kv_dtype).astype(x.dtype)
