"""`python -m benchmarks SCENARIO ...` (see benchmarks/cli.py); `python -m benchmarks pods ...` (benchmarks/pods.py)."""

import sys

if sys.argv[1:2] == ["pods"]:
    from benchmarks.pods import main as pods_main

    sys.exit(pods_main(sys.argv[2:]))

from benchmarks.cli import main

sys.exit(main())
