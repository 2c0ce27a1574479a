"""ONNX ``LSTM`` and ``GRU`` unrolled over their (pinned) sequence into plain ops, for import.

TVM's ONNX importer has neither. Unrolled, a recurrent layer is products, sigmoids, tanhs and elementwise
updates, which lpx runs: the input's products for every step are one MatMul (``X · Wᵀ`` over the whole
sequence), and each step adds its state's product (``H · Rᵀ``) and updates the state, as the ONNX operator
definitions give them (gate orders ``iofc`` and ``zrh``, ``linear_before_reset``, ``forward``, ``reverse``
and ``bidirectional``, ``layout`` 0 and 1). What the unrolled form does not implement (peepholes, ``clip``,
other activations, ``input_forget``, per-sequence lengths, weights that are not constants) is an error
naming it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .runtime_sim.errors import LpxUserError

RECURRENT_OPS = ("LSTM", "GRU")
_GATES = {"LSTM": 4, "GRU": 3}
_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}


class RecurrentError(LpxUserError):
    """A recurrent node the unrolling cannot take, named with why."""


def has_recurrent(graph) -> bool:
    return any(node.op_type in RECURRENT_OPS for node in graph.node)


def unroll_recurrent(model: onnx.ModelProto, constants: dict) -> onnx.ModelProto:
    """Replace every LSTM and GRU node of ``model`` (in place) by its unrolled ops; returns the model.

    ``constants`` names the graph's constant tensors (its weights must be among them). The sequence and batch
    lengths must be static (pin them with ``input_shapes``): shape inference gives them.
    """
    shapes = _static_shapes(model)
    nodes = []
    for node in model.graph.node:
        if node.op_type not in RECURRENT_OPS:
            nodes.append(node)
            continue
        unrolled = _Unroller(node, shapes, constants)
        nodes.extend(unrolled.nodes)
        model.graph.initializer.extend(unrolled.initializers)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _static_shapes(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info]:
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


class _Unroller:
    """The unrolled nodes and new initializers of one LSTM or GRU node."""

    def __init__(self, node, shapes: dict, constants: dict):
        self.node, self.kind, self.count = node, node.op_type, 0
        self.nodes, self.initializers = [], []
        self.label = node.name or node.output[0] or node.output[1]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._refuse_what_is_not_implemented(attrs, constants)
        self.hidden = int(attrs["hidden_size"])
        direction = attrs.get("direction", b"forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        self.reverse = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
        self.layout = int(attrs.get("layout", 0))
        self.linear_before_reset = int(attrs.get("linear_before_reset", 0))
        x = node.input[0]
        shape = shapes.get(x)
        if shape is None or len(shape) != 3 or None in shape:
            raise RecurrentError(f"{self.kind} {self.label!r}: its input {x!r} has shape {shape}; unrolling needs a "
                                 "static sequence and batch (pin them with --input-shape)")
        seq, batch = (shape[0], shape[1]) if self.layout == 0 else (shape[1], shape[0])
        self.seq, self.batch = seq, batch
        weights = [self._constant(constants, k, name) for k, name in ((1, "W"), (2, "R"))]
        bias = (self._constant(constants, 3, "B") if len(node.input) > 3 and node.input[3]
                else np.zeros((len(self.reverse), 2 * _GATES[self.kind] * self.hidden), np.float32))
        if self.layout == 1:
            x = self._op("Transpose", [x], perm=[1, 0, 2])
        outputs = [self._direction(x, d, weights[0][d], weights[1][d], bias[d], node) for d in range(len(self.reverse))]
        self._outputs(outputs)

    # ---- what is refused -----------------------------------------------------------------------------
    def _refuse_what_is_not_implemented(self, attrs: dict, constants: dict) -> None:
        node, what = self.node, f"{self.kind} {self.label!r}"
        activations = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
        default = [a.lower() for a in _DEFAULT_ACTIVATIONS[self.kind]]
        if any([a.lower() for a in activations[k:k + len(default)]] != default
               for k in range(0, len(activations), len(default))):
            raise RecurrentError(f"{what}: activations {activations} are not implemented (only "
                                 f"{_DEFAULT_ACTIVATIONS[self.kind]} for each direction)")
        if "clip" in attrs:
            raise RecurrentError(f"{what}: clip is not implemented")
        if attrs.get("input_forget", 0):
            raise RecurrentError(f"{what}: input_forget is not implemented")
        if self.kind == "LSTM" and len(node.input) > 7 and node.input[7]:
            raise RecurrentError(f"{what}: peepholes (input P) are not implemented")
        if len(node.input) > 4 and node.input[4]:
            raise RecurrentError(f"{what}: per-sequence lengths (input sequence_lens) are not implemented")

    def _constant(self, constants: dict, index: int, role: str) -> np.ndarray:
        name = self.node.input[index]
        if name not in constants:
            raise RecurrentError(f"{self.kind} {self.label!r}: its {role} ({name!r}) is not a constant; unrolling "
                                 "needs constant weights")
        return numpy_helper.to_array(constants[name]).astype(np.float32)

    # ---- node building -------------------------------------------------------------------------------
    def _name(self, what: str) -> str:
        self.count += 1
        return f"{self.label}/unrolled/{what}_{self.count}"

    def _const(self, value: np.ndarray, what: str = "const") -> str:
        name = self._name(what)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def _op(self, op_type: str, inputs: list, output: str | None = None, **attrs) -> str:
        output = output or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=self._name(op_type), **attrs))
        return output

    def _slice(self, x: str, axis: int, start: int, end: int) -> str:
        return self._op("Slice", [x, self._const(np.array([start], np.int64)), self._const(np.array([end], np.int64)),
                                  self._const(np.array([axis], np.int64))])

    def _reshape(self, x: str, shape) -> str:
        return self._op("Reshape", [x, self._const(np.array(shape, np.int64))])

    def _gate(self, gates: str, k: int) -> str:
        return self._slice(gates, 1, k * self.hidden, (k + 1) * self.hidden)

    # ---- the recurrence ------------------------------------------------------------------------------
    def _initial(self, index: int, d: int) -> str | None:
        node = self.node
        if len(node.input) <= index or not node.input[index]:
            return None  # zeros
        state = node.input[index]
        if self.layout == 1:
            state = self._op("Transpose", [state], perm=[1, 0, 2])
        return self._reshape(self._slice(state, 0, d, d + 1), [self.batch, self.hidden])

    def _direction(self, x: str, d: int, w: np.ndarray, r: np.ndarray, bias: np.ndarray, node) -> tuple:
        """Every step's H (in time order) and the last H (and C) of direction ``d``."""
        gates, hidden = _GATES[self.kind], self.hidden
        w_bias, r_bias = bias[:gates * hidden], bias[gates * hidden:]
        in_bias = w_bias + r_bias
        if self.kind == "GRU" and self.linear_before_reset:  # Rbh is applied inside r ⊙ (H·Rhᵀ + Rbh)
            in_bias = in_bias.copy()
            in_bias[2 * hidden:] = w_bias[2 * hidden:]
        rows = self._reshape(x, [self.seq * self.batch, -1])
        projected = self._op("Add", [self._op("MatMul", [rows, self._const(w.T, "W_t")]), self._const(in_bias, "bias")])
        projected = self._reshape(projected, [self.seq, self.batch, gates * hidden])
        r_t = self._const(r.T, "R_t")
        h, c = self._initial(5, d), self._initial(6, d) if self.kind == "LSTM" else None
        steps = range(self.seq - 1, -1, -1) if self.reverse[d] else range(self.seq)
        hs = {}
        for t in steps:
            xw = self._reshape(self._slice(projected, 0, t, t + 1), [self.batch, gates * hidden])
            if self.kind == "LSTM":
                h, c = self._lstm_step(xw, h, c, r_t)
            else:
                h = self._gru_step(xw, h, r, r_bias)
            hs[t] = h
        return [hs[t] for t in range(self.seq)], h, c

    def _lstm_step(self, xw: str, h: str | None, c: str | None, r_t: str) -> tuple:
        gates = xw if h is None else self._op("Add", [xw, self._op("MatMul", [h, r_t])])
        i, o, f, g = (self._gate(gates, k) for k in range(4))  # ONNX's order: input, output, forget, cell
        i, o, f = (self._op("Sigmoid", [v]) for v in (i, o, f))
        new = self._op("Mul", [i, self._op("Tanh", [g])])
        c = new if c is None else self._op("Add", [self._op("Mul", [f, c]), new])
        return self._op("Mul", [o, self._op("Tanh", [c])]), c

    def _gru_step(self, xw: str, h: str | None, r: np.ndarray, r_bias: np.ndarray) -> str:
        hidden = self.hidden
        zr_weight = self._const(r[:2 * hidden].T, "R_zr_t") if h is not None else None
        xz, xr, xh = (self._gate(xw, k) for k in range(3))
        if h is None:  # H₀ = 0: its products are zero
            z, reset = self._op("Sigmoid", [xz]), None
            recurrent = self._const(np.broadcast_to(r_bias[2 * hidden:], (self.batch, hidden)).astype(np.float32),
                                    "Rbh") if self.linear_before_reset else None
        else:
            hzr = self._op("MatMul", [h, zr_weight])
            z = self._op("Sigmoid", [self._op("Add", [xz, self._slice(hzr, 1, 0, hidden)])])
            reset = self._op("Sigmoid", [self._op("Add", [xr, self._slice(hzr, 1, hidden, 2 * hidden)])])
        rh_t = None if h is None else self._const(r[2 * hidden:].T, "R_h_t")
        if h is None:
            candidate = xh if recurrent is None else self._op("Add", [xh, self._op("Mul", [
                self._op("Sigmoid", [xr]), recurrent])])
        elif self.linear_before_reset:  # r ⊙ (H·Rhᵀ + Rbh)
            inner = self._op("Add", [self._op("MatMul", [h, rh_t]), self._const(r_bias[2 * hidden:], "Rbh")])
            candidate = self._op("Add", [xh, self._op("Mul", [reset, inner])])
        else:  # (r ⊙ H)·Rhᵀ
            candidate = self._op("Add", [xh, self._op("MatMul", [self._op("Mul", [reset, h]), rh_t])])
        candidate = self._op("Tanh", [candidate])
        # H = (1 - z) ⊙ h̃ + z ⊙ H₋₁ = h̃ + z ⊙ (H₋₁ - h̃)
        if h is None:
            return self._op("Sub", [candidate, self._op("Mul", [z, candidate])])
        return self._op("Add", [candidate, self._op("Mul", [z, self._op("Sub", [h, candidate])])])

    # ---- outputs -------------------------------------------------------------------------------------
    def _outputs(self, directions: list) -> None:
        node, batch, hidden = self.node, self.batch, self.hidden
        wanted = list(node.output) + [""] * (3 - len(node.output))
        if wanted[0]:  # Y: [seq, num_directions, batch, hidden] (layout 1: [batch, seq, num_directions, hidden])
            per_step = [self._op("Concat", [self._reshape(hs[t], [1, 1, batch, hidden]) for hs, _, _ in directions],
                                 axis=1) for t in range(self.seq)]
            y = self._op("Concat", per_step, axis=0)
            self._finish(y, wanted[0], [2, 0, 1, 3])
        for k, index in ((1, 1), (2, 2)):
            if wanted[k]:  # Y_h, Y_c: [num_directions, batch, hidden] (layout 1: [batch, num_directions, hidden])
                last = self._op("Concat", [self._reshape(state[index], [1, batch, hidden]) for state in directions],
                                axis=0)
                self._finish(last, wanted[k], [1, 0, 2])

    def _finish(self, value: str, name: str, batch_first: list) -> None:
        if self.layout == 1:
            self._op("Transpose", [value], name, perm=batch_first)
        else:
            self._op("Identity", [value], name)
