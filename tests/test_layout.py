"""The package layout: layers import only downwards, a star import binds no builtin's name, only the config
edge imports ``ml_collections``, no private name crosses a package, the library does not print, and files and
functions stay small. Each check is also fed a bad example, so that it cannot pass by seeing nothing."""

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


# --- issue 34: one config edge, no private names across packages, no prints, small files and functions ---

REPO = ROOT.parent
#: The modules of ``rstar2jax`` that may import ``ml_collections``: the one edge between the launchers' run
#: configs and the library, which takes plain values. Adjust this constant, nothing else, when the edge moves.
CONFIG_EDGE_MODULES = frozenset({"rstar2jax/train/config.py", "rstar2jax/train/options.py"})
#: Modules whose ``main`` is a documented command line: they may print (to their console). None in the library
#: today: the launchers in ``experiments/`` are the command lines.
CLI_MODULES = frozenset()
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120


def library_modules() -> list[pathlib.Path]:
    return sorted(ROOT.rglob("*.py"))


def relative(path: pathlib.Path, root: pathlib.Path = REPO) -> str:
    return path.relative_to(root).as_posix()


def parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports_ml_collections(path: pathlib.Path) -> bool:
    """Whether the module imports ``ml_collections`` anywhere (function level, ``TYPE_CHECKING`` too)."""
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] == "ml_collections" for name in names):
            return True
    return False


def config_edge_violations(modules: list[pathlib.Path], root: pathlib.Path = REPO) -> list[str]:
    return [relative(p, root) for p in modules
            if imports_ml_collections(p) and relative(p, root) not in CONFIG_EDGE_MODULES]


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports_across_packages(path: pathlib.Path, package: str) -> list[str]:
    """The private ``rstar2jax`` names (``_x``, or names in a private module) of another package that a
    module in ``package`` imports (see :func:`package_of`)."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            imported = [parts + [a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            imported = [a.name.split(".") for a in node.names]
        else:
            continue
        for dotted in imported:
            if dotted[0] != "rstar2jax" or not any(is_private(part) for part in dotted[1:]):
                continue
            owner = dotted[1] if len(dotted) > 2 else ""  # `from rstar2jax import _x`: the top package's
            if owner != package:
                found.append(f"{path.name}:{node.lineno} imports {'.'.join(dotted)}")
    return found


def package_of(path: pathlib.Path) -> str:
    """``train`` for ``rstar2jax/train/x.py``, ``""`` for ``rstar2jax/x.py``, ``"<outside>"`` elsewhere."""
    if ROOT not in path.parents:
        return "<outside>"
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else ""


def print_calls(path: pathlib.Path) -> list[int]:
    """Lines of the module's ``print(...)`` calls (calls, not the word in a string or a code snippet)."""
    return [node.lineno for node in ast.walk(parse(path))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]


def oversized(path: pathlib.Path) -> list[str]:
    """The module, if it is over ``MAX_FILE_LINES`` lines, and its functions over ``MAX_FUNCTION_LINES``."""
    text = path.read_text(encoding="utf-8")
    found = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        found.append(f"{path.name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_only_the_config_edge_imports_ml_collections():
    assert config_edge_violations(library_modules()) == []


def test_the_config_edge_check_sees_another_module_import_ml_collections(tmp_path):
    edge, other = tmp_path / "rstar2jax/train/config.py", tmp_path / "rstar2jax/train/rl.py"
    edge.parent.mkdir(parents=True)
    edge.write_text("import ml_collections\n", encoding="utf-8")
    other.write_text("def f():\n    from ml_collections import config_dict\n", encoding="utf-8")
    assert config_edge_violations([edge, other], root=tmp_path) == ["rstar2jax/train/rl.py"]


def test_no_private_name_is_imported_across_packages():
    found = []
    for path in [*library_modules(), *sorted((REPO / "experiments").rglob("*.py"))]:
        found += private_imports_across_packages(path, package_of(path))
    assert found == []


def test_the_private_import_check_sees_a_name_from_another_package(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from rstar2jax.algo import _checks\n"  # inside algo: fine
        "from rstar2jax.models.hf_checkpoint import _LAYER_TENSORS, load_pretrained\n"
        "from rstar2jax.reward import _math_verify_worker\n"
        "import rstar2jax.agent._private.thing\n"
        "from rstar2jax import __version__, _top\n",
        encoding="utf-8",
    )
    assert private_imports_across_packages(module, "algo") == [
        "m.py:2 imports rstar2jax.models.hf_checkpoint._LAYER_TENSORS",
        "m.py:3 imports rstar2jax.reward._math_verify_worker",
        "m.py:4 imports rstar2jax.agent._private.thing",
        "m.py:5 imports rstar2jax._top",
    ]
    assert private_imports_across_packages(module, "models") == [
        "m.py:1 imports rstar2jax.algo._checks",
        "m.py:3 imports rstar2jax.reward._math_verify_worker",
        "m.py:4 imports rstar2jax.agent._private.thing",
        "m.py:5 imports rstar2jax._top",
    ]


def test_the_library_does_not_print():
    printing = {relative(p): print_calls(p) for p in library_modules() if relative(p) not in CLI_MODULES}
    assert {name: lines for name, lines in printing.items() if lines} == {}


def test_the_print_check_sees_calls_and_not_code_strings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Prints nothing: print(1) in a docstring."""\n'
        'CODE = "print(2)"\n'
        "def f(log=print):\n"
        "    if log:\n"
        "        print('to the console')\n",
        encoding="utf-8",
    )
    assert print_calls(module) == [5]


def test_files_and_functions_are_small():
    assert [line for p in library_modules() for line in oversized(p)] == []


def test_the_size_check_sees_a_long_file_and_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "m.py"
    module.write_text(f"def long():\n{body}\n\ndef short():\n    pass\n", encoding="utf-8")
    assert oversized(module) == [f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
    module.write_text("x = 1\n" * (MAX_FILE_LINES + 1), encoding="utf-8")
    assert oversized(module) == [f"m.py: {MAX_FILE_LINES + 1} lines"]
