"""Per-step overhead report: the same as `skippy-scheduler bench` (see BENCHMARKS.md).

    python bench/overhead.py [--quick] [--no-twin] [--no-c]
"""
import sys

from skippy_scheduler.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
