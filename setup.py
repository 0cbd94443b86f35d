"""Computes the package list so a wheel holds every subpackage, including those behind the symlinks.

`relax_gym/envs` and `relax_gym/trainer` are symlinks to the top-level `envs/`
and `trainer/` folders (see pyproject.toml); in an sdist they are real folders.
The walk follows links, so both build the same wheel, and a new subpackage
needs no edit here. The shipped data folders are declared as data-only
packages, which is what setuptools expects of folders inside a package
(otherwise it warns that they would be ignored); `py.typed` marks the package
as typed (PEP 561).
"""

import os
from pathlib import Path

from setuptools import setup

PACKAGE = "relax_gym"


def _packages() -> list[str]:
    found = []
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        if "__init__.py" in files:
            found.append(".".join(Path(folder).parts))
    return sorted(found)


def _data_packages() -> dict[str, list[str]]:
    data = Path(PACKAGE) / "envs" / "data"
    folders = [data, *sorted(Path(f) for f, _, _ in os.walk(data, followlinks=True) if Path(f) != data)]
    return {".".join(f.parts): ["*"] for f in folders if f.name != "__pycache__"}


DATA = _data_packages()
setup(packages=_packages() + list(DATA), package_data={PACKAGE: ["py.typed"], **DATA})
