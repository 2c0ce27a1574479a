"""The fast path's elementwise steps in one pass: a chain's fp32 steps as one kernel.

numpy makes a pass over memory for each step of an elementwise chain (a
bias, then an activation; a residual add, then a ReLU; a hard-swish written
out as six ops), and each pass reads and writes the whole array. A kernel
that computes the chain per element makes one. Which kernel does it is
installed from outside (:func:`use_elementwise_kernels`; ``lpx_tvm``
installs TVM's when TVM loads), so this module needs numpy only and the
simulator runs its numpy steps without one.

Only steps whose every result is the same bits as numpy's are fused (but
for a NaN's sign and payload, which a compiler need not keep): IEEE
additions, subtractions, products, quotients and square roots, and
comparisons with numpy's rules for NaN and signed zeros. A step whose numpy
result comes from a library (``exp``, ``tanh``, ``erf``) ends the run. A
fused run computes the last step's destination; the results between its
steps are read by the next step alone (a chain carries them in buffers of
its own, :mod:`.fast_path`), so none of them is stored.

A run is described to the kernel builder by a key: ``(nodes, broadcast)``.
``nodes`` are ``(name, operands, constants)`` in order, an operand being
``k >= 0`` for the k-th input array or ``-1 - j`` for node j's value; the
last node is the result. ``broadcast[k]`` says input k is the same along a
row (its column stride is 0). The kernel is called as
``kernel(out, *inputs, out_row_stride, *input_row_strides, rows, cols)``:
pointers to fp32 data, strides in elements, every array a 2-D strided view
whose columns are adjacent.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .isa import Opcode, activation_attrs

F32 = np.dtype(np.float32)
_compiler = None  # key -> kernel, or None where no kernel is installed


def use_elementwise_kernels(compiler=None):
    """Make ``compiler(key)`` build the kernel of a fused run (None: every step runs by numpy) for the
    simulators loaded from now on; returns the one it replaces."""
    global _compiler
    previous, _compiler = _compiler, compiler
    return previous


# the steps a run may hold: binary ones as their node's name, unary ones (and EPILOGUE's activations) as
# :func:`_activation` spells them
_BINARY = {Opcode.ADD: "add", Opcode.SUB: "sub", Opcode.MUL: "mul", Opcode.DIV: "div",
           Opcode.MAXIMUM: "max", Opcode.MINIMUM: "min"}
_UNARY = {Opcode.COPY, Opcode.CAST, Opcode.RELU, Opcode.CLIP, Opcode.NEG, Opcode.SQRT, Opcode.LEAKY_RELU,
          Opcode.HARD_SWISH, Opcode.GELU}


def _activation(act: Opcode, attrs: dict, x: int, nodes: list) -> int | None:
    """Append the nodes of unary ``act`` on value ``x`` (an operand reference); the result's reference."""
    def node(name, operands, constants=()):
        nodes.append((name, tuple(operands), tuple(float(c) for c in constants)))
        return -len(nodes)

    if act in (Opcode.NOP, Opcode.COPY, Opcode.CAST):
        return x
    if act == Opcode.RELU:
        return node("relu", [x])
    if act == Opcode.CLIP:
        return node("clip", [x], [attrs["lo"], attrs["hi"]])
    if act == Opcode.NEG:
        return node("neg", [x])
    if act == Opcode.SQRT:
        return node("sqrt", [x])
    if act == Opcode.LEAKY_RELU:
        return node("leaky_relu", [x], [attrs["alpha"]])
    if act == Opcode.HARD_SWISH:
        return node("hard_swish", [x])
    if act == Opcode.GELU:  # (its exp is numpy's: :func:`_gelu_step` runs it between two kernels)
        return node("gelu", [x])
    return None


def _fusable(step) -> bool:
    fn, op, outs, ins, attrs = step
    if (op not in _BINARY and op not in _UNARY and op != Opcode.EPILOGUE) or len(outs) != 1:
        return False
    arrays = [outs[0], *ins]
    if not all(isinstance(a, np.ndarray) and a.dtype == F32 for a in arrays):
        return False
    if op == Opcode.EPILOGUE:
        return attrs["act"] in _UNARY or attrs["act"] == Opcode.NOP
    return op in _BINARY or op in _UNARY


def _nodes(steps, chained, inputs: list, nodes: list):
    """The run's nodes; ``inputs`` gathers its input arrays. None where a step is not expressible."""
    def operand(array) -> int:
        for k, seen in enumerate(inputs):
            if seen is array:
                return k
        inputs.append(array)
        return len(inputs) - 1

    value = None
    for m, (fn, op, outs, ins, attrs) in enumerate(steps):
        refs = [value if (m and i == chained[m]) else operand(x) for i, x in enumerate(ins)]
        if op == Opcode.EPILOGUE:
            x = refs[0]
            if len(refs) >= 2:
                nodes.append(("add", (x, refs[1]), ()))
                x = -len(nodes)
            if len(refs) == 3:
                nodes.append(("mul", (x, refs[2]), ()))
                x = -len(nodes)
            value = _activation(Opcode(attrs["act"]), activation_attrs(Opcode(attrs["act"]), attrs["act_args"]),
                                x, nodes)
        elif op in _BINARY:
            nodes.append((_BINARY[op], tuple(refs), ()))
            value = -len(nodes)
        else:
            value = _activation(op, attrs, refs[0], nodes)
        if value is None:
            return None
    if value >= 0:  # the run copies an input: a node of its own
        nodes.append(("copy", (value,), ()))
    return nodes


