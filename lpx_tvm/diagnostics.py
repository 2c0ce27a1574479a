"""TVM's native chatter kept away from the user: its C++ log lines go to the ``lpx_tvm`` debug log.

TVM prints from C++ straight to file descriptor 2 (``Warning: Fast mode
segfaults when there are out-of-bounds indices``, ``BlockBuilder destroyed with
remaining blocks``, whole IR dumps on an importer error). Those lines say
nothing a user of lpx can act on, so :func:`native_output_to_log` catches them
at the descriptor and hands them to ``logging``; ``lpx-tvm --debug`` (or a
``DEBUG`` level on the ``lpx_tvm`` logger) lets them through as they happen.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading

LOG = logging.getLogger("lpx_tvm")
_LOCK = threading.RLock()  # the descriptor is the process's: one capture at a time
_DEPTH = [0]


@contextlib.contextmanager
def native_output_to_log(what: str):
    """Within the block, what native code writes to stderr is logged at DEBUG as ``what: line``."""
    if LOG.isEnabledFor(logging.DEBUG):
        yield
        return
    with _LOCK:
        if _DEPTH[0]:  # already captured further out
            yield
            return
        _DEPTH[0] += 1
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with tempfile.TemporaryFile(mode="w+b") as sink, _python_stderr_on(saved):
                os.dup2(sink.fileno(), 2)
                try:
                    yield
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
                    sink.seek(0)
                    for line in sink.read().decode(errors="replace").splitlines():
                        if line.strip():
                            LOG.debug("%s: %s", what, line)
        finally:
            os.close(saved)
            _DEPTH[0] -= 1


@contextlib.contextmanager
def _python_stderr_on(fd: int):
    """Python's own stderr (warnings, progress) keeps writing where it did, on a copy of ``fd``."""
    try:
        writes_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, ValueError, OSError):  # replaced by a capture that has no descriptor
        writes_fd2 = False
    if not writes_fd2:
        yield
        return
    original = sys.stderr
    sys.stderr = open(os.dup(fd), "w", buffering=1, encoding=original.encoding, errors="backslashreplace")
    try:
        yield
    finally:
        sys.stderr.close()
        sys.stderr = original
