"""Shared test fixtures and settings."""

import os
import pathlib

import pytest

# Tests run on the CPU; keep XLA from grabbing every core for intra-op threads we do not need.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight emulated CPU devices so that sharding tests run in the same process as the rest.
# Must be set before jax is imported anywhere.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = flags.strip()
# Tests compile hundreds of small programs and run most for milliseconds: on the CPU, XLA's LLVM optimisation
# and its new fusion emitters more than double the compile time (one tiny engine step program: 8 s -> 2.5 s)
# and buy nothing at these sizes. Not for other backends' runs (the accelerator check runs tests on GPUs).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    for flag in FAST_COMPILE_FLAGS:
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
# Tests compare float32 results against references at tight tolerances. GPUs default to TF32 (NVIDIA) or
# reduced-precision matmuls; pin full float32 so the same tolerances hold on every backend.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a CPU subprocess with ``devices`` emulated devices, compiling as the tests do."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", *FAST_COMPILE_FLAGS))


def shared_folder(tmp_path_factory, name: str, build) -> pathlib.Path:
    """A folder built once per test run, shared by every pytest-xdist worker: the first worker to ask builds
    it (``build(folder)``) under a file lock in the run's common temporary root, the others wait and reuse it.
    For fixtures that cost tens of seconds to make (the tiny taught policy) and are only read afterwards."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders are siblings under the run's root
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 tokenizer, bundled with ``rstar2jax.models`` (loaded once per session)."""
    from rstar2jax.data.tokenizer import load_tokenizer
    from rstar2jax.models import QWEN3_TOKENIZER_DIR

    return load_tokenizer(QWEN3_TOKENIZER_DIR)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("needs_devices")
    if marker is None:
        return
    import jax

    need, have = marker.args[0], jax.device_count()
    if have < need:
        pytest.skip(f"needs {need} devices, {have} {jax.default_backend()} device(s) exist")


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """The tiny taught policy folder (``experiments.tiny_policy``), built once per test run."""
    return shared_folder(tmp_path_factory, "tiny-policy", _build_tiny_policy)


def _build_tiny_policy(folder: pathlib.Path) -> None:
    """Its 120 training steps run twice as fast with XLA's optimisation on (22 s against 44 s): built in a
    process without the tests' fast-compile flags."""
    import subprocess
    import sys

    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS)
    code = "import sys; from experiments.tiny_policy import build_tiny_policy; build_tiny_policy(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(folder)], cwd=REPO_ROOT, check=True,
                   env={**os.environ, "XLA_FLAGS": flags})


@pytest.fixture(scope="session")
def compile_cache_env(tmp_path_factory) -> dict:
    """Environment for subprocesses (launchers, resumed runs): one persistent JAX compilation cache shared by
    every worker of the run (JAX writes its entries atomically), compiling as the tests do."""
    cache = shared_folder(tmp_path_factory, "jax_cache", lambda folder: None)
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