def _rows(shape, arrays) -> tuple | None:
    """``(rows, cols, row strides, column strides)`` of ``arrays`` (all of ``shape`` after broadcasting) as 2-D
    views whose columns are adjacent (column stride 1, or 0 for an array the same along a row), strides in
    elements; None where they are not that. The first array's innermost axis is the columns."""
    strides = []
    for a in arrays:
        if a.ctypes.data % 4:
            return None
        s = np.broadcast_to(a, shape).strides
        if any(x % 4 for x in s):
            return None
        strides.append([x // 4 for x in s])
    axes = [d for d in range(len(shape)) if shape[d] != 1]
    axes.sort(key=lambda d: -abs(strides[0][d]))  # the destination's innermost axis last
    dims = []  # (size, [stride per array]), merged where every array's axes follow each other
    for d in axes:
        size, st = shape[d], [s[d] for s in strides]
        if dims and all(prev == here * size for prev, here in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * size, st)
        else:
            dims.append((size, st))
    if not dims:
        dims = [(1, [1] + [0] * (len(arrays) - 1))]
    if len(dims) > 2:
        return None
    if len(dims) == 1:
        dims = [(1, [0] * len(arrays))] + dims
    (rows, row_strides), (cols, col_strides) = dims
    if col_strides[0] != 1 or any(s not in (0, 1) for s in col_strides):
        return None
    return rows, cols, row_strides, col_strides


def _fused_step(steps, chained):
    """One step computing ``steps`` (a run of fusable ones) with an installed kernel, or None."""
    out = steps[-1][2][0]
    if any(step[2][0].shape != out.shape for step in steps):
        return None
    inputs, nodes = [], []
    if _nodes(steps, chained, inputs, nodes) is None:
        return None
    # an input read after an earlier step of the run wrote its bytes, or overlapping the destination
    # other than element for element, would see what numpy's steps would not
    written = [step[2][0] for step in steps[:-1]]
    for m, step in enumerate(steps):
        for i, x in enumerate(step[3]):
            if m and i == chained[m]:
                continue
            if any(np.may_share_memory(x, w) for w in written[:m]):
                return None
            if np.may_share_memory(x, out) and not _same_view(np.broadcast_to(x, out.shape), out):
                return None
    if any(node[0] == "gelu" for node in nodes[:-1]):
        return None
    if nodes[-1][0] == "gelu":
        return _gelu_step(steps, nodes, inputs)
    call = _kernel_call(nodes, out, inputs)
    if call is None:
        return None

    def run(_outs, _ins, _attrs):
        call()
    return (run, steps[-1][1], [out], inputs, {})


def _kernel_call(nodes, out, inputs):
    """A function of no arguments that runs the kernel of ``nodes`` from ``inputs`` into ``out``; None where
    the arrays do not lie as a kernel takes them, or no kernel is built."""
    geometry = _rows(out.shape, [out, *inputs])
    if geometry is None:
        return None
    rows, cols, row_strides, col_strides = geometry
    kernel = _compiler((tuple(nodes), tuple(s == 0 for s in col_strides[1:])))
    if kernel is None:
        return None
    keep = [out, *inputs]  # the arrays whose pointers the call holds
    args = (*(ctypes.c_void_p(a.ctypes.data) for a in keep), *row_strides, rows, cols)
    return lambda keep=keep: kernel(*args)


def _gelu_step(steps, nodes, inputs):
    """A run that ends in GELU: erf's exp is numpy's, so a kernel computes the run and exp's argument into a
    buffer of the step's own, numpy takes the exp there, and a second kernel computes the run again and
    finishes erf and GELU (:func:`.semantics.erf`'s operations, in its order). Three passes, not fifteen."""
    out = steps[-1][2][0]
    operand = nodes[-1][1][0]
    exps = np.empty_like(out)  # laid out as the destination is, so that the two lie alike
    before = nodes[:-1]
    argument = _kernel_call(before + [("gelu_exp_argument", (operand,), ())], exps, inputs)
    finish = _kernel_call(before + [("gelu_from_exp", (operand, len(inputs)), ())], out, [*inputs, exps])
    if argument is None or finish is None:
        return None

    def run(_outs, _ins, _attrs):
        argument()
        np.exp(exps, out=exps)
        finish()
    return (run, steps[-1][1], [out], inputs, {})


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return a.ctypes.data == b.ctypes.data and a.strides == b.strides and a.shape == b.shape


def _primitive_count(steps) -> int:
    count = 0
    for _, op, _, ins, attrs in steps:
        count += (len(ins) - 1 + (attrs["act"] != Opcode.NOP)) if op == Opcode.EPILOGUE else 1
    return count


def fused(steps: list, chained: list) -> list:
    """``steps`` (``(function, opcode, outs, ins, attrs)``, each step ``k`` reading step ``k - 1``'s result as
    its ``chained[k]``-th input) with each run of fusable fp32 steps that numpy would make two passes or more
    for replaced by one step that runs an installed kernel (:func:`use_elementwise_kernels`). The same steps
    where no kernel is installed or none applies."""
    if _compiler is None:
        return steps
    result, start = [], 0
    while start < len(steps):
        end = start
        while end < len(steps) and _fusable(steps[end]) \
                and (end == start or (chained[end] is not None and steps[end - 1][2][0].shape == steps[end][2][0].shape)):
            end += 1
        if end == start:
            result.append(steps[start])
            start += 1
            continue
        result += _fused_run(steps[start:end], chained[start:end])
        start = end
    return result


def _fused_run(run: list, chained: list) -> list:
    """A run of fusable steps as one kernel's step, or as its halves' where the kernel builder declines it whole
    (a long run's expression); the steps themselves where nothing applies."""
    if _primitive_count(run) < 2:
        return run
    step = _fused_step(run, chained)
    if step is not None:
        return [step]
    if len(run) == 1:
        return run
    half = len(run) // 2
    return _fused_run(run[:half], chained[:half]) + _fused_run(run[half:], [None] + chained[half + 1:])
