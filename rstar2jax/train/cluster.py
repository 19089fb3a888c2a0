"""What a cluster scheduler's environment says about the processes of a launch (``distributed.num_processes``
``"auto"``): SLURM (``srun``), Open MPI (``mpirun``) or a Kubernetes indexed Job.

Only reads environment variables (no device, no network): the runtime joins the processes with
``jax.distributed.initialize()`` and no arguments, JAX's own cluster detection (``jax/_src/clusters``), and
uses this to log and to refuse a launch the environment says has several processes where that detection
fails. The variables are the ones JAX's detectors read, except where a detector needs more than the process
count (SLURM's ``SLURM_STEP_NODELIST``, set inside an ``srun`` step only; Open MPI's
``OMPI_MCA_orte_hnp_uri``, which Open MPI 5 no longer sets): those are what a failed detection lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class ClusterLaunch:
    """A launch by a cluster scheduler: ``scheduler`` (as the log says it), the process count and this
    process's id (None: the environment does not say; a Kubernetes Job's count is its ``parallelism``, which
    JAX asks the Kubernetes API for) and ``evidence``, the variables that say so."""

    scheduler: str
    num_processes: int | None
    process_id: int | None
    evidence: str

    @property
    def several(self) -> bool:
        """Whether the launch has (or may have: count unknown) more than one process."""
        return self.num_processes is None or self.num_processes > 1


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _launch(environ: Mapping[str, str], scheduler: str, count: str, index: str) -> ClusterLaunch:
    num_processes, process_id = _integer(environ, count), _integer(environ, index)
    evidence = f"{count}={environ.get(count, '')}, {index}={environ.get(index, '')}"
    return ClusterLaunch(scheduler, num_processes, process_id, evidence)


def cluster_launch(environ: Mapping[str, str]) -> ClusterLaunch | None:
    """The launch ``environ`` (``os.environ``) describes, or None outside a scheduler's launch. Checked in
    JAX's order: Open MPI, SLURM, Kubernetes."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _launch(environ, "Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    if "SLURM_JOB_ID" in environ and "SLURM_NTASKS" in environ:
        return _launch(environ, "SLURM", "SLURM_NTASKS", "SLURM_PROCID")
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
        index = _integer(environ, "JOB_COMPLETION_INDEX")
        return ClusterLaunch("Kubernetes", None, index, f"JOB_COMPLETION_INDEX={index}")
    return None
