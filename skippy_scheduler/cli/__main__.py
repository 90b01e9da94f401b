"""`python -m skippy_scheduler.cli`: the same as the `skippy-scheduler` command."""
import sys

from . import main

sys.exit(main())
