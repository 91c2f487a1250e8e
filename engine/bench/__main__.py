"""`python -m engine.bench MODE ...` (what bin/bench runs)."""

import sys

from engine.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
