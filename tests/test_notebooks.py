"""Executes every ``notebooks/*.ipynb`` top to bottom in a fresh kernel; a cell that raises fails its test.

The kernel is ipykernel's built-in ``python3`` spec, which runs ``sys.executable``: the interpreter running
pytest, so the notebooks see the same installed rstar2jax whatever kernelspecs the machine has.
"""

import pathlib
import sys

import nbclient
import nbformat
import pytest
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from traitlets import default

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# Notebooks that train or roll out for minutes: run with `pytest -m slow tests/test_notebooks.py`.
SLOW_NOTEBOOKS = {"token_entropy.ipynb"}
CELL_TIMEOUT_S = 300
SLOW_CELL_TIMEOUT_S = 1200  # token_entropy trains a reduced demo in one cell (about 7 minutes on 2 cores)

# Appended to each notebook: prints the kernel's interpreter, which must be the one running the tests.
_INTERPRETER_PROBE = "import sys; print(sys.executable)"


class _TestKernelManager(AsyncKernelManager):
    """Starts the test interpreter's kernel. (What a notebook starts ends with the kernel: ``start_local``'s
    server and the reward's verifier workers both stop when the process that started them dies.)"""

    @default("kernel_spec_manager")
    def _builtin_kernelspec_only(self) -> KernelSpecManager:
        # No kernelspec directories: "python3" resolves to ipykernel's own spec, [sys.executable, -m,
        # ipykernel_launcher, ...], never to a user or system kernelspec of that name pointing elsewhere.
        return KernelSpecManager(kernel_dirs=[])


def test_notebooks_folder_is_not_empty():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_NOTEBOOKS else p for p in NOTEBOOKS],
    ids=lambda path: path.name,
)
def test_notebook_runs(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(_INTERPRETER_PROBE))
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        kernel_manager_class=_TestKernelManager,
        timeout=SLOW_CELL_TIMEOUT_S if path.name in SLOW_NOTEBOOKS else CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
    )
    # A failing cell raises CellExecutionError, whose message holds the cell's source and traceback.
    client.execute()

    probe_output = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert probe_output.strip() == sys.executable, (
        f"the kernel ran {probe_output.strip()!r}, not the test interpreter {sys.executable!r}"
    )
