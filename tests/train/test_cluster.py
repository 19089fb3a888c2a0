"""``distributed.num_processes="auto"`` (issue 54): a cluster scheduler's environment is enough to join a
multi-process run (JAX's own detection), a launch it says has several processes where detection fails is one
line, and the explicit fields keep working. Two processes under a faked SLURM step run two RL steps."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import pytest

from rstar2jax.config.options import ConfigError, DistributedOptions
from rstar2jax.train import runtime
from rstar2jax.train.cluster import cluster_launch
from tests.conftest import REPO_ROOT, cpu_xla_flags

AUTO = DistributedOptions(num_processes=None)
#: Every variable a detector reads, cleared before each in-process case sets its own.
CLUSTER_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST",
                     "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_MCA_orte_hnp_uri",
                     "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX", "JAX_COORDINATOR_ADDRESS")


def slurm_step(job_id: int, tasks: int, rank: int) -> dict[str, str]:
    """What ``srun --ntasks=<tasks>`` sets for task ``rank`` on one node (the variables JAX reads)."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_NTASKS": str(tasks), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1"}


def test_the_environment_says_which_launch():
    assert cluster_launch({}) is None
    assert cluster_launch({"SLURM_JOB_ID": "7"}) is None  # an allocation, no task count: one process
    slurm = cluster_launch(slurm_step(7, 4, 3))
    assert (slurm.scheduler, slurm.num_processes, slurm.process_id, slurm.several) == ("SLURM", 4, 3, True)
    assert slurm.evidence == "SLURM_NTASKS=4, SLURM_PROCID=3"
    assert not cluster_launch(slurm_step(7, 1, 0)).several
    mpi = cluster_launch({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert (mpi.scheduler, mpi.num_processes, mpi.process_id) == ("Open MPI", 2, 1)
    k8s = cluster_launch({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "5"})
    assert (k8s.scheduler, k8s.num_processes, k8s.process_id, k8s.several) == ("Kubernetes", None, 5, True)


@pytest.fixture
def joined(monkeypatch):
    """``jax.distributed.initialize`` and the settings it comes with recorded, not run; the process count
    and index JAX reports afterwards are ``joined.count`` / ``joined.index``."""
    calls = {"initialize": [], "config": [], "count": 2, "index": 1}
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls["initialize"].append(kw))
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls["config"].append((name, value)))
    monkeypatch.setattr(jax, "process_count", lambda: calls["count"])
    monkeypatch.setattr(jax, "process_index", lambda: calls["index"])
    return calls


def test_auto_joins_a_slurm_step_by_jax_detection_and_says_so_once(joined, monkeypatch, caplog):
    for name, value in slurm_step(4242, 2, 1).items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO", logger="rstar2jax"):
        runtime.initialize_distributed(AUTO)
    # No arguments: JAX's own SLURM detection finds the coordinator, the count and this process's id.
    assert joined["initialize"] == [{"coordinator_address": None}]
    assert joined["config"] == [("jax_cpu_collectives_implementation", "gloo")]
    lines = [r.getMessage() for r in caplog.records if "jax.distributed" in r.getMessage()]
    assert lines == ["jax.distributed: process 1 of 2 (SLURM: SLURM_NTASKS=2, SLURM_PROCID=1)"]


def test_auto_passes_a_coordinator_address_on_and_stays_one_process_elsewhere(joined, monkeypatch):
    runtime.initialize_distributed(AUTO)  # no scheduler
    for name, value in slurm_step(4242, 1, 0).items():  # one task
        monkeypatch.setenv(name, value)
    runtime.initialize_distributed(AUTO)
    assert joined["initialize"] == []
    monkeypatch.setenv("SLURM_NTASKS", "2")
    runtime.initialize_distributed(DistributedOptions("node0:1234", None, 0))
    assert joined["initialize"] == [{"coordinator_address": "node0:1234"}]


def test_explicit_fields_keep_working_under_a_scheduler(joined, monkeypatch):
    for name, value in slurm_step(4242, 8, 3).items():
        monkeypatch.setenv(name, value)
    runtime.initialize_distributed(DistributedOptions(num_processes=1))
    assert joined["initialize"] == []
    runtime.initialize_distributed(DistributedOptions("host0:1234", 2, 1))
    assert joined["initialize"] == [dict(coordinator_address="host0:1234", num_processes=2, process_id=1)]


