"""`python -m bench.allocation`: the study's one entry point (bench/allocation/study.py)."""

import sys

from bench import guard
from bench.allocation.study import main

if __name__ == "__main__":
    sys.argv[0] = "python -m bench.allocation"  # argparse's prog in --help and errors, not "__main__.py"
    guard.main(main)
