"""Computes the package list so a wheel holds every subpackage of the mapped folders.

setuptools' automatic discovery does not follow the `package-dir` mapping
(`envs/` -> `relax_gym.envs`), and a subpackage missing from `packages` imports
fine in an editable install but is absent from the wheel. The shipped data
folders are declared as data-only packages, which is what setuptools expects
of folders inside a package (otherwise it warns that they would be ignored).
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


def _data_packages() -> dict[str, list[str]]:
    data = Path("envs") / "data"
    folders = [data, *sorted(p for p in data.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {".".join(("relax_gym.envs", *f.relative_to("envs").parts)): ["*"] for f in folders}


DATA = _data_packages()
setup(packages=_packages() + list(DATA), package_data=DATA)
