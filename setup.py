"""Lists the packages from the layout `[tool.setuptools.package-dir]` in pyproject.toml maps, so a wheel holds
every subpackage and a new one needs no edit anywhere.

`relax_gym/` is the core; the top-level `envs/` and `trainer/` folders are `relax_gym.envs` and `relax_gym.trainer`.
The shipped data folders (no `__init__.py`) are declared as data-only packages, which is what setuptools expects of
folders inside a package (otherwise it warns that they would be ignored); `py.typed` marks the package as typed
(PEP 561). The tests and scripts/typecheck.py read the layout through `package_folders` here: one home.
"""

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE = "relax_gym"


def mapping() -> dict[str, Path]:
    """Each mapped package name and its folder."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return {name: ROOT / folder for name, folder in tomllib.load(f)["tool"]["setuptools"]["package-dir"].items()}


def package_folders() -> dict[str, Path]:
    """Every folder of the layout by dotted name: the packages, and the data folders under them."""
    found = {}
    for name, root in mapping().items():
        for folder, dirs, _ in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found[".".join([name, *Path(folder).relative_to(root).parts])] = Path(folder)
    return found


if __name__ == "__main__":
    from setuptools import setup

    folders = package_folders()
    packages = sorted(name for name, folder in folders.items() if (folder / "__init__.py").is_file())
    data = {name: ["*"] for name in sorted(folders) if name not in packages}
    setup(packages=packages + list(data), package_data={PACKAGE: ["py.typed"], **data})
