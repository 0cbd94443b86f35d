"""`python -m relax_gym.cli`: the `relax-gym` command where the console script is not on PATH (torchrun's `-m`)."""

import sys

from relax_gym.cli import main

if __name__ == "__main__":  # importing it (every module is, by the wheel test) runs nothing
    sys.exit(main())
