"""docs/extending.md runs as written: each recipe's files (```python title="my_....py"```) are written to a
folder of the user's, which is all they add (nothing under rstar2jax/ changes), and its checks
(```python title="Try it"```) are run there in order."""

import pathlib
import re
import sys

import pytest

from rstar2jax import agent, algo

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "extending.md"
FENCE = re.compile(r'^```python title="([^"]+)"\n(.*?)^```$', re.DOTALL | re.MULTILINE)
CHECK = "Try it"


def recipes() -> dict[str, list[tuple[str, str]]]:
    """Each ``## `` section's (title, body) python blocks, in order."""
    sections = re.split(r"^## ", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
    return {section.splitlines()[0]: FENCE.findall(section) for section in sections}


RECIPES = recipes()


def test_every_recipe_is_one_file_of_the_users_a_run_config_and_a_check():
    assert list(RECIPES) == ["A loss", "A tool", "A reward", "An advantage estimator", "A config field"]
    for title, blocks in RECIPES.items():
        files = [name for name, _ in blocks if name != CHECK]
        assert all(re.fullmatch(r"my_\w+\.py", name) for name in files), title
        assert len([f for f in files if not f.endswith("_config.py")]) == 1, title  # one file of code
        assert blocks[-1][0] == CHECK, title


@pytest.fixture
def registries():
    """The registries a recipe adds to, as they were before it."""
    tables = [algo.ADVANTAGE_ESTIMATORS, agent.TOOLS]
    if hasattr(algo, "POLICY_LOSSES"):
        tables.append(algo.POLICY_LOSSES)
    before = [dict(table) for table in tables]
    yield
    for table, kept in zip(tables, before, strict=True):
        table.clear()
        table.update(kept)


@pytest.mark.parametrize("title", list(RECIPES))
def test_a_recipe_runs_as_written(title, tmp_path, monkeypatch, registries):
    if title == "A loss" and not hasattr(algo, "register_policy_loss"):
        pytest.skip("rstar2jax.algo has no register_policy_loss (the loss registry of issue 50's items 1-2)")
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []
    try:
        for name, body in RECIPES[title]:
            if name == CHECK:
                exec(compile(body, f"{DOC.name}: {title}", "exec"), {"__name__": "recipe"})  # noqa: S102
            else:
                (tmp_path / name).write_text(body, encoding="utf-8")
                written.append(name.removesuffix(".py"))
    finally:
        for module in written:
            sys.modules.pop(module, None)
