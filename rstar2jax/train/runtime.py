"""Process set-up for a run: emulated host devices, multi-host initialisation and the mesh.

Order matters: JAX reads ``XLA_FLAGS`` and the distributed settings when its backends start (the first device
query), not when ``jax`` is imported. Launchers therefore call ``request_host_devices`` and
``initialize_distributed`` first, then build the mesh.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.config.options import ConfigError, DistributedOptions, RunOptions
from rstar2jax.config.rules import partial_rollout_processes
from rstar2jax.engine.programs import check_precision
from rstar2jax.models.config import FP8
from rstar2jax.schedules.placement import local_devices_needed, train_devices
from rstar2jax.train.cluster import ClusterLaunch, cluster_launch

logger = logging.getLogger(__name__)

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def request_host_devices(count: int) -> None:
    """Makes XLA's CPU backend expose at least ``count`` devices (emulated on one host).

    Only the CPU backend is affected: on a GPU/TPU host the accelerator stays the default backend. When
    ``count > 1`` and ``JAX_PLATFORMS`` names only accelerators (``cuda``, ``rocm``), ``cpu`` is appended to
    it so that the emulated devices exist; the first platform named stays the default. Must run before
    JAX's first device query (``mesh_from_config`` reports a shortfall if it ran too late).
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if count > 1 and platforms and "cpu" not in platforms.split(","):
        os.environ["JAX_PLATFORMS"] = f"{platforms},cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    match = _DEVICE_COUNT_FLAG.search(flags)
    if match and int(match.group(1)) >= count:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = _DEVICE_COUNT_FLAG.sub(flag, flags) if match else f"{flags} {flag}".strip()


def _cluster_processes(distributed: DistributedOptions) -> ClusterLaunch | None:
    """With ``num_processes`` None ("auto"), the scheduler's launch of several processes this one belongs
    to (None: one process, or the count is explicit)."""
    if distributed.num_processes is not None:
        return None
    launch = cluster_launch(os.environ)
    return launch if launch is not None and launch.several else None


def initialize_distributed(distributed: DistributedOptions) -> None:
    """``jax.distributed.initialize`` when ``distributed`` (``config.distributed``) names more than one
    process, or (``num_processes`` None, the config's "auto") when a cluster scheduler launched several:
    then JAX's own cluster detection (SLURM, Open MPI, Kubernetes) finds the coordinator, count and id
    (``coordinator_address``, when set, is passed on), and the process logs its id and the count once. A
    launch whose environment says several processes where that detection fails (a SLURM job's script run
    without ``srun``, Open MPI 5's ``mpirun``, a Kubernetes Job without the ``kubernetes`` package), or finds
    another count, is a ``ConfigError``; JAX's backend starts here in that case (the count is JAX's).

    CPU collectives across processes go through gloo (set here; it only affects the CPU backend).
    """
    d = distributed
    launch = _cluster_processes(d)
    if launch is None:
        if (d.num_processes or 1) <= 1:
            return
        if not d.coordinator_address:
            raise ValueError("config.distributed.coordinator_address is empty but num_processes > 1")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if launch is None:
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id
        )
        return
    fix = ("start one process per task (srun / mpirun), or set config.distributed.coordinator_address, "
           "num_processes and process_id")
    try:
        jax.distributed.initialize(coordinator_address=d.coordinator_address or None)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"config.distributed.num_processes='auto': {launch.scheduler} launched several "
                          f"processes ({launch.evidence}) but jax.distributed.initialize() could not join "
                          f"them from that environment ({error}); {fix}") from None
    count, index = jax.process_count(), jax.process_index()
    if launch.num_processes not in (None, count):
        raise ConfigError(f"config.distributed.num_processes='auto': {launch.scheduler} says "
                          f"{launch.num_processes} processes ({launch.evidence}) but JAX's cluster detection "
                          f"joined {count}; {fix}")
    logger.info("jax.distributed: process %d of %d (%s: %s)", index, count, launch.scheduler, launch.evidence)


