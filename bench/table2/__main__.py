"""`python -m bench.table2`: the study's one entry point (bench/table2/study.py)."""

import sys

from bench import guard
from bench.table2.study import main

if __name__ == "__main__":
    sys.argv[0] = "python -m bench.table2"  # argparse's prog in --help and errors, not "__main__.py"
    guard.main(main)
