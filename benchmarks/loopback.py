"""Is commsched ever slower than torch DDP? Both on this machine's loopback, at 2 and 4 ranks.

    .venv/bin/python benchmarks/loopback.py --json results/loopback.json     # about 10 minutes on 2 cores

The comparison is `commsched.bench.loopback` (its docstring says what it measures); ``--help``
lists the options.
"""

import sys

from commsched.bench.loopback import main

if __name__ == "__main__":
    sys.exit(main())
