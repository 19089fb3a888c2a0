"""The package layout: layers import only downwards, and a star import binds no builtin's name."""

import ast
import builtins
import pathlib
import subprocess
import sys

import rstar2jax

ROOT = pathlib.Path(rstar2jax.__file__).parent
#: A subpackage may import its own rank or lower (same-rank siblings: none of them import each other).
RANK = {
    "algo": 0, "models": 0, "engine": 1, "reward": 2, "data": 3, "agent": 4, "eval": 4, "train": 5,
    "serve": 6,
}  # fmt: skip


def imported_subpackages(path: pathlib.Path) -> set[str]:
    """The ``rstar2jax.<sub>`` packages a module imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "rstar2jax":
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rstar2jax."))
    return found & set(RANK)


def test_layers_import_only_downwards():
    upward = []
    for sub, rank in RANK.items():
        for path in sorted((ROOT / sub).rglob("*.py")):
            for target in imported_subpackages(path) - {sub}:
                if RANK[target] >= rank:
                    upward.append(f"{path.relative_to(ROOT.parent)} imports rstar2jax.{target}")
    assert upward == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rstar2jax.train import policy\n", encoding="utf-8")
    assert imported_subpackages(module) == {"train"}


def test_star_import_does_not_shadow_builtins():
    probe = (
        "import rstar2jax.eval, builtins\n"
        "from rstar2jax import *\n"
        "shadowed = sorted(n for n in dir() if hasattr(builtins, n) and not n.startswith('_'))\n"
        "print(eval is builtins.eval, shadowed)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "[]"]
    assert not set(rstar2jax.__all__) & set(dir(builtins))
