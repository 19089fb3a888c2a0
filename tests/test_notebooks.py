"""Executes every ``notebooks/*.ipynb`` top to bottom in a fresh kernel; a cell that raises fails its test,
and so does a notebook that draws fewer figures (``image/png`` outputs) than :data:`MIN_FIGURES` expects.
Notebooks are committed without outputs. Every notebook's run is marked slow (from 35 s for the quickstart to
many minutes on a 2-core CPU; the calls they make are tested one by one by default) and runs with ``-m slow``,
which ``.ci/run`` includes: ``python -m pytest -q -m slow tests/test_notebooks.py``.

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
CELL_TIMEOUT_S = 300
SLOW_CELL_TIMEOUT_S = 1800  # token_entropy trains the demo's policies in one cell when runs/demo has none

#: Notebook -> the fewest figures (image/png outputs) a run must draw. Every notebook needs an entry.
MIN_FIGURES = {
    "quickstart.ipynb": 0,
    # accuracy, tool-error ratio in correct trajectories, response length per step; full vs LoRA; the
    # sampler-vs-trainer mismatch per step, float32 vs FP8 rollout
    "roc_ablation.ipynb": 3,
    "rollout_to_update.ipynb": 1,  # the change of the trained tokens' log-probs after one rl_step
    "token_entropy.ipynb": 2,  # the entropy distribution; entropy before and after RL
}
#: Notebooks that take more than about a minute on a 2-core CPU: their cells get the long timeout.
LONG_RUNNING = {"roc_ablation.ipynb", "rollout_to_update.ipynb", "token_entropy.ipynb"}

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


def count_figures(notebook) -> int:
    """The ``image/png`` outputs of an executed notebook's code cells."""
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )


def test_every_notebook_has_a_figure_count():
    missing = sorted(p.name for p in NOTEBOOKS if p.name not in MIN_FIGURES)
    assert not missing, f"add {missing} to MIN_FIGURES (the fewest image/png outputs each must produce)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_notebook_has_no_outputs(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        index
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or execution counts; clear them before committing "
        "(Jupyter: Clear All Outputs, or jupyter nbconvert --clear-output --inplace)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(_INTERPRETER_PROBE))
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        kernel_manager_class=_TestKernelManager,
        timeout=SLOW_CELL_TIMEOUT_S if path.name in LONG_RUNNING else CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
    )
    # A failing cell raises CellExecutionError, whose message holds the cell's source and traceback.
    client.execute()

    probe_output = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert probe_output.strip() == sys.executable, (
        f"the kernel ran {probe_output.strip()!r}, not the test interpreter {sys.executable!r}"
    )
    figures = count_figures(notebook)
    expected = MIN_FIGURES.get(path.name, 0)
    assert figures >= expected, (
        f"{path.name} drew {figures} figure(s) (image/png outputs), expected at least {expected}"
    )


def test_count_figures_counts_png_outputs_of_code_cells_only():
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("plot()"), nbformat.v4.new_code_cell("print(1)")]
    )
    assert count_figures(notebook) == 0
    png = nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
    notebook.cells[0].outputs = [png, nbformat.v4.new_output("stream", text="1\n")]
    notebook.cells[1].outputs = [nbformat.v4.new_output("display_data", data={"text/html": "<b>x</b>"})]
    assert count_figures(notebook) == 1
