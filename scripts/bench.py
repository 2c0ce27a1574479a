"""Benchmark the flow itself: the same as ``lpx-tvm bench`` (see ``--help``).

    python scripts/bench.py [--models resnet50 bert_encoder ppocr_rec] [--repeat 10] [--json out.json]
"""

import sys

from lpx_tvm.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
