"""The API reference's two helpers: a griffe extension that reads a module constant's ``#:`` comment as its
docstring (the project documents constants that way; mkdocstrings only sees string literals), and the check
that every public name of the library has a docstring (``tests/test_docs.py``; the site hides names without
one, so a missing docstring is a name missing from the reference).

Public names: each package's ``__all__`` (``rstar2jax.data``, which has none, hands its modules on: their
public names), and ``sandbox_server``'s.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import griffe

import rstar2jax

#: Packages whose ``__all__`` is the public API (``rstar2jax.data`` is read module by module).
API_PACKAGES = (
    *(f"rstar2jax.{info.name}" for info in pkgutil.iter_modules(rstar2jax.__path__) if info.ispkg),
    "sandbox_server",
)


class CommentDocstrings(griffe.Extension):
    """A module attribute without a docstring takes the ``#:`` comment lines right above it (Sphinx's
    convention, used throughout the library)."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs) -> None:
        if attr.docstring is not None or attr.lineno is None or not attr.parent or not attr.parent.is_module:
            return
        lines = attr.parent.lines
        comment, index = [], attr.lineno - 2
        while index >= 0 and lines[index].lstrip().startswith("#:"):
            comment.insert(0, lines[index].lstrip()[2:].strip())
            index -= 1
        if comment:
            attr.docstring = griffe.Docstring("\n".join(comment), lineno=index + 2, parent=attr)


def public_names() -> dict[str, list[str]]:
    """package or module path -> its public names."""
    names = {}
    for package in API_PACKAGES:
        module = importlib.import_module(package)
        if hasattr(module, "__all__"):
            names[package] = list(module.__all__)
            continue
        for info in pkgutil.iter_modules(module.__path__):
            sub = importlib.import_module(f"{package}.{info.name}")
            names[sub.__name__] = [
                name for name, value in vars(sub).items()
                if not name.startswith("_") and getattr(value, "__module__", None) == sub.__name__
            ]
    return names


def _definitions(tree: griffe.Module) -> dict[str, list[str]]:
    """name -> the modules that define it (not import it), over the whole tree."""
    found: dict[str, list[str]] = {}
    modules = [tree]
    while modules:
        module = modules.pop()
        for name, member in module.members.items():
            if member.is_alias:
                continue
            found.setdefault(name, []).append(module.path)
            if member.is_module:
                modules.append(member)
    return found


def load_trees() -> dict[str, griffe.Module]:
    """The library's and the sandbox's sources as griffe (and so mkdocstrings) reads them."""
    loader = griffe.GriffeLoader(search_paths=["."], extensions=griffe.load_extensions(CommentDocstrings))
    return {root: loader.load(root) for root in ("rstar2jax", "sandbox_server")}


def api_entries(trees: dict[str, griffe.Module]) -> dict[str, list[tuple[str, str | None]]]:
    """package or module path -> (public name, the path of the object that defines it, or None when no
    module the sources define binds that very object to that name)."""
    index = {root: _definitions(tree) for root, tree in trees.items()}
    entries = {}
    for path, names in public_names().items():
        module = importlib.import_module(path)
        rows = []
        for name in names:
            value = getattr(module, name)
            rows.append((name, _definition(index[path.split(".")[0]], name, value)))
        entries[path] = rows
    return entries


def _definition(index: dict[str, list[str]], name: str, value) -> str | None:
    # A function or class imported under another name (``masked as masked_values``) is its own name in the
    # module that defines it; anything else is found among the modules that define ``name``.
    named = isinstance(value, type) or inspect.isroutine(value)
    own_name = getattr(value, "__name__", name) if named else name
    if own_name != name:
        candidates, name = [value.__module__], own_name
    else:
        candidates = index.get(name, [])
    for candidate in candidates:
        if getattr(importlib.import_module(candidate), name, None) is value:
            return f"{candidate}.{name}"
    return None


def undocumented() -> list[str]:
    """Every public name the reference cannot show with a docstring (as griffe, with
    :class:`CommentDocstrings`, reads the source that defines it)."""
    trees = load_trees()
    missing = []
    for path, rows in api_entries(trees).items():
        for name, where in rows:
            if where is None or not _docstring(trees, where):
                missing.append(f"{path}.{name}" + ("" if where else " (no definition found)"))
    return missing


def _docstring(trees, path: str) -> str:
    root, *parts = path.split(".")
    obj = trees[root]
    for part in parts:
        obj = obj.members[part]
    return obj.docstring.value.strip() if obj.docstring else ""
