"""accelerate 1.15.0's public names, read from its wheel's source with `ast` (accelerate is never imported).

A name is a dotted path below the package, the same in accelerate and in notebook_accel:
`Accelerator` (the package's own namespace), `utils.gather`, `utils.operations.gather`,
`accelerator.Accelerator.profile` (a public method or property of one of the four facade classes).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
from conformance import wheel  # noqa: E402  (a package: a bare `wheel` would shadow the real one)

# The namespaces whose `from .x import a` lines make accelerate's public API ("" is the package).
PACKAGES = ("", "utils")
# The modules whose own top-level definitions are public API.
MODULES = (
    "state",
    "accelerator",
    "data_loader",
    "hooks",
    "big_modeling",
    "utils.operations",
    "utils.modeling",
    "utils.dataclasses",
    "utils.memory",
    "utils.random",
    "launchers",
    "local_sgd",
    "inference",
    "logging",
    "tracking",
)
# The classes whose public methods and properties are API: {module: classes}.
CLASSES = {
    "accelerator": ("Accelerator",),
    "state": ("PartialState", "AcceleratorState", "GradientState"),
}


def _tree(module: str) -> ast.Module:
    path = wheel.source(module)
    if not path.exists():
        raise FileNotFoundError(f"accelerate {wheel.VERSION}'s wheel has no module {module!r} ({path})")
    return ast.parse(path.read_text(), filename=str(path))


def _top_level(body: list) -> list:
    """The statements run at import: the module body and the bodies of its `if` / `try` blocks."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


def _public(name: str) -> bool:
    return not name.startswith("_")


def package_names(package: str) -> set:
    """Names a package's __init__ imports from accelerate's own modules (relative imports)."""
    names = set()
    for node in _top_level(_tree(package).body):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            for alias in node.names:
                name = alias.asname or alias.name
                if _public(name):
                    names.add(name)
    return names


def _is_constant_name(name: str) -> bool:
    return name.isupper() and _public(name)


def module_names(module: str) -> set:
    """A module's own public functions and classes, and its UPPER_CASE constants."""
    names = set()
    for node in _top_level(_tree(module).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _public(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name) and _is_constant_name(t.id)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_constant_name(node.target.id):
                names.add(node.target.id)
    return names


def class_members(module: str, cls: str) -> set:
    """A class's public methods and properties, as defined in its body."""
    for node in _tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                item.name
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(item.name)
            }
    raise LookupError(f"accelerate {wheel.VERSION}'s {module} defines no class {cls}")


def public_names() -> set:
    """Every public name of accelerate, as a dotted path below the package."""
    names = set()
    for package in PACKAGES:
        prefix = f"{package}." if package else ""
        names |= {prefix + n for n in package_names(package)}
    for module in MODULES:
        names |= {f"{module}.{n}" for n in module_names(module)}
    for module, classes in CLASSES.items():
        for cls in classes:
            names |= {f"{module}.{cls}.{n}" for n in class_members(module, cls)}
    return names


def module_of(name: str) -> str:
    """The namespace a name is counted under: "" (the package), "utils", a module, or a class."""
    for module, classes in CLASSES.items():
        for cls in classes:
            if name.startswith(f"{module}.{cls}."):
                return f"{module}.{cls}"
    head = name.rpartition(".")[0]
    return head


def resolve(name: str, package: str = "notebook_accel") -> bool:
    """`package.<name>` exists: the longest importable module prefix, then attributes (on a class,
    the class's own: a method or property, not an instance attribute)."""
    parts = name.split(".")
    for split in range(len(parts), -1, -1):
        module_name = ".".join([package, *parts[:split]])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
                continue  # that module is not ours: try a shorter prefix
            raise
        for part in parts[split:]:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                return False
        return True
    return False
