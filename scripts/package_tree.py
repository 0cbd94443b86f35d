"""The package laid out as it installs, as a tree of links to a source tree's files: `relax_gym/`, with the
top-level `envs/` and `trainer/` inside it as `relax_gym/envs` and `relax_gym/trainer`, as
`[tool.setuptools.package-dir]` maps them (read through that tree's setup.py, `package_folders`).

For what cannot use an install: mypy (which cannot follow an editable install's import hook,
scripts/typecheck.py), a checkout run from PYTHONPATH (scripts/gpu_check.sh with wheels, a benchmark's baseline
worktree). A new file in the source needs the tree made again.

    python scripts/package_tree.py DEST [--root SOURCE_TREE]    # prints DEST, the folder to put on sys.path
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Every folder of `root`'s package by dotted name (packages, and the data folders under them)."""
    spec = importlib.util.spec_from_file_location(f"setup_of_{abs(hash(root))}", root / "setup.py")
    assert spec is not None and spec.loader is not None
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # its setup() runs only as __main__
    folders: dict[str, Path] = setup.package_folders()
    return folders


def make_tree(dest: Path, root: Path = ROOT, *, code_only: bool = False) -> Path:
    """`dest` remade as the package's tree of links (with `code_only`, its Python files alone); returns `dest`."""
    shutil.rmtree(dest, ignore_errors=True)
    for name, folder in package_folders(root).items():
        if code_only and not (folder / "__init__.py").is_file():
            continue  # data
        target = dest.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in folder.iterdir():
            if source.is_file() and (not code_only or source.suffix in (".py", ".pyi") or source.name == "py.typed"):
                (target / source.name).symlink_to(source)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: this one)")
    args = parser.parse_args()
    print(make_tree(args.dest.resolve(), args.root.resolve()))


if __name__ == "__main__":
    main()
