"""`python -m app.cli ...`: the `flywheel` command (torchrun and subprocesses start it so)."""

import sys

from app.cli.main import main

sys.exit(main())