def test_a_launch_of_several_processes_that_detection_cannot_join_is_one_line(joined, monkeypatch):
    def no_cluster(**kwargs):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    for name, value in {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # Open MPI 5: no OMPI_MCA_orte_hnp_uri for JAX's detector
    with pytest.raises(ConfigError) as error:
        runtime.initialize_distributed(AUTO)
    message = str(error.value)
    assert message.startswith("config.distributed.num_processes='auto': Open MPI launched several "
                              "processes (OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_RANK=0) but "
                              "jax.distributed.initialize() could not join them")
    assert "coordinator_address should be defined" in message and "\n" not in message
    # Detection that joins another count than the scheduler's (another detector won) is refused too.
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)
    with pytest.raises(ConfigError, match="Open MPI says 4 processes .* joined 2"):
        runtime.initialize_distributed(AUTO)


def test_a_slurm_job_script_that_runs_the_launcher_without_srun_exits_2_in_one_line(tmp_path):
    """``sbatch --ntasks=2`` whose script runs the launcher itself (not ``srun``): the job's variables say two
    tasks, but there is no step (``SLURM_STEP_NODELIST``) for JAX's SLURM detection to find."""
    environment = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    environment.update(slurm_step(4242, 2, 0), JAX_PLATFORMS="cpu")
    del environment["SLURM_STEP_NODELIST"]
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train_rl", "--config=experiments/configs/tiny_cpu.py",
         f"--config.workdir={workdir}", "--compilation_cache_dir="],
        env=environment, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: config.distributed.num_processes='auto': SLURM launched several "
                           "processes (SLURM_NTASKS=2, SLURM_PROCID=0) but jax.distributed.initialize() "
                           "could not join them from that environment (coordinator_address should be "
                           "defined"), line
    assert line.endswith("start one process per task (srun / mpirun), or set "
                         "config.distributed.coordinator_address, num_processes and process_id"), line
    assert not workdir.exists()


def test_partial_rollouts_are_refused_once_a_cluster_said_several_processes(joined, monkeypatch):
    from experiments.configs import tiny_cpu
    from rstar2jax.config.parse import parse

    config = tiny_cpu.get_config()
    config.loss.old_logprobs, config.loss.rollout_is_cap = "recompute", 2.0
    config.rollout.partial_token_budget = 64
    options = parse(config)  # "auto": parsing cannot know the count
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the case
    for name, value in slurm_step(4242, 2, 0).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"^config.rollout.partial_token_budget > 0: partial rollouts run "
                                          r"in one process \(distributed.num_processes=1; SLURM says 2\)$"):
        runtime.prepare_process(options)


def _slurm_port() -> tuple[int, int]:
    """A SLURM job id whose coordinator port (JAX: 61440 + job id mod 4096) is free here, and that port."""
    for port in range(61440 + os.getpid() % 4096, 61440 + 4096):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port - 61440, port
    raise RuntimeError("no free port in SLURM's range")


# 35-66 s on 2 shared cores (warm compilation cache - cold, 2026-12-06), in the default run all the same:
# the one test where JAX's own detection joins real processes from nothing but a scheduler's environment.
def test_two_processes_of_a_slurm_step_run_two_rl_steps(tmp_path, compile_cache_env):
    """Two local processes with what ``srun --ntasks=2`` sets (and no distributed field in the config) join
    one run: a data=2 mesh over one CPU device each, two RL steps of one group, one metrics file."""
    job_id, _ = _slurm_port()
    command = [sys.executable, "-m", "tests.train.scripted", f"--config.workdir={tmp_path / 'run'}",
               "--max_steps=2", "--config.seed=11", "--config.rl.prompts_per_step=1",
               "--config.num_microbatches=1", "--config.mesh.data=2", "--config.checkpoint.async_save=False",
               "--config.logging.tensorboard=False"]
    environment = {**compile_cache_env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1)}
    start = time.perf_counter()
    processes = [subprocess.Popen(command, env={**environment, **slurm_step(job_id, 2, rank)}, cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (_, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    print(f"two SLURM-launched processes, two RL steps: {time.perf_counter() - start:.1f} s")
    for rank, (out, _) in enumerate(outputs):
        assert f"jax.distributed: process {rank} of 2 (SLURM: SLURM_NTASKS=2, SLURM_PROCID={rank})" in out
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2]
    # One group each step (seed 11 draws problems the scripted rollout solves half the time): an update.
    assert all(r["selected"] == 2 and r["grad_norm"] > 0 for r in history)
