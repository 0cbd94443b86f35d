"""Computes the package list so a wheel holds every subpackage of the mapped folders.

setuptools' automatic discovery does not follow the `package-dir` mapping
(`envs/` -> `relax_gym.envs`), and a subpackage missing from `packages` imports
fine in an editable install but is absent from the wheel.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"relax_gym": "relax_gym", "relax_gym.envs": "envs", "relax_gym.trainer": "trainer"}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            if name == "relax_gym" and rel and rel[0] in ("envs", "trainer"):
                continue
            found.append(".".join((name, *rel)))
    return found


setup(packages=_packages())
