"""The LPX operator graph: what ``lower`` produces and ``tile`` consumes.

No TVM types live past lowering. A tensor is a shape, a numpy dtype and, for
constants, its data; a reshape is an alias (same bytes, another shape), so it
costs no instruction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from math import prod

import numpy as np


@dataclass
class Tensor:
    shape: tuple
    dtype: np.dtype
    data: np.ndarray | None = None  # set for constants (weights)
    alias_of: int | None = None     # set for reshapes: the tensor whose bytes these are

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


class NodeKind(str, Enum):
    """The operator graph's compound kinds: each is tiled into many instructions (``tile``'s table). Any other
    node's kind is the name of the one LPX opcode it runs as (``"ADD"``, ``"SOFTMAX"``: the ISA's op table).
    A member equals its value, so a kind read from a dump compares as it is written."""

    CONV2D = "conv2d"
    QCONV2D = "qconv2d"  # on int8 operands, its scales in the epilogue
    MATMUL = "matmul"
    QMATMUL = "qmatmul"
    ALLGATHER = "allgather"
    ALLREDUCE = "allreduce"
    ALLTOALL = "alltoall"
    BROADCAST = "broadcast"
    NARROW = "narrow"  # a tensor parallel shard's padded columns cut back
    SEND = "send"  # a pipeline stage's transfer to another chip
    RECV = "recv"

    def __str__(self) -> str:
        return self.value


PRODUCTS = frozenset({NodeKind.MATMUL, NodeKind.QMATMUL})
CONVOLUTIONS = frozenset({NodeKind.CONV2D, NodeKind.QCONV2D})
QUANTIZED = frozenset({NodeKind.QMATMUL, NodeKind.QCONV2D})
WEIGHTED = PRODUCTS | CONVOLUTIONS  # the kinds with a weight operand (input 1)
COLLECTIVES = frozenset({NodeKind.ALLGATHER, NodeKind.ALLREDUCE, NodeKind.ALLTOALL, NodeKind.BROADCAST})
TRANSFERS = frozenset({NodeKind.SEND, NodeKind.RECV})


@dataclass
class Node:
    """One LPX operator: a :class:`NodeKind`, or the name of an LPX opcode that runs as a single instruction
    (``"ADD"``, ``"SOFTMAX"``, ...)."""

    kind: str
    inputs: list
    output: int
    attrs: dict = field(default_factory=dict)
    layer: str = ""


@dataclass
class Graph:
    tensors: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    streamed: list = field(default_factory=list)  # weight tiles kept in host memory (tile decides)
    # constants that were dequantised from integers: tensor id -> (q, scale, zero_point), the last two
    # with q's rank (size-1 axes broadcast), so that int8 kernels can use the integers themselves
    quantized: dict = field(default_factory=dict)
    state: set = field(default_factory=set)  # inputs resident from call to call (a KV cache): never LOADed
    host_dtype: dict = field(default_factory=dict)  # input id -> the host's dtype where it differs (state)
    # input id -> (scale, zero point): the host converts the caller's fp32 to the input's narrower type (an
    # integer one by QuantizeLinear, a float one by rounding: scale 1, zero point 0) before the link
    host_converted: dict = field(default_factory=dict)
    widened: dict = field(default_factory=dict)  # output id -> (scale, zero point): the host widens it to fp32

    def is_resident(self, tid: int) -> bool:
        """A constant, or resident state: placed once, never freed, never written by the program."""
        base = self.base(tid)
        return self.tensors[base].data is not None or base in self.state

    def add_tensor(self, shape, dtype, data=None, alias_of=None) -> int:
        self.tensors.append(Tensor(tuple(int(d) for d in shape), np.dtype(str(dtype)), data, alias_of))
        return len(self.tensors) - 1

    def constant(self, array: np.ndarray, dtype=None) -> int:
        """A constant tensor of ``array``'s type, or of ``dtype``: a float32 tensor may keep float16 data (a
        weight the model stores in fp16 and widens exactly), which ``lower_precision`` stores as it is in
        fp16 and widens for fp32, so that no fp32 copy of the weights is ever made."""
        array = np.asarray(array)
        dtype = array.dtype if dtype is None else np.dtype(str(dtype))
        if array.dtype != dtype and not (dtype == np.float32 and array.dtype == np.float16):
            array = array.astype(dtype)
        if not array.flags.c_contiguous:  # not np.ascontiguousarray: it turns a 0-d scalar into shape (1,)
            array = array.copy(order="C")
        return self.add_tensor(array.shape, dtype, data=array)

    def is_constant(self, tid: int) -> bool:
        return self.tensors[tid].data is not None

    def base(self, tid: int) -> int:
        """The tensor that owns the bytes of ``tid`` (follows reshape aliases)."""
        while self.tensors[tid].alias_of is not None:
            tid = self.tensors[tid].alias_of
        return tid

    def add_node(self, kind, inputs, shape, dtype, layer, **attrs) -> int:
        out = self.add_tensor(shape, dtype)
        self.nodes.append(Node(kind, list(inputs), out, attrs, layer))
        return out

    def uses(self) -> dict:
        """How many times each tensor (by base) is read, graph outputs included."""
        counts = {}
        for node in self.nodes:
            for t in node.inputs:
                counts[self.base(t)] = counts.get(self.base(t), 0) + 1
        for t in self.outputs:
            counts[self.base(t)] = counts.get(self.base(t), 0) + 1
        return counts

    def producer(self) -> dict:
        return {node.output: node for node in self.nodes}


def onnx_tensor(layer: str) -> str | None:
    """The ONNX tensor a layer computes, where the frontend named it: the last its ops name (``c`` is the
    add's in ``func/conv2d_1+add_2@c+relu_3@r``, ``r`` the layer's); None where none does."""
    tensors = [part.partition("@")[2] for part in layer.split("/", 1)[-1].split("+") if "@" in part]
    return tensors[-1] if tensors else None


def layer_label(layer: str) -> str:
    """A layer name as a message gives it: ``'y' (conv2d_2)`` for ``func/conv2d_2@y``, the ONNX tensor it
    computes and its ops; ``'conv2d_2'`` where no op names one."""
    ops = "+".join(part.partition("@")[0] for part in layer.split("/", 1)[-1].split("+"))
    tensor = onnx_tensor(layer)
    return f"{tensor!r} ({ops})" if tensor else repr(ops)
