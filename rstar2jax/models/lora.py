"""LoRA (low-rank adaptation) of a decoder's projections: an adapter pytree beside frozen base weights.

A target projection with base weight ``W`` (input axes first, as ``params.py`` lays it out) becomes

    y = x W + s · dropout(x) A B,        s = alpha / rank  (rsLoRA: alpha / sqrt(rank))

with ``A`` ``[*in, rank]`` (uniform in ±1/sqrt(fan_in), PEFT's Kaiming default) and ``B`` ``[rank, *out]``
(zero), so step 0 computes exactly the base model. Adapters are layer-stacked like the base:
``adapters["layers"][name] = {"a": [L, *in, r], "b": [L, r, *out]}``. The base receives no gradient; only the
adapters are trained (and hold optimizer state).

Three ways to use them:

* :func:`attach`: the params tree the training forward runs: the base with ``layers["lora"]`` holding the
  adapters (``B`` pre-multiplied by ``s``) — ``transformer`` adds the low-rank path ``(x A)(s B)`` to each
  target's output (never forming ``A B``), so the backward pass computes no ``[in, out]`` weight gradient.
  With exact numerics (``attach(..., merge_in_forward=True)``) the forward instead merges each layer's
  adapters into its weights as :func:`merge` does (:func:`merge_layer`), so the trainer computes with the
  very weights the engine samples from, one layer's merged weights at a time;
* :func:`merge`: ``W + s A B`` as a plain params tree, what the engine samples from and what is exported;
* :mod:`rstar2jax.models.peft_adapter`: PEFT's folder format (``adapter_config.json``,
  ``adapter_model.safetensors``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from rstar2jax.models.config import ModelConfig
from rstar2jax.models.hf_checkpoint import _LAYER_TENSORS
from rstar2jax.models.params import ParamSpec, is_param_spec, param_specs
from rstar2jax.models.sharding import LOGICAL_RULES, logical_sharding

#: Projections LoRA can adapt, by their names in the params tree (and in PEFT's ``target_modules``).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: How many leading axes (after the layer axis) of each target's weight are its input axes.
_INPUT_AXES = {leaf: in_axes for leaf, _, in_axes in _LAYER_TENSORS if leaf in LORA_TARGETS}
#: Logical axis of the adapters' rank dimension: replicated (``r`` is small).
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA options; hashable (a ``jax.jit`` static argument).

    Attributes:
      rank: r, the inner dimension of each ``A B`` (> 0; at most the smaller side of every target matrix).
      alpha: the scale numerator: the low-rank path is multiplied by ``alpha / rank`` (``alpha / sqrt(rank)``
        with ``rslora``).
      targets: which projections get adapters (any of :data:`LORA_TARGETS`; default all seven).
      dropout: dropout rate on the adapters' input (PEFT's ``lora_dropout``; training only).
      rslora: rank-stabilised scaling (PEFT's ``use_rslora``).
      dtype: dtype the adapters are stored and trained in (the base may be bfloat16).
    """

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0
    rslora: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora rank={self.rank!r}: must be a positive integer")
        if not self.targets:
            raise ValueError("lora targets: name at least one projection")
        if unknown := [t for t in self.targets if t not in LORA_TARGETS]:
            raise ValueError(f"lora target {unknown[0]!r}: not a projection of the model; expected any of "
                             f"{LORA_TARGETS}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora targets {self.targets}: a projection is named twice")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout={self.dropout}: must be in [0, 1)")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha={self.alpha}: must be positive")

    @property
    def scale(self) -> float:
        """``s``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def check_lora(config: ModelConfig, lora: LoraConfig) -> None:
    """Raises ValueError naming the first target whose matrix is smaller than ``lora.rank`` on a side, or
    dropout with exact numerics (the exact forward merges the adapters into the weights, as the engine
    samples from them: a dropout mask cannot be merged)."""
    if config.numerics == "exact" and lora.dropout > 0:
        raise ValueError(f"lora dropout={lora.dropout} with numerics='exact': the exact forward runs the "
                         "merged W + s A B, into which no dropout mask merges; use dropout=0")
    layers = param_specs(config)["layers"]
    for name in lora.targets:
        fan_in, fan_out = _fans(layers[name], name)
        if lora.rank > min(fan_in, fan_out):
            raise ValueError(
                f"lora rank={lora.rank} is larger than {name}'s {fan_in} x {fan_out} matrix "
                f"(at most {min(fan_in, fan_out)})"
            )


def _fans(spec: ParamSpec, name: str) -> tuple[int, int]:
    split = 1 + _INPUT_AXES[name]
    return math.prod(spec.shape[1:split]), math.prod(spec.shape[split:])


def lora_specs(config: ModelConfig, lora: LoraConfig) -> dict:
    """The adapter tree of ``(config, lora)`` with a ``ParamSpec`` at each leaf: ``a`` keeps its base weight's
    input axes (sharded as they are), ``b`` its output axes; the rank axis is replicated."""
    check_lora(config, lora)
    layers = param_specs(config)["layers"]
    tree = {}
    for name in lora.targets:
        spec, split = layers[name], 1 + _INPUT_AXES[name]
        tree[name] = {
            "a": ParamSpec((*spec.shape[:split], lora.rank), (*spec.axes[:split], RANK_AXIS), "lora_a"),
            "b": ParamSpec((spec.shape[0], lora.rank, *spec.shape[split:]),
                           (spec.axes[0], RANK_AXIS, *spec.axes[split:]), "zeros"),
        }
    return {"layers": tree}


_RULES = (*LOGICAL_RULES, (RANK_AXIS, None))


def lora_shardings(config: ModelConfig, lora: LoraConfig, mesh: jax.sharding.Mesh) -> dict:
    """``NamedSharding`` of every adapter leaf: like its base matrix on the shared axes, rank replicated."""
    return jax.tree.map(
        lambda spec: logical_sharding(spec.axes, mesh, spec.shape, _RULES),
        lora_specs(config, lora),
        is_leaf=is_param_spec,
    )


def init_lora(config: ModelConfig, lora: LoraConfig, key: jax.Array, *,
              mesh: jax.sharding.Mesh | None = None) -> dict:
    """Fresh adapters in ``lora.dtype``: ``A`` uniform in ±1/sqrt(fan_in), ``B`` zero (so the adapted model
    starts equal to the base). With ``mesh``, each leaf is made in its :func:`lora_shardings` placement."""
    specs = lora_specs(config, lora)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param_spec)

    def make(key):
        made = []
        for leaf_key, spec in zip(jax.random.split(key, len(leaves)), leaves, strict=True):
            if spec.init == "zeros":
                made.append(jnp.zeros(spec.shape, lora.dtype))
                continue
            bound = 1.0 / math.sqrt(math.prod(spec.shape[1:-1]))  # fan_in: A's input axes
            a = jax.random.uniform(leaf_key, spec.shape, jnp.float32, -bound, bound)
            made.append(a.astype(lora.dtype))
        return jax.tree.unflatten(treedef, made)

    # One program for the whole (small) tree; the base's init_params makes one leaf at a time instead.
    shardings = None if mesh is None else lora_shardings(config, lora, mesh)
    return jax.jit(make, out_shardings=shardings)(key)


def check_adapters(adapters: dict, config: ModelConfig, lora: LoraConfig) -> None:
    """Raises ValueError naming the first adapter leaf missing, extra or of the wrong shape."""
    expected = lora_specs(config, lora)["layers"]
    given = adapters.get("layers", {}) if isinstance(adapters, dict) else {}
    if sorted(given) != sorted(expected):
        raise ValueError(f"adapters hold {sorted(given)}, the LoRA config targets {sorted(expected)}")
    for name, pair in expected.items():
        for part, spec in pair.items():
            shape = tuple(given[name][part].shape) if part in given[name] else None
            if shape != spec.shape:
                raise ValueError(f"adapter {name}.{part} has shape {shape}, expected {spec.shape}")


def attach(params: dict, adapters: dict, lora: LoraConfig, *, dropout_key: jax.Array | None = None,
           merge_in_forward: bool = False) -> dict:
    """The params tree the training forward runs: ``params`` with ``layers["lora"]`` = the adapters, each
    ``b`` multiplied by :attr:`LoraConfig.scale` (inside the caller's differentiation, so ``adapters``'
    gradient is exact). ``dropout_key`` (training with ``lora.dropout`` > 0) adds per-layer dropout keys.

    ``merge_in_forward`` (exact numerics): the adapters as they are, with the scale per layer
    (``layers["lora"]["merge_scale"]``), for the exact forward to merge layer by layer (:func:`merge_layer`);
    no dropout."""
    layers = adapters["layers"]
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if merge_in_forward:
        if dropout_key is not None and lora.dropout > 0:
            raise ValueError(f"lora dropout={lora.dropout}: adapters merged in the forward take no dropout")
        return {**params, "layers": {**params["layers"], "lora": {
            **layers, "merge_scale": jnp.full((num_layers,), lora.scale, jnp.float32)}}}
    lora_tree = {name: {"a": pair["a"], "b": pair["b"] * lora.scale} for name, pair in layers.items()}
    if dropout_key is not None and lora.dropout > 0:
        # Integers, so the layer's cast to the compute dtype leaves them alone: the keys and P(keep) * 2^32.
        lora_tree["dropout"] = {
            "key": jax.random.key_data(jax.random.split(dropout_key, num_layers)),
            "keep_below": jnp.full((num_layers,), int((1 - lora.dropout) * 2**32), jnp.uint32),
        }
    return {**params, "layers": {**params["layers"], "lora": lora_tree}}


def merge_layer(layer: dict, dtype) -> dict:
    """One layer's params tree (of :func:`attach` with ``merge_in_forward``) with each adapted weight replaced
    by ``W + s A B`` in ``dtype``, computed as :func:`merge` computes it (hence the same bits), and the
    adapters dropped; a layer without adapters as it is."""
    if "lora" not in layer:
        return layer
    adapters = dict(layer["lora"])
    if "merge_scale" not in adapters:
        raise ValueError("exact numerics merge the adapters into the weights: attach them with "
                         "merge_in_forward=True")
    scale = adapters.pop("merge_scale")
    merged = {name: value for name, value in layer.items() if name != "lora"}
    for name, pair in adapters.items():
        # A layer axis of one: the very program merge runs over every layer at once.
        merged[name] = _merge_one(layer[name][None], pair["a"][None], pair["b"][None], scale, dtype)[0]
    return merged


def _delta_specs(spec: str) -> tuple[str, str]:
    """For a projection einsum ``"x,w->y"`` whose weight puts its contracted (input) axes first, the einsums
    of ``x A`` (``[..., r]``) and ``(x A) B``."""
    inputs, out = spec.split("->")
    x_sub, w_sub = inputs.split(",")
    if "r" in spec:
        raise ValueError(f"projection einsum {spec!r} already uses the rank letter 'r'")
    contracted = "".join(c for c in w_sub if c in x_sub)
    if not w_sub.startswith(contracted):
        raise ValueError(f"projection einsum {spec!r}: the weight's input axes must come first")
    kept = "".join(c for c in x_sub if c not in contracted)
    return f"{x_sub},{contracted}r->{kept}r", f"{kept}r,r{w_sub[len(contracted):]}->{out}"


def lora_delta(x: jax.Array, lora_tree: dict, name: str, spec: str, chunk_index=None) -> jax.Array | None:
    """The low-rank path ``dropout(x) A (s B)`` of projection ``name`` (einsum ``spec`` with the base
    weight), or None when ``lora_tree`` (a layer's ``layers["lora"]``, see :func:`attach`) has no adapter
    for it. ``chunk_index`` (an MLP chunk's index) varies the dropout mask between calls of one layer."""
    if "merge_scale" in lora_tree:
        raise ValueError("adapters attached with merge_in_forward run in a numerics='exact' forward only")
    pair = lora_tree.get(name)
    if pair is None:
        return None
    if "dropout" in lora_tree:
        drop = lora_tree["dropout"]
        key = jax.random.fold_in(jax.random.wrap_key_data(drop["key"]), LORA_TARGETS.index(name))
        if chunk_index is not None:
            key = jax.random.fold_in(key, chunk_index)
        keep = jax.random.bits(key, x.shape, jnp.uint32) < drop["keep_below"]
        x = jnp.where(keep, x * (2.0**32 / drop["keep_below"].astype(jnp.float32)).astype(x.dtype), 0)
    down, up = _delta_specs(spec)
    return jnp.einsum(up, jnp.einsum(down, x, pair["a"]), pair["b"])


def _merge_one(weight, a, b, scale, dtype):
    """``W + s A B`` in float32, stored as ``dtype``; A B over the rank axis, layer by layer."""
    layers, rank = a.shape[0], a.shape[-1]
    product = jnp.einsum("lir,lro->lio", a.reshape(layers, -1, rank).astype(jnp.float32),
                         b.reshape(layers, rank, -1).astype(jnp.float32))
    return (weight.astype(jnp.float32) + scale * product.reshape(weight.shape)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("lora", "dtype"))
def merge(params: dict, adapters: dict, lora: LoraConfig, dtype: str | None = None) -> dict:
    """A plain params tree with every target weight replaced by ``W + s A B`` (float32 arithmetic), the
    others as they are; every leaf cast to ``dtype`` when given (e.g. the engine's compute dtype, so it
    makes no second cast), else the merged weights keep ``W``'s dtype. The inputs are not changed."""
    layers = dict(params["layers"])
    for name, pair in adapters["layers"].items():
        layers[name] = _merge_one(layers[name], pair["a"], pair["b"], lora.scale, dtype or layers[name].dtype)
    merged = {**params, "layers": layers}
    return merged if dtype is None else jax.tree.map(lambda p: p.astype(dtype), merged)


def adapter_parameter_count(config: ModelConfig, lora: LoraConfig) -> int:
    """Trainable parameters of the adapters."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(lora_specs(config, lora), is_leaf=is_param_spec))
