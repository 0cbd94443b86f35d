"""The package's modules as the layout maps them (`[tool.setuptools.package-dir]`, read by
scripts/package_tree.py): `relax_gym/`, and the top-level `envs/` and `trainer/` as `relax_gym.envs` and
`relax_gym.trainer`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("package_tree", ROOT / "scripts" / "package_tree.py")
assert _spec is not None and _spec.loader is not None
package_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package_tree)
package_folders = package_tree.package_folders


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name, and its source file."""
    modules: dict[str, Path] = {}
    for package, folder in package_folders().items():
        if (folder / "__init__.py").is_file():
            modules[package] = folder / "__init__.py"
            modules.update({f"{package}.{f.stem}": f for f in sorted(folder.glob("*.py")) if f.stem != "__init__"})
    return modules
