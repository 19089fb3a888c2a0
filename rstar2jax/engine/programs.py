"""The engine's compiled step programs and the weights they run on.

:func:`engine_params` prepares a caller's weights once for decoding (cast, layers split or stacked).
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

from rstar2jax.engine.step import StepLayout, compile_step
from rstar2jax.models import ModelConfig, layers_are_unstacked, unstack_layers

__all__ = ["PROGRAMS", "UNROLL_MAX_LAYERS", "ProgramCache", "abstract_shapes", "engine_params"]

logger = logging.getLogger(__name__)

#: Layer count up to which ``EngineConfig.unstacked_decode=None`` unrolls the layers on CPU (see
#: ``rstar2jax.engine``: the scan's per-step copies of weight slices cost more than unrolling's compile
#: time there).
UNROLL_MAX_LAYERS = 4

_cast = jax.jit(lambda params, dtype: jax.tree.map(lambda p: p.astype(dtype), params),
                static_argnames=("dtype",))
_unstack = jax.jit(lambda params: unstack_layers({"layers": params})["layers"])


def engine_params(params, config: ModelConfig, unstacked: bool | None = None):
    """The weights an engine decodes from: the caller's tree, cast once to ``config.compute_dtype`` where a
    leaf differs, and with ``unstacked`` (see ``EngineConfig.unstacked_decode``) its layers split into
    per-layer buffers (layers unrolled) or left stacked (layers scanned). Leaves needing neither are the
    caller's buffers, not copies."""
    compute = jax.numpy.dtype(config.compute_dtype)
    if unstacked is None:
        unstacked = jax.default_backend() == "cpu" and config.num_layers <= UNROLL_MAX_LAYERS
    if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once, not with every step
    cast = {name: _cast(value, config.compute_dtype)
            if any(leaf.dtype != compute for leaf in jax.tree.leaves(value)) else value
            for name, value in params.items()}
    if unstacked and not layers_are_unstacked(cast):
        cast["layers"] = _unstack(cast["layers"])
    return cast


def abstract_shapes(tree):
    """``tree`` as shapes, dtypes and shardings (what a compiled program is keyed and lowered on)."""
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(abstract, tree)


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
