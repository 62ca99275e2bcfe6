"""Command-line pieces shared by the benchmark modules that run on their own
(``bench.linear_head``, ``bench.sampling``)."""

from __future__ import annotations

import argparse
import json


def add_common_args(parser):
    """--reps, --json, --md, and the hidden --probe of the memory-probe subprocess."""
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case (default 5)")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    parser.add_argument("--md", default=None, help="also write the Markdown table to this file")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)


def write_outputs(args, report, table):
    """Print the table; write the report and the table where --json / --md ask."""
    print(table)
    for path, text in ((args.json, json.dumps(report, indent=1)), (args.md, table)):
        if path:
            with open(path, "w") as f:
                f.write(text)
