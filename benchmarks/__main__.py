"""``python -m benchmarks [options]``: the benchmark's command line (see :mod:`benchmarks`)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
