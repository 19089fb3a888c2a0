"""Two processes joined by jax.distributed on CPU (gloo collectives) gather their rollouts and run an RL step
that agrees with one process holding all four devices."""

import json
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, cpu_xla_flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(base: dict, local_devices: int) -> dict:
    return {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(local_devices)}


@pytest.mark.slow  # 30 s on 2 cores: three launcher processes
def test_two_processes_match_one(tmp_path, compile_cache_env):
    worker = [sys.executable, "-m", "tests.train.distributed_worker"]
    single = subprocess.run(
        [*worker, f"--out={tmp_path / 'single.json'}"],
        env=_env(compile_cache_env, 4),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]

    port = _free_port()
    processes = [
        subprocess.Popen(
            [
                *worker,
                f"--out={tmp_path / f'multi{i}.json'}",
                "--num_processes=2",
                f"--process_id={i}",
                f"--port={port}",
            ],
            env=_env(compile_cache_env, 2),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in processes:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]

    expected = json.loads((tmp_path / "single.json").read_text())
    results = [json.loads((tmp_path / f"multi{i}.json").read_text()) for i in range(2)]
    assert expected["devices"] == 4 and expected["processes"] == 1
    # Every process holds every problem's 4 trajectories, in problem order, the same in both processes.
    assert results[0]["gathered"] == results[1]["gathered"]
    assert [[t[0] for t in g] for g in results[0]["gathered"]] == [[f"p{i}"] * 4 for i in range(8)]
    for got in results:
        assert got["devices"] == 4 and got["processes"] == 2
        for key, value in expected.items():
            if key not in ("processes", "gathered"):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert expected["tokens"] > 0 and expected["grad_norm"] > 0
