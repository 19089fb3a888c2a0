"""The package layout: layers import only downwards, a star import binds no builtin's name, only the config
edge imports ``ml_collections``, no private name crosses a package, the library does not print, and files and
functions stay small. Each check is also fed a bad example, so that it cannot pass by seeing nothing."""

import ast
import builtins
import functools
import pathlib
import subprocess
import sys

import pytest

import rstar2jax

ROOT = pathlib.Path(rstar2jax.__file__).parent
#: A subpackage may import lower ranks only (same-rank siblings: none of them import each other).
RANK = {
    "algo": 0, "models": 0, "engine": 1, "reward": 2, "data": 3, "agent": 4, "eval": 5, "config": 6,
    "policy": 7, "schedules": 7, "train": 8, "serve": 9,
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


def upward_imports(sub: str, paths: list[pathlib.Path]) -> list[str]:
    """The imports of ``sub``'s modules ``paths`` that point at its own rank or above."""
    return [f"{path.name} imports rstar2jax.{target}" for path in paths
            for target in sorted(imported_subpackages(path) - {sub}) if RANK[target] >= RANK[sub]]


def test_layers_import_only_downwards():
    assert [line for sub in RANK for line in upward_imports(sub, sorted((ROOT / sub).rglob("*.py")))] == []


def test_the_config_the_policy_and_the_schedules_sit_between_eval_and_the_trainer():
    """The rooms of issue 49: the config below everything that reads options, the policy and the schedules
    siblings (neither imports the other) below the trainer, the server on top."""
    assert RANK["data"] < RANK["eval"] < RANK["config"] < RANK["policy"] == RANK["schedules"] < RANK["train"]
    assert RANK["train"] < RANK["serve"] == max(RANK.values())


@pytest.mark.parametrize(("sub", "source", "flagged"), [
    ("config", "from rstar2jax.train.steps import rl_step\n", ["m.py imports rstar2jax.train"]),
    ("config", "def f():\n    from rstar2jax.policy import loader\n", ["m.py imports rstar2jax.policy"]),
    ("config", "from rstar2jax.schedules import schedule\n", ["m.py imports rstar2jax.schedules"]),
    ("policy", "from rstar2jax.schedules import colocate\n", ["m.py imports rstar2jax.schedules"]),
    ("policy", "import rstar2jax.train.run\n", ["m.py imports rstar2jax.train"]),
    ("schedules", "from rstar2jax.policy.loader import Policy\n", ["m.py imports rstar2jax.policy"]),
    ("schedules", "from rstar2jax.train.rl import rl_iteration\n", ["m.py imports rstar2jax.train"]),
    ("train", "from rstar2jax.serve import server\n", ["m.py imports rstar2jax.serve"]),
    ("train", "from rstar2jax.config import parse\nfrom rstar2jax.policy import loader\n", []),
])
def test_the_layer_check_sees_each_new_room_import_upwards(tmp_path, sub, source, flagged):
    module = tmp_path / "m.py"
    module.write_text(source, encoding="utf-8")
    assert upward_imports(sub, [module]) == flagged


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
CONFIG_EDGE_MODULES = frozenset({"rstar2jax/config/config.py", "rstar2jax/config/options.py"})
#: Modules whose ``main`` is a documented command line: they may print (to their console). None in the library
#: today: the launchers in ``experiments/`` are the command lines.
CLI_MODULES = frozenset()
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250


def library_modules() -> list[pathlib.Path]:
    return sorted(ROOT.rglob("*.py"))


def relative(path: pathlib.Path, root: pathlib.Path = REPO) -> str:
    return path.relative_to(root).as_posix()


def parse(path: pathlib.Path) -> ast.Module:
    """The module's syntax tree (parsed once per version of the file: several checks read every module)."""
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module:
    del mtime_ns, size  # the cache key: a rewritten file is parsed again
    return ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))


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
    """The module, if it is over ``MAX_FILE_LINES`` lines, its functions (methods and nested functions
    too, docstrings included) over ``MAX_FUNCTION_LINES`` and its classes over ``MAX_CLASS_LINES``."""
    text = path.read_text(encoding="utf-8")
    found = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        found.append(f"{path.name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit, kind = MAX_FUNCTION_LINES, ""
        elif isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class "
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append(f"{path.name}:{node.lineno} {kind}{node.name}: {length} lines")
    return found


def test_only_the_config_edge_imports_ml_collections():
    assert config_edge_violations(library_modules()) == []


def test_the_config_edge_check_sees_another_module_import_ml_collections(tmp_path):
    edge, other = tmp_path / "rstar2jax/config/config.py", tmp_path / "rstar2jax/config/parse.py"
    edge.parent.mkdir(parents=True)
    edge.write_text("import ml_collections\n", encoding="utf-8")
    other.write_text("def f():\n    from ml_collections import config_dict\n", encoding="utf-8")
    assert config_edge_violations([edge, other], root=tmp_path) == ["rstar2jax/config/parse.py"]


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


def test_the_size_check_sees_a_long_file_a_long_function_and_a_long_class(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "m.py"
    module.write_text(f"def long():\n{body}\n\ndef short():\n    pass\n", encoding="utf-8")
    assert oversized(module) == [f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 2))
    module.write_text(f"class Big:\n{methods}\n\nclass Small:\n    pass\n", encoding="utf-8")
    assert oversized(module) == [f"m.py:1 class Big: {MAX_CLASS_LINES + 1} lines"]
    module.write_text("x = 1\n" * (MAX_FILE_LINES + 1), encoding="utf-8")
    assert oversized(module) == [f"m.py: {MAX_FILE_LINES + 1} lines"]


# --- issue 39: no import cycle, re-exports only in package __init__ files ---

#: The trees whose modules import each other: the library and its launchers.
SOURCE_ROOTS = ("rstar2jax", "experiments")
#: Old import paths the README documents that now lead elsewhere: ``(module, name)`` pairs a module other
#: than a package ``__init__`` may re-export as a one-line alias. Library code still imports the name from
#: its home. Each entry must stay documented in README.md or a docs page
#: (``test_documented_aliases_are_documented``).
DOCUMENTED_ALIASES: frozenset[tuple[str, str]] = frozenset({
    ("rstar2jax.train.policy", "export_policy"),  # now rstar2jax.policy.export.export_policy
    ("rstar2jax.train.export", "export_policy"),  # now rstar2jax.policy.export.export_policy
})  # fmt: skip


def module_names(roots: tuple[str, ...] = SOURCE_ROOTS, repo: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module under ``roots`` (a package by its ``__init__.py``)."""
    found = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_time_statements(body: list[ast.stmt]):
    """The statements that bind a module's names when it is imported: its top level, and the bodies of
    ``if`` / ``try`` / ``with`` there (not ``if TYPE_CHECKING:`` blocks, which never run)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from import_time_statements(node.body)
            yield from import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from import_time_statements(block)
        elif isinstance(node, ast.With):
            yield from import_time_statements(node.body)


def absolute_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, int]:
    """The modules of ``known`` that ``module`` depends on, each with the line of its first import.

    What counts: every import statement, wherever it stands: at the top, inside a function, under ``if
    TYPE_CHECKING:``. An import inside a function does not run while the module loads, and one for type
    checking never runs, so neither can break loading; but each is still a dependency, and two modules
    that depend on each other are one concept in two files (the reason a function-level import is written
    is then usually the cycle itself). A module with a ``__getattr__`` (a lazy package) also depends on
    every known module it names in a string: the table its ``__getattr__`` imports from.

    ``from package import name`` is an edge to ``package.name`` when that is a module, else to the
    package; ``import a.b.c`` to the deepest known module of the dotted name. The parent package a
    submodule import runs first is no edge: Python has finished it before the submodule starts."""
    tree = parse(path)
    edges: dict[str, int] = {}

    def add(target: str, line: int):
        if target in known and target != module:
            edges.setdefault(target, line)

    is_package = path.name == "__init__.py"
    lazy = any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body)
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)),
                       key=lambda n: n.lineno):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                deepest = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                                if ".".join(parts[:n]) in known), None)
                if deepest:
                    add(deepest, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = absolute_module(node, module, is_package)
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source, node.lineno)
    if lazy:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                add(node.value, node.lineno)
    return edges


