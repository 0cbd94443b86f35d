"""Type-checks the package as it installs: mypy over `build/typecheck/relax_gym`, the package's Python files laid
out as links by scripts/package_tree.py (`relax_gym/envs` is the top-level `envs/`, and so on).

mypy finds modules by folder, and an editable install reaches `relax_gym.envs` and `relax_gym.trainer` through
setuptools' import hook, which mypy cannot follow; so it reads this tree, remade on each run (git, ruff and
ripgrep ignore build/). Errors name the tree's paths: `build/typecheck/relax_gym/trainer/loop.py` is
`trainer/loop.py`.

    python scripts/typecheck.py [MYPY ARGS...]    # settings: pyproject.toml [tool.mypy]
"""

from __future__ import annotations

import subprocess
import sys

from package_tree import ROOT, make_tree


def main(argv: list[str]) -> int:
    make_tree(ROOT / "build" / "typecheck", code_only=True)
    return subprocess.call([sys.executable, "-m", "mypy", *argv], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