def mesh_size(options: RunOptions) -> int:
    """Devices the run's mesh takes."""
    return options.mesh.size


def mesh_from_config(options: RunOptions, *, allow_emulated: bool = False) -> Mesh:
    """The ``data x fsdp x tensor`` mesh of the run (``config.mesh``) over the default backend's devices (with
    ``rl.placement="split"``, those the rollout does not take: ``placement.train_devices``).

    With ``allow_emulated`` (dry runs) a mesh larger than the default backend falls back to the host's
    (emulated) CPU devices, so a 64-device plan compiles on a laptop.
    """
    mesh, devices = options.mesh, jax.devices()
    if len(train_devices(options, devices)) < mesh.size and allow_emulated:
        devices = jax.devices("cpu")
    check_mesh(options, devices)
    return models.make_mesh(mesh.data, mesh.fsdp, mesh.tensor, devices=train_devices(options, devices))


def check_mesh(options: RunOptions, devices: Sequence[jax.Device] | None = None) -> None:
    """After :func:`prepare_process`, before any work: a ``ConfigError`` when the run's mesh (``config.mesh``:
    data x fsdp x tensor) needs more devices than ``devices`` (default ``jax.devices()``) leave for training
    (``placement.train_devices``: split placement sets the rollout's apart). Starts the backend."""
    mesh, devices = options.mesh, list(jax.devices() if devices is None else devices)
    left = train_devices(options, devices)
    if len(left) >= mesh.size:
        return
    apart = len(devices) - len(left)
    split = f" ({apart} set apart for the rollout: rl.rollout_devices)" if apart else ""
    raise ConfigError(
        f"config.mesh: data x fsdp x tensor = {mesh.data} x {mesh.fsdp} x {mesh.tensor} needs {mesh.size} "
        f"devices but {len(left)} {devices[0].platform} devices are left for training{split} (emulated CPU "
        "devices must be requested before JAX starts: see request_host_devices)"
    )


def prepare_process(options: RunOptions) -> None:
    """Before any device query: emulate enough CPU devices for this process's share of the run's mesh (and,
    split placement, its rollout devices; only the CPU backend is touched) and join the multi-host run its
    ``distributed`` options describe (parsing a config starts no backend:
    ``prepare_process(parse(config))``)."""
    launch = _cluster_processes(options.distributed)
    request_host_devices(local_devices_needed(options, launch and launch.num_processes))
    initialize_distributed(options.distributed)
    if launch is not None and options.rl is not None:
        partial_rollout_processes(options.rl.partial_token_budget, jax.process_count(), launch.scheduler)


#: The engine fields a precision error may name, each ``config.rollout.<name>``.
_PRECISION_FIELDS = ("weight_dtype", "kv_dtype", "weight_block", "quantize_head", "attention")


def check_rollout_precision(options: RunOptions) -> None:
    """After :func:`prepare_process`, before any work: a ``ConfigError`` naming the ``config.rollout`` field
    whose precision the backend cannot run (``engine.check_precision``: FP8 weights or KV pages where JAX or
    the device has no float8_e4m3fn, FP8 pages with an attention kernel that does not compile for them here,
    an FP8 weight block that does not divide a weight). Starts the backend (parsing could not) when the
    rollout has anything in FP8; otherwise there is nothing to check."""
    engine = options.rl.rollout.engine if options.rl is not None else None
    if engine is None or FP8 not in (engine.weight_dtype, engine.kv_dtype):
        return
    try:
        check_precision(options.model, engine)
    except ValueError as error:
        # The field the message starts from ("attention='pallas_triton' cannot read FP8 KV pages ...").
        found = {m.start(): n for n in _PRECISION_FIELDS if (m := re.search(rf"\b{n}=", str(error)))}
        name = found[min(found)] if found else "weight_block"  # check_block's message names no field
        raise ConfigError(f"config.rollout.{name}={getattr(engine, name)!r}: {error}") from None
