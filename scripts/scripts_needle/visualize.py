#!/usr/bin/env python
"""Needle-in-a-haystack heatmaps (the module is pyramidkv.viz.needle; its docstring lists the usage).

    python scripts/scripts_needle/visualize.py RUN_DIR [--metric METRIC] [--out PNG] [--annotate]
    python scripts/scripts_needle/visualize.py --grid RUN_DIR1 RUN_DIR2 ... [--out PNG]
"""

import sys

import matplotlib

matplotlib.use("Agg")  # draws to files only

from pyramidkv.viz.needle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
