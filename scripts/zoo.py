"""Run the model zoo: the same as ``lpx-tvm zoo`` (see ``--help``)."""

import sys

from lpx_tvm.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["zoo", *sys.argv[1:]]))
