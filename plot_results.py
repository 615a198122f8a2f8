"""Charts and summary.md from PREFIX/results.csv and PREFIX/runs.csv (no torch): make plots PREFIX=dir."""
import sys

from Utils.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
