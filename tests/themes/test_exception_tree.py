"""The exception tree drawn in `relax_gym.errors`' docstring is the real one: every class, its base, its module."""

import ast
import builtins
import importlib

from support.layout import package_modules

import relax_gym.errors

EXTERNAL_BASES = {"gymnasium.error.Error"}  # a second base the drawing notes in words


def drawn_tree() -> dict[str, tuple[str, str | None, str | None]]:
    """name -> (drawn parent, defining module, re-exporting module) for each line of the drawing."""
    doc = relax_gym.errors.__doc__ or ""
    lines = [line for line in doc.splitlines() if line.startswith("    ")]
    assert lines and lines[0].strip() == "Exception", "the tree starts at Exception"
    tree: dict[str, tuple[str, str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        words = line.split()
        name = words[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        module = words[1] if len(words) > 1 and words[1].startswith("relax_gym") else None
        reexport = words[2].strip("[]") if len(words) > 2 and words[2].startswith("[") else None
        assert name not in tree, f"{name} is drawn twice"
        tree[name] = (stack[-1][1] if stack else "", module, reexport)
        stack.append((indent, name))
    return tree


def defined_exceptions() -> dict[str, tuple[str, set[str]]]:
    """name -> (module, base names) for every exception class defined at module level in the package."""
    classes: dict[str, tuple[str, list[str]]] = {}
    twice: set[str] = set()
    for module, path in package_modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                if node.name in classes:
                    twice.add(node.name)
                classes[node.name] = (module, [ast.unparse(b) for b in node.bases])

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if isinstance(getattr(builtins, name, None), type) and issubclass(getattr(builtins, name), BaseException):
            return True
        if name in EXTERNAL_BASES:
            return True
        if name in classes and name not in seen:
            return any(is_exception(b.rsplit(".", 1)[-1] if b not in EXTERNAL_BASES else b, seen | {name})
                       for b in classes[name][1])
        return False

    found = {name: (module, {b.rsplit(".", 1)[-1] for b in bases if b not in EXTERNAL_BASES})
             for name, (module, bases) in classes.items() if not hasattr(builtins, name) and is_exception(name)}
    assert not twice & set(found), f"exception names defined twice (the drawing names each once): {twice & set(found)}"
    return found


def test_every_exception_is_drawn_once_under_its_base_with_its_module():
    tree, defined = drawn_tree(), defined_exceptions()
    drawn_ours = {name for name, (_, module, _) in tree.items() if module}
    assert drawn_ours == set(defined)
    for name, (parent, module, _) in tree.items():
        if module is None:
            assert isinstance(getattr(builtins, name, None), type), f"{name} is drawn without its module"
            assert not parent or issubclass(getattr(builtins, name), getattr(builtins, parent)), name
            continue
        assert defined[name][0] == module, f"{name} lives in {defined[name][0]}, not {module}"
        assert parent in defined[name][1], f"{name}'s base is one of {defined[name][1]}, not {parent}"


def test_the_drawn_re_exports_are_the_same_classes():
    for name, (_, module, reexport) in drawn_tree().items():
        if module and reexport:
            cls = getattr(importlib.import_module(module), name)
            assert getattr(importlib.import_module(reexport), name) is cls, f"{reexport}.{name}"
