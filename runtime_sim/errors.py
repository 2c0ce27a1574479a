"""The root of every exception lpx-tvm raises, split by whose mistake it is.

Every exception class of the package derives from :class:`LpxError`, through one
of its two branches:

- :class:`LpxUserError`: the input or the request is wrong, unsupported, or does
  not fit; the message says what to change. It is also a ``ValueError``, which is
  what most of these were before they had a root.
- :class:`LpxInternalError`: lpx-tvm itself went wrong (the compiler emitted what
  the machine rejects, a rewrite lost a transfer); no input fixes it. It is also a
  ``RuntimeError``.

The classes live here, in the lowest layer, so that the simulator can raise them
without importing the compiler or TVM; ``lpx_tvm`` re-exports them.
"""

from __future__ import annotations

__all__ = ["LpxError", "LpxUserError", "LpxInternalError"]


class LpxError(Exception):
    """Any error raised by lpx-tvm.

    Catch this to handle everything the package raises on purpose; an exception
    that is not an ``LpxError`` escaped from a library underneath or from a bug.
    """


class LpxUserError(LpxError, ValueError):
    """A mistake the user can fix: bad input, an unsupported request, a model that does not fit.

    The ``lpx-tvm`` command prints it as one line and exits with status 1.
    """


class LpxInternalError(LpxError, RuntimeError):
    """A bug in lpx-tvm's compiler or simulator, not in what it was given.

    The ``lpx-tvm`` command prints it as one line naming it an internal error, with
    a hint to rerun with ``--debug`` for the traceback.
    """
