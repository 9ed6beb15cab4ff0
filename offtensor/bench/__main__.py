"""`python -m offtensor.bench`: see offtensor/bench/cli.py and docs/benchmarks.md."""

import sys

from .cli import main

sys.exit(main())
