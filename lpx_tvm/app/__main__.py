"""``python -m lpx_tvm.app`` is the ``lpx-tvm`` command."""

import sys

from .cli import main

sys.exit(main())
