"""`python -m bench.e2e`: the study's one entry point (bench/e2e/study.py)."""

import sys

from bench import guard
from bench.e2e.study import main

if __name__ == "__main__":
    sys.argv[0] = "python -m bench.e2e"  # argparse's prog in --help and errors, not "__main__.py"
    guard.main(main)
