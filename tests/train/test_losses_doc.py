"""docs/losses.md: its Python blocks run, in order, as a reader would paste them."""

import pathlib
import re

from rstar2jax import algo

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "losses.md"


def test_the_losses_guide_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 2
    namespace = {}
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 (the guide's own code)
    finally:
        algo.POLICY_LOSSES.pop("clipped_pg", None)  # the registry is the process's
    assert "clipped_pg" in namespace