def import_graph(known: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    return {module: import_edges(module, path, known) for module, path in known.items()}


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str):  # Tarjan's algorithm (the graph is a few hundred modules: recursion is fine)
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [cycle_through(graph, group) for group in sorted(groups)]


def cycle_through(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """A shortest cycle from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return paths[node] + [start]
                if target in members and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} holds no cycle")


def format_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([*steps, cycle[-1]])


def test_no_import_cycle():
    graph = import_graph(module_names())
    assert [format_cycle(graph, cycle) for cycle in import_cycles(graph)] == []


def test_the_cycle_check_sees_cycles_through_functions_type_checking_and_lazy_tables(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    files = {
        "__init__.py": "import importlib\n_LAZY = {'pkg.lazy': ['thing']}\n"
                       "def __getattr__(name):\n    return importlib.import_module(name)\n",
        "a.py": "from pkg import b\n",
        "b.py": "from typing import TYPE_CHECKING\nfrom pkg.c import C\n"
                "if TYPE_CHECKING:\n    from pkg import a\n",
        "c.py": "class C:\n    pass\n",
        "d.py": "from pkg import c\ndef f():\n    import pkg.e.inner\n",
        "e/__init__.py": "",
        "e/inner.py": "import pkg.d\n",
        "lazy.py": "from pkg import thing as other\n",
        "alone.py": "import json\nfrom pkg.c import C\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(exist_ok=True)
        (package / name).write_text(text, encoding="utf-8")
    graph = import_graph(module_names(("pkg",), repo=tmp_path))
    assert graph["pkg.b"] == {"pkg.c": 2, "pkg.a": 4}
    assert graph["pkg"] == {"pkg.lazy": 2}
    assert graph["pkg.alone"] == {"pkg.c": 2}
    cycles = import_cycles(graph)
    assert cycles == [
        ["pkg", "pkg.lazy", "pkg"], ["pkg.a", "pkg.b", "pkg.a"], ["pkg.d", "pkg.e.inner", "pkg.d"],
    ]
    assert format_cycle(graph, cycles[2]) == "pkg.d (line 3) -> pkg.e.inner (line 1) -> pkg.d"


def defined_names(tree: ast.Module) -> set[str]:
    """The names a module binds itself at import time (functions, classes, assignments), not by import."""
    names = set()
    for node in import_time_statements(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.For | ast.With):
            targets = node.targets if isinstance(node, ast.Assign) else [
                getattr(node, "target", None), *(i.optional_vars for i in getattr(node, "items", []))]
            for target in targets:
                for leaf in ast.walk(target) if target is not None else ():
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    return names


def internal_imports(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, tuple]:
    """The names ``module`` binds by a module-level ``from <known module> import name [as bound]``, names
    of modules left out: ``{bound: (source module, name, line)}``."""
    found = {}
    for node in import_time_statements(parse(path).body):
        if isinstance(node, ast.ImportFrom):
            source = absolute_module(node, module, path.name == "__init__.py")
            if source in known:
                for alias in node.names:
                    if f"{source}.{alias.name}" not in known and alias.name != "*":
                        found[alias.asname or alias.name] = (source, alias.name, node.lineno)
    return found


def listed_in_all(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            if isinstance(node.value, ast.List | ast.Tuple):
                return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def used_names(tree: ast.Module) -> set[str]:
    """Names the module reads anywhere (``__all__`` entries are strings, not reads)."""
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def module_aliases(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, str]:
    """Names a module binds to a known module (``import a.b as x``, ``from a import b``, ``import a``),
    anywhere in it."""
    aliases = {}
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    aliases[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in known:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = absolute_module(node, module, path.name == "__init__.py")
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def names_taken_from(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]):
    """``(source module, name, line)`` for every name ``module`` takes from another known module:
    ``from source import name`` anywhere in it, and ``alias.name`` / ``alias.sub.name`` attribute reads
    through a name bound to a module."""
    tree = parse(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute_module(node, module, path.name == "__init__.py")
            for alias in node.names:
                if source in known and f"{source}.{alias.name}" not in known:
                    yield source, alias.name, node.lineno
    aliases = module_aliases(module, path, known)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if not isinstance(inner, ast.Name) or inner.id not in aliases:
                continue
            target, chain = aliases[inner.id], chain[::-1]
            while chain and f"{target}.{chain[0]}" in known:
                target = f"{target}.{chain.pop(0)}"
            if chain:
                yield target, chain[0], node.lineno


def reexports(known: dict[str, pathlib.Path], documented: frozenset = DOCUMENTED_ALIASES) -> list[str]:
    """Names a module other than a package ``__init__`` hands on from another module: it imports the
    name from a module of ``known`` and lists it in ``__all__``, or never uses it itself (the import is
    only there to be imported through), or another module imports the name through it. Aliases in
    ``documented`` may stand (listed or unused), but nothing of ``known`` may import through them."""
    imported = {m: internal_imports(m, p, known) for m, p in known.items() if p.name != "__init__.py"}
    found = []
    for module, names in imported.items():
        tree = parse(known[module])
        listed, used = listed_in_all(tree), used_names(tree)
        for bound, (source, _, line) in sorted(names.items()):
            if (module, bound) in documented:
                continue
            if bound in listed:
                found.append(f"{module}:{line} lists {bound} (from {source}) in __all__")
            elif bound not in used:
                found.append(f"{module}:{line} imports {bound} from {source} only to hand it on")
    for importer, path in known.items():
        for source, name, line in names_taken_from(importer, path, known):
            if name in imported.get(source, {}):
                home = imported[source][name][0]
                found.append(f"{importer}:{line} takes {name} through {source} (it comes from {home})")
    return sorted(set(found))


def test_reexports_only_in_package_init_files():
    assert reexports(module_names()) == []


def test_the_reexport_check_sees_listed_unused_and_taken_through_names(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    files = {
        "__init__.py": "from pkg.home import Thing\n__all__ = ['Thing']\n",  # a package hands names on
        "home.py": "class Thing:\n    pass\ndef helper():\n    pass\nCONST = 1\n",
        "listed.py": "from pkg.home import Thing\n__all__ = ['Thing', 'own']\n"
                     "def own():\n    return Thing()\n",
        "unused.py": "from pkg.home import helper  # noqa: F401\n",
        "user.py": "from pkg.home import CONST\nX = CONST + 1\n",
        "through.py": "from pkg.user import CONST\nfrom pkg import user\n"
                      "def f():\n    return user.CONST + CONST\n",
        "alias.py": "from pkg.home import helper as helper  # its documented old path\n",
        "caller.py": "import pkg.alias as old\nfrom pkg import Thing\nZ = old.helper, Thing\n",
    }
    for name, text in files.items():
        (package / name).write_text(text, encoding="utf-8")
    known = module_names(("pkg",), repo=tmp_path)
    assert reexports(known, documented=frozenset({("pkg.alias", "helper")})) == [
        "pkg.caller:3 takes helper through pkg.alias (it comes from pkg.home)",
        "pkg.listed:1 lists Thing (from pkg.home) in __all__",
        "pkg.through:1 takes CONST through pkg.user (it comes from pkg.home)",
        "pkg.through:4 takes CONST through pkg.user (it comes from pkg.home)",
        "pkg.unused:1 imports helper from pkg.home only to hand it on",
    ]


def undocumented_aliases(aliases: frozenset, readme: str) -> list[str]:
    """The aliases whose old path (``package.module.name``, the ``rstar2jax.`` prefix optional) the README
    no longer mentions."""
    return sorted(f"{module}.{name}" for module, name in aliases
                  if f"{module.removeprefix('rstar2jax.')}.{name}" not in readme)


def test_documented_aliases_are_documented():
    """An alias stands only for an old path that the README or a docs page still documents."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    text = "\n".join(path.read_text(encoding="utf-8") for path in pages)
    assert undocumented_aliases(DOCUMENTED_ALIASES, text) == []


def test_the_alias_check_sees_an_alias_the_readme_does_not_name():
    aliases = frozenset({("rstar2jax.train.policy", "export_policy"), ("rstar2jax.a.b", "gone")})
    assert undocumented_aliases(aliases, "see `train.policy.export_policy`") == ["rstar2jax.a.b.gone"]


def test_every_name_a_package_offers_resolves():
    """Each name in a package's ``__all__`` loads (the lazy packages' tables name each name's home: a name
    that moved away from the module a table names fails here, not in a user's import)."""
    import importlib.util

    missing = []
    for package in (f"rstar2jax.{sub}" for sub in RANK):
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            try:
                getattr(module, name)
            except AttributeError as error:
                missing.append(f"{package}.{name}: {error}")
    missing += [f"rstar2jax.{name}" for name in rstar2jax.__all__
                if importlib.util.find_spec(f"rstar2jax.{name}") is None]  # star import loads these
    assert missing == []


# --- issue 49: rooms by concern with lazy faces; the config loads no JAX, the server no optimizer ---

#: Loaded-module probe run in a fresh interpreter: the module count and which heavy libraries are in.
MODULES_PROBE = (
    "import sys\n"
    "def report(label):\n"
    "    heavy = sorted(m for m in ('jax', 'optax', 'orbax', 'flax') if m in sys.modules)\n"
    "    ours = sum(m.startswith('rstar2jax') for m in sys.modules)\n"
    "    print(label, len(sys.modules), ours, ','.join(heavy) or '-')\n"
)


def fresh_modules(code: str) -> dict[str, tuple[int, int, str]]:
    """``label -> (modules, rstar2jax modules, heavy libraries loaded)`` for each ``report(label)`` that
    ``code`` (run after :data:`MODULES_PROBE` in a fresh interpreter) makes."""
    out = subprocess.run([sys.executable, "-c", MODULES_PROBE + code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    return {label: (int(n), int(ours), heavy) for label, n, ours, heavy in (line.split() for line in
                                                                           out.splitlines())}


def test_importing_the_config_loads_no_jax():
    found = fresh_modules(
        "import rstar2jax.config\nreport('config')\n"
        "import rstar2jax.config.vocabulary, rstar2jax.config.checks\nreport('tables')\n"
    )
    assert found["config"][2] == "-" and found["tables"][2] == "-"


def test_importing_the_server_and_the_policy_loader_loads_no_optimizer_and_no_checkpointer():
    """``import rstar2jax.serve`` loads no JAX; its server and the policy loader load JAX and Flax but no
    optax and no orbax (a run folder's checkpoint is read with orbax, imported then); nor does the trainer's
    package face."""
    found = fresh_modules(
        "import rstar2jax.serve\nreport('serve')\n"
        "import rstar2jax.train, rstar2jax.policy, rstar2jax.schedules\nreport('faces')\n"
        "import rstar2jax.serve.server, rstar2jax.policy.loader\nreport('server')\n"
    )
    assert found["serve"][2] == "-" and found["faces"][2] == "-"
    assert found["server"][2] == "flax,jax"


def test_the_old_paths_the_readme_documents_still_import():
    from rstar2jax import config, policy, schedules, train
    from rstar2jax.config import loss_config, parse
    from rstar2jax.policy import export
    from rstar2jax.train import dry_run_report
    from rstar2jax.train import export as old_export
    from rstar2jax.train import policy as old_policy

    assert train.parse is parse.parse and train.RunOptions is config.RunOptions
    assert train.RLLossConfig is loss_config.RLLossConfig is config.RLLossConfig
    assert old_export.export_policy is old_policy.export_policy is export.export_policy
    assert policy.export_policy is export.export_policy
    assert train.make_schedule is schedules.make_schedule and train.lora.FrozenBase.__name__ == "FrozenBase"
    assert train.rollouts.policy_rollout.__name__ == "policy_rollout"
    assert train.dry_run is dry_run_report.dry_run  # the function, also once its module is imported
    assert {"config", "policy", "schedules"} <= set(rstar2jax.__all__)
