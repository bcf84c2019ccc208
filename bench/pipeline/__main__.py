"""`python -m bench.pipeline`: the study's one entry point (bench/pipeline/study.py)."""

import sys

from bench import guard
from bench.pipeline.study import main

if __name__ == "__main__":
    sys.argv[0] = "python -m bench.pipeline"  # argparse's prog in --help and errors, not "__main__.py"
    guard.main(main)
