"""Operands of tile ops: strided views of graph tensors, and chained streams.

A tile op names its operands before anything has an address: an
:class:`Operand` is a view (shape, byte offset, element strides) of a graph
tensor, or a chained stream between a producer and its consumer. ``alloc``
gives tensors addresses, ``schedule`` gives streams their numbers, and ``emit``
turns both into the ISA's ``TensorRef``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np


def dense_strides(shape) -> tuple:
    out, step = [], 1
    for d in reversed(tuple(shape)):
        out.append(step)
        step *= d
    return tuple(reversed(out))


@dataclass(frozen=True)
class Operand:
    """A view of graph tensor ``tensor`` (``offset`` bytes into its base), or a chained stream.

    ``stream`` is set for a chained operand: the id of the chain (unique within
    a compilation; schedule picks the physical stream), with ``dtype`` its
    element type.
    """

    tensor: int | None
    shape: tuple
    offset: int = 0
    strides: tuple | None = None
    stream: int | None = None
    dtype: np.dtype | None = None

    @property
    def size(self) -> int:
        return prod(self.shape)


def view(g, tid: int, shape=None, index=(), ranges=(), perm=None) -> Operand:
    """A view of tensor ``tid``, seen with ``shape`` (a reshape of it).

    ``index`` fixes its leading axes (they disappear), ``ranges`` slices the next
    ones ``[(start, stop), ...]``, then ``perm`` permutes what is left.
    """
    shape = tuple(shape or g.tensors[tid].shape)
    strides = list(dense_strides(shape))
    item = np.dtype(g.tensors[g.base(tid)].dtype).itemsize
    offset = sum(i * st for i, st in zip(index, strides)) * item
    out, strides = list(shape[len(index):]), strides[len(index):]
    for axis, (start, stop) in enumerate(ranges):
        offset += start * strides[axis] * item
        out[axis] = stop - start
    if perm is not None:
        out = [out[p] for p in perm]
        strides = [strides[p] for p in perm]
    strides = tuple(strides)
    return Operand(tid, tuple(out), offset, None if strides == dense_strides(out) else strides)


def transposed(op: Operand) -> Operand:
    """The same 2-D view with its axes swapped."""
    strides = op.strides or dense_strides(op.shape)
    out = (op.shape[1], op.shape[0])
    swapped = (strides[1], strides[0])
    return Operand(op.tensor, out, op.offset, None if swapped == dense_strides(out) else swapped, op.stream,
                   op.dtype)


def whole(g, tid: int, shape=None) -> Operand:
    """All of tensor ``tid``, seen with ``shape`` (a reshape) when given."""
    return Operand(tid, tuple(shape or g.tensors[tid].shape))


def stream(chain: int, shape, dtype) -> Operand:
    """A chained stream carrying a ``shape`` result of ``dtype``."""
    return Operand(None, tuple(shape), stream=chain, dtype=np.dtype(dtype))
