"""`python -m bench.throughput`: the study's one entry point (bench/throughput/study.py)."""

import sys

from bench import guard
from bench.throughput.study import main

if __name__ == "__main__":
    sys.argv[0] = "python -m bench.throughput"  # argparse's prog in --help and errors, not "__main__.py"
    guard.main(main)
