"""The engine's compiled step programs and the weights they run on.

:func:`engine_weights` prepares a caller's weights for an engine (its precision checked, FP8 quantization,
cast, layers split or stacked: :func:`engine_params`); an engine calls it when it is built and at every
weight update (:meth:`~rstar2jax.engine.EngineCore.update_weights`); :func:`check_same_shapes` refuses new
weights the compiled programs do not take.
:class:`ProgramCache` compiles :func:`~rstar2jax.engine.step.step` once per shape: every engine in the process
shares :data:`PROGRAMS`, so a second engine (or a second run in the same process) of equal shapes compiles
nothing. Sharing it is safe because a compiled program is a pure function of its abstract inputs (the key
holds every shape, dtype and sharding) and holds no engine's data; entries are never mutated once compiled,
and a failed compile leaves no entry. Programs compiled ahead run on short-lived threads of their own, one
per program, that end with their compile: nothing is left running for a later run to trip on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import jax

from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.paged_attention import decode_attention
from rstar2jax.engine.state import engine_model_config
from rstar2jax.engine.step import compile_step
from rstar2jax.models import ModelConfig, layers_are_unstacked, platform, unstack_layers
from rstar2jax.models.config import FP8, RolloutPrecision
from rstar2jax.models.quantization import (
    DEFAULT_BLOCK,
    cast_floats,
    check_weight_blocks,
    fp8_matmul_is_native,
    is_fp8_weight,
    quantize_params,
)

__all__ = ["PROGRAMS", "UNROLL_MAX_LAYERS", "ProgramCache", "abstract_shapes", "check_precision",
           "check_same_shapes", "engine_params", "engine_weights"]

logger = logging.getLogger(__name__)

#: Layer count up to which ``EngineConfig.unstacked_decode=None`` unrolls the layers on CPU (see
#: ``rstar2jax.engine``: the scan's per-step copies of weight slices cost more than unrolling's compile
#: time there).
UNROLL_MAX_LAYERS = 4

_cast = jax.jit(cast_floats, static_argnames=("dtype",))
_unstack = jax.jit(lambda params: unstack_layers({"layers": params})["layers"])


def engine_params(params, config: ModelConfig, unstacked: bool | None = None, *,
                  weight_dtype: str | None = None, weight_block: int = DEFAULT_BLOCK,
                  quantize_head: bool = False, fp8_matmul: str = "auto"):
    """The weights an engine decodes from: the caller's tree, with ``weight_dtype="fp8"`` its linear layers
    (and with ``quantize_head`` the output head) quantized from the caller's values into FP8 copies
    (``models.quantization.quantize_params``; ``fp8_matmul``: see ``EngineConfig``), every other leaf cast
    once to ``config.compute_dtype`` where it differs, and with ``unstacked`` (see
    ``EngineConfig.unstacked_decode``) the layers split into per-layer buffers (layers unrolled) or left
    stacked (layers scanned). Leaves needing none of it are the caller's buffers, not copies: the caller's
    weights are never changed."""
    compute = jax.numpy.dtype(config.compute_dtype)
    if weight_dtype == FP8:
        check_weight_blocks(config, weight_block, quantize_head)  # before any array is made
    if unstacked is None:
        unstacked = platform.copies_scanned_weight_slices() and config.num_layers <= UNROLL_MAX_LAYERS
    if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once, not with every step
    plain = lambda tree: [x for x in jax.tree.leaves(tree, is_leaf=is_fp8_weight) if not is_fp8_weight(x)]
    cast_all = lambda params: {name: _cast(value, config.compute_dtype)
                               if any(leaf.dtype != compute for leaf in plain(value)) else value
                               for name, value in params.items()}
    if weight_dtype == FP8:
        if config.numerics == "exact":  # quantized from the compute dtype, as the exact trainer quantizes
            params = cast_all(params)
        params = quantize_params(params, config, block=weight_block, head=quantize_head,
                                 native=fp8_matmul_is_native(fp8_matmul))
    cast = cast_all(params)
    if unstacked and not layers_are_unstacked(cast):
        cast["layers"] = _unstack(cast["layers"])
    return cast


def check_precision(config: ModelConfig, engine_config: EngineConfig) -> None:
    """Raise ValueError naming the problem when ``engine_config``'s precision cannot run here, before any
    work: FP8 weights or KV pages on a backend (or JAX) without float8_e4m3fn, an FP8 weight block that does
    not divide a weight, FP8 pages with an attention implementation that cannot read them."""
    cfg = engine_config
    if FP8 in (cfg.weight_dtype, cfg.kv_dtype) and not platform.float8_supported():
        which = "weight_dtype" if cfg.weight_dtype == FP8 else "kv_dtype"
        raise ValueError(f"{which}='fp8' needs float8_e4m3fn, which JAX {jax.__version__} on "
                         f"{jax.devices()[0].device_kind} ({jax.default_backend()}) does not support")
    if cfg.weight_dtype == FP8:
        check_weight_blocks(config, cfg.weight_block, cfg.quantize_head)
    decode_attention(cfg.attention, cfg.kv_dtype)
    if config.numerics == "exact":
        _check_exact_precision(config, cfg.rollout_precision)


def _check_exact_precision(config: ModelConfig, engine: RolloutPrecision) -> None:
    """An exact model's trainer computes through ``config.rollout_precision``: raise ValueError when the
    engine samples in another precision (its log-probs would not be the trainer's)."""
    def effective(p: RolloutPrecision):  # what changes the numbers
        fp8 = p.weight_dtype == FP8
        return (fp8, fp8 and p.weight_block, fp8 and p.quantize_head,
                fp8 and fp8_matmul_is_native(p.fp8_matmul),
                None if p.kv_dtype in (None, config.compute_dtype) else p.kv_dtype)

    if effective(engine) != effective(config.rollout_precision):
        raise ValueError(f"numerics='exact': the engine samples with {engine}, but the model's "
                         f"rollout_precision is {config.rollout_precision}, which the trainer computes "
                         "through; set ModelConfig.rollout_precision=engine_config.rollout_precision")


def engine_weights(params, config: ModelConfig, engine_config: EngineConfig):
    """What an engine built with ``engine_config`` decodes from (:func:`engine_params` with its precision
    fields, after :func:`check_precision`): the one call for a new engine and for every weight update."""
    cfg = engine_config
    check_precision(config, cfg)
    return engine_params(params, engine_model_config(config, cfg), cfg.unstacked_decode,
                         weight_dtype=cfg.weight_dtype, weight_block=cfg.weight_block,
                         quantize_head=cfg.quantize_head, fp8_matmul=cfg.fp8_matmul)


def abstract_shapes(tree):
    """``tree`` as shapes, dtypes and shardings (what a compiled program is keyed and lowered on)."""
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(abstract, tree)


def check_same_shapes(expected, actual, what: str = "new weights") -> None:
    """Raise ValueError naming the first leaf of ``actual`` whose shape, dtype, sharding or weak type differs
    from ``expected``'s, or that one tree has and the other lacks: a compiled program runs only on the
    abstract inputs it was compiled for, and new ones would compile it again."""
    leaves = lambda tree: dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    want, got = leaves(expected), leaves(actual)
    for path in want.keys() - got.keys():
        raise ValueError(f"{what} lack the leaf {jax.tree_util.keystr(path)} the engine's programs take")
    for path in got.keys() - want.keys():
        raise ValueError(f"{what} have a leaf {jax.tree_util.keystr(path)} the engine's programs do not take")
    for path, old in want.items():
        new = got[path]
        for field in ("shape", "dtype", "sharding", "weak_type"):
            before, after = getattr(old, field, None), getattr(new, field, None)
            if before != after:
                raise ValueError(
                    f"{what}: leaf {jax.tree_util.keystr(path)} has {field} {after}, but the engine's "
                    f"programs were compiled for {before} (new weights must keep every leaf's shape, dtype "
                    "and sharding: nothing is compiled again)")
    if jax.tree.structure(expected) != jax.tree.structure(actual):
        raise ValueError(f"{what} are a {jax.tree.structure(actual)}; the engine's programs take a "
                         f"{jax.tree.structure(expected)}")


class ProgramCache:
    """Compiled step programs by (bucket layout, return_on_stop, abstract state and params). Thread-safe: a
    program asked for while another thread compiles it waits for that compile instead of starting a second
    one."""

    def __init__(self):
        self._programs: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._programs)

    @staticmethod
    def _key(abstract, layout: StepLayout, return_on_stop: bool) -> tuple:
        return (layout, return_on_stop, jax.tree.structure(abstract),
                tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(abstract)))

    def _claim(self, key) -> tuple[concurrent.futures.Future, bool]:
        """The entry for ``key`` and whether the caller must compile it (no one has started)."""
        with self._lock:
            entry = self._programs.get(key)
            if entry is not None:
                return entry, False
            entry = self._programs[key] = concurrent.futures.Future()
            return entry, True

    def _compile(self, key, entry: concurrent.futures.Future, abstract, layout, return_on_stop) -> None:
        try:
            entry.set_result(compile_step(*abstract, layout, return_on_stop))
        except BaseException as error:
            with self._lock:
                del self._programs[key]  # the next request tries again (and raises in its own frame)
            entry.set_exception(error)

    def holds(self, abstract, layout: StepLayout, return_on_stop: bool) -> bool:
        """Whether the program is compiled or compiling (asking for it would not start a compile)."""
        with self._lock:
            return self._key(abstract, layout, return_on_stop) in self._programs

    def get(self, abstract, layout: StepLayout, return_on_stop: bool):
        """The compiled step for ``abstract`` = (state, params) shapes; compiles it here unless it is
        compiled or compiling already."""
        key = self._key(abstract, layout, return_on_stop)
        entry, owner = self._claim(key)
        if owner:
            self._compile(key, entry, abstract, layout, return_on_stop)
        return entry.result()

    def compile_ahead(self, abstract, layout: StepLayout, return_on_stop: bool) -> None:
        """Start compiling a program an engine is likely to need next, on a thread of its own, unless it is
        compiled or compiling already; returns at once. A failure is logged here and raised again when an
        engine asks for the program."""
        key = self._key(abstract, layout, return_on_stop)
        entry, owner = self._claim(key)
        if not owner:
            return

        def compile_and_log():
            self._compile(key, entry, abstract, layout, return_on_stop)
            if entry.exception() is not None:
                logger.warning("compiling the step program for %s ahead failed: %r", layout,
                               entry.exception())

        threading.Thread(target=compile_and_log, name="rstar2jax-compile").start()


#: The process's step programs, shared by every engine (module docstring: why that is safe).
PROGRAMS = ProgramCache()
