"""ONNX ─► Relax with weights bound, and the cheap folding the patterns need.

Folding here is numpy work on the ONNX graph or on Relax constants; it never
builds anything with LLVM (``FoldConstant`` would, once per constant).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm
from tvm.relax.expr_functor import PyExprMutator, mutator

from .diagnostics import native_output_to_log
from .recurrent import RecurrentError, has_recurrent, unroll_recurrent
from .runtime_sim.program import aligned_copy
from .runtime_sim.errors import LpxUserError
from .codegen.relax_ops import PRIM_TYPES, Constant, axis_params, constant_value, quantize_array


_LOG = logging.getLogger(__name__)


class FrontendError(LpxUserError):
    """A model that cannot be read or imported, with the reason and the file."""


def load_onnx(model, external_data: bool = True) -> onnx.ModelProto:
    """Read an ONNX model from a path, bytes or a ModelProto, with clear errors; from a path, without the
    bytes of its external data where ``external_data`` is False (:func:`mapped_external_data` maps them)."""
    name = "model" if isinstance(model, onnx.ModelProto) else None
    if name is None:
        name = "<bytes>" if isinstance(model, (bytes, bytearray)) else str(model)
    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, (bytes, bytearray)):
            proto = onnx.load_from_string(bytes(model))
        else:
            path = Path(model)
            if not path.is_file():
                raise FrontendError(f"{name}: no such file")
            proto = onnx.load(str(path), load_external_data=external_data)
    except FrontendError:
        raise
    except Exception as err:  # protobuf raises several types for garbage input
        raise FrontendError(f"{name}: not a readable ONNX model ({type(err).__name__}: {err})") from None
    if not proto.graph.node:
        raise FrontendError(f"{name}: not an ONNX model (the graph has no nodes)")
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > newest:
            raise FrontendError(f"{name}: unsupported opset {opset.version} (this onnx package knows up to {newest})")
    return proto


def mapped_external_data(model: onnx.ModelProto, directory) -> dict[str, np.ndarray]:
    """The arrays of ``model``'s external-data initializers (loaded with ``load_external_data=False``),
    memory-mapped from their files in ``directory``: read in place, never copied (copy-on-write maps, so
    that TVM can bind them); ``{}`` where it holds none.

    Raises
    ------
    LpxUserError
        Naming the initializer whose file is missing or too short.
    """
    files, arrays = {}, {}
    for init in model.graph.initializer:
        if not uses_external_data(init):
            continue
        info = ExternalDataInfo(init)
        path = Path(directory) / info.location
        if not path.is_file():
            raise LpxUserError(f"{init.name}: its weights file {path} is missing")
        if path not in files:
            files[path] = np.memmap(path, np.uint8, mode="c")
        offset, dtype = info.offset or 0, helper.tensor_dtype_to_np_dtype(init.data_type)
        length = info.length or int(np.prod(init.dims)) * dtype.itemsize
        if offset + length > files[path].size:
            raise LpxUserError(f"{init.name}: {length} bytes at {offset} run past the end of {path} "
                               f"({files[path].size} bytes)")
        arrays[init.name] = files[path][offset:offset + length].view(dtype).reshape(tuple(init.dims))
    return arrays


def set_shape(value_info, dims) -> None:
    """Give an ONNX value (a graph input) the static shape ``dims``, in place."""
    shape = value_info.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = int(d)


def prepare_onnx(model: onnx.ModelProto, input_shapes: dict | None = None) -> onnx.ModelProto:
    """Normalise an ONNX model for import (a copy; the caller's model is left as it was).

    - graph inputs that are really initializers are dropped (old IR versions
      list them, and the importer would then duplicate the weights);
    - ``Sum`` becomes a chain of ``Add`` (the importer's stack+sum hides the adds);
    - ``Dropout`` becomes ``Identity`` (inference);
    - ``ConstantOfShape`` of a constant shape becomes a ``Constant`` (weights built so are weights);
    - ``input_shapes`` (name -> dims) pins dynamic input dimensions;
    - with every input static, shape computations are folded to constants;
    - LSTM and GRU are unrolled over their sequence (:mod:`.recurrent`).

    Batch norm is folded into the convolution before it once, in the codegen
    (lowering makes it a per-channel scale and shift, ``fuse`` folds those).
    """
    view = _GraphView(model.graph, input_shapes)
    if _needs_shape_folding(view):
        model, weights = _fold_shape_computations(model, view, _repinned(model.graph.input, input_shapes))
        inputs = [i for i in model.graph.input if i.name not in weights]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        model.graph.initializer.extend(weights.values())  # (the copy this function returns)
    else:
        model = copy.deepcopy(model)
        del model.graph.input[:]
        model.graph.input.extend(view.input)
        del model.graph.node[:]
        model.graph.node.extend(view.node)
        model.ir_version = max(model.ir_version, 4)
    if has_recurrent(model.graph):
        try:
            model = unroll_recurrent(model, onnx_constants(model.graph))
        except RecurrentError as err:
            raise FrontendError(str(err)) from None
    return model


def _items(dims) -> tuple:
    """``dims`` as a tuple, or ``(None,)`` (no dims at all) when it is not a sequence."""
    try:
        return tuple(dims)
    except TypeError:
        return (None,)


def _prepared_inputs(graph, input_shapes: dict | None) -> list:
    """The graph's real inputs (initializers dropped), copies with ``input_shapes`` pinned."""
    init_names = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if input_shapes is not None and not isinstance(input_shapes, dict):
        raise FrontendError(f"input shapes must be a dict of input name -> dims, got {input_shapes!r}")
    for name, dims in (input_shapes or {}).items():
        if name not in {i.name for i in inputs}:
            raise FrontendError(f"--input-shape names {name!r}, but the model's inputs are "
                                f"{[i.name for i in inputs]}")
        if isinstance(dims, (str, bytes)) or not all(isinstance(d, (int, np.integer)) and d > 0 for d in _items(dims)):
            raise FrontendError(f"--input-shape {name}: its dims must be positive integers, got {dims!r}")
    pinned = []
    for value_info in inputs:
        declared = value_info.type.tensor_type.shape.dim
        given = (input_shapes or {}).get(value_info.name)
        if given is not None and len(declared) and len(given) != len(declared):
            raise FrontendError(f"--input-shape {value_info.name}={','.join(str(d) for d in given)} has "
                                f"{len(given)} dims, but input {value_info.name!r} has {len(declared)}")
        if value_info.name in (input_shapes or {}):
            value_info = copy.deepcopy(value_info)
            set_shape(value_info, input_shapes[value_info.name])
        pinned.append(value_info)
    return pinned


def _repinned(inputs, input_shapes: dict | None) -> list:
    """``(input, axis, the model's value, the pinned one)`` for each dimension the model fixes (as declared in
    ``inputs``) and ``input_shapes`` pins to another value."""
    out = []
    for value_info in inputs:
        given = (input_shapes or {}).get(value_info.name)
        declared = value_info.type.tensor_type.shape.dim if given is not None else ()
        for axis, (dim, pinned) in enumerate(zip(declared, given or ())):
            if dim.HasField("dim_value") and dim.dim_value != pinned:
                out.append((value_info.name, axis, dim.dim_value, int(pinned)))
    return out


def onnx_constants(graph) -> dict:
    """Name ─► TensorProto of every constant of an ONNX graph: its initializers and its Constant nodes' values."""
    constants = {i.name: i for i in graph.initializer}
    constants.update({n.output[0]: n.attribute[0].t for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    return constants


def _prepared_nodes(graph) -> list:
    nodes, constants = [], onnx_constants(graph)
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input and node.input[0] in constants:
            nodes.append(_constant_of_shape(node, constants[node.input[0]]))
        elif node.op_type == "Dropout":  # identity at inference; its mask output is never used by a model
            nodes.append(helper.make_node("Identity", node.input[:1], node.output[:1], name=node.name))
        elif node.op_type == "Sum" and len(node.input) >= 2:
            acc = node.input[0]
            for k, name in enumerate(node.input[1:]):
                out = node.output[0] if k == len(node.input) - 2 else f"{node.output[0]}__sum{k}"
                nodes.append(helper.make_node("Add", [acc, name], [out], name=f"{node.name}_add{k}"))
                acc = out
        else:
            nodes.append(node)
    nodes = _gather_before_dequantize(nodes, constants, {o.name for o in graph.output})
    return _one_dequantize_per_reader(nodes, constants, {o.name for o in graph.output})


def _gather_before_dequantize(nodes: list, constants: dict, outputs: set) -> list:
    """``Gather(DequantizeLinear(table), ids)`` of a per-tensor quantised constant becomes
    ``DequantizeLinear(Gather(table, ids))``: the same numbers (the dequantisation is elementwise with one
    scale), but a step dequantises the rows it reads, not the whole table (an int8 embedding's), and the
    table's DequantizeLinear no longer stays on the host, beside the Gather, on every call."""
    from onnx import numpy_helper

    readers = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    dequantized = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in constants
                   and all(name in constants for name in n.input[1:])
                   and all(numpy_helper.to_array(constants[name]).size == 1 for name in n.input[1:])}
    moved = {node.input[0] for node in nodes if node.op_type == "Gather" and node.input
             and node.input[0] in dequantized and readers[node.input[0]] == 1 and node.input[0] not in outputs}
    out = []
    for node in nodes:
        if node.op_type == "DequantizeLinear" and node.output[0] in moved:
            continue  # made after the Gather instead
        if node.op_type == "Gather" and node.input and node.input[0] in moved:
            dq = dequantized[node.input[0]]
            rows = f"{node.output[0]}__quantized"
            out.append(helper.make_node("Gather", [dq.input[0], *node.input[1:]], [rows],
                                        name=f"{node.name}__quantized",
                                        **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
            node = helper.make_node("DequantizeLinear", [rows, *dq.input[1:]], list(node.output), name=dq.name)
        out.append(node)
    return out


def _one_dequantize_per_reader(nodes: list, constants: dict, outputs: set) -> list:
    """A DequantizeLinear of a constant read by several nodes becomes one copy per reader, as ONNX Runtime's
    QDQ passes do (a node unit owns its DQ): TVM's FuseOpsByPattern loses the binding of a dequantised weight
    that two matched products share (a decoder's rotate-half matrix, read by every rotary embedding), and the
    module then fails to build."""
    readers = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    shared = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in constants
              and readers.get(n.output[0], 0) > 1}
    if not shared:
        return nodes
    out, uses = [], {}
    for node in nodes:
        if node.op_type == "DequantizeLinear" and node.output[0] in shared and node.output[0] not in outputs:
            continue  # emitted before each reader instead
        inputs = list(node.input)
        for k, name in enumerate(inputs):
            if name in shared:
                uses[name] = uses.get(name, 0) + 1
                copy_name = f"{name}__reader{uses[name]}"
                dq = shared[name]
                out.append(helper.make_node("DequantizeLinear", list(dq.input), [copy_name],
                                            name=f"{dq.name}__reader{uses[name]}",
                                            **{a.name: helper.get_attribute_value(a) for a in dq.attribute}))
                inputs[k] = copy_name
        if inputs != list(node.input):
            node = copy.deepcopy(node)
            del node.input[:]
            node.input.extend(inputs)
        out.append(node)
    return out


def _constant_of_shape(node, shape) -> onnx.NodeProto:
    """ConstantOfShape of a constant shape as the Constant it is (the onnx package's light models build every
    weight so; TVM's importer makes it a broadcast, and a convolution's weight then is not a constant)."""
    from onnx import numpy_helper

    fill = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), np.zeros(1, np.float32))
    value = np.full([int(d) for d in numpy_helper.to_array(shape)], fill.reshape(()), fill.dtype)
    return helper.make_node("Constant", [], list(node.output), name=node.name, value=numpy_helper.from_array(value))


def _needs_shape_folding(graph) -> bool:
    return any(node.op_type == "Shape" for node in graph.node) and _all_inputs_static(graph)


class _GraphView:
    """A prepared graph as TVM's importer reads it (``node``, ``input``, ``output``, ``initializer``), sharing
    the model's initializers: a deep copy of the model would be one more copy of every weight."""

    def __init__(self, graph, input_shapes: dict | None):
        self._graph = graph
        self.input = _prepared_inputs(graph, input_shapes)
        self.node = _prepared_nodes(graph)

    def __getattr__(self, name):
        return getattr(self._graph, name)


class _FoldedView:
    """A graph ONNX Runtime folded without its weights (:func:`_fold_shape_computations`), the weights put
    back as the model's own initializers, not copies."""

    def __init__(self, folded, weights: dict):
        self._graph = folded
        self.input = [i for i in folded.input if i.name not in weights]
        self.initializer = [*folded.initializer, *weights.values()]

    def __getattr__(self, name):
        return getattr(self._graph, name)


def _import_view(model: onnx.ModelProto, input_shapes: dict | None, external: dict | None = None):
    """What TVM's importer needs of ``model`` after :func:`prepare_onnx`, without copying the weights (a
    recurrent layer's unrolling reads them, so it takes the copying route)."""
    view = _GraphView(model.graph, input_shapes)
    if has_recurrent(view):
        if external:
            raise FrontendError("a graph whose weights are held apart (weights=...) must have its recurrent "
                                "layers unrolled already")
        return prepare_onnx(model, input_shapes)
    if _needs_shape_folding(view):
        folded, weights = _fold_shape_computations(model, view, _repinned(model.graph.input, input_shapes))
        return _ModelView(graph=_FoldedView(folded.graph, weights), opset_import=folded.opset_import,
                          ir_version=folded.ir_version)
    return _ModelView(graph=view, opset_import=model.opset_import, ir_version=max(model.ir_version, 4))


@dataclass(frozen=True)
class _ModelView:
    graph: _GraphView
    opset_import: object
    ir_version: int


def _all_inputs_static(graph) -> bool:
    return all(d.HasField("dim_value") and d.dim_value > 0
               for i in graph.input for d in i.type.tensor_type.shape.dim)


# an initializer is a weight, which ONNX Runtime folds without, unless it is an integer tensor of at most
# _SHAPE_ELEMENTS elements (shape arithmetic reads those) or any tensor of at most _SCALAR_ELEMENTS (an epsilon,
# Resize's scales, a Pad value)
_SHAPE_ELEMENTS = 1 << 16
_SCALAR_ELEMENTS = 16
_SHAPE_TYPES = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)


def _is_weight(init: onnx.TensorProto) -> bool:
    elements = int(np.prod(init.dims, dtype=np.int64))
    if uses_external_data(init):
        return True
    return elements > (_SHAPE_ELEMENTS if init.data_type in _SHAPE_TYPES else _SCALAR_ELEMENTS)


def _fold_shape_computations(model: onnx.ModelProto, view, repinned=()) -> tuple:
    """Shape ─► Slice ─► Concat ─► Reshape chains on static shapes become constants.

    TVM's importer needs Reshape targets it can see; exporters (paddle2onnx,
    torch) compute them at run time. With every input shape pinned, ONNX
    Runtime's basic graph optimiser (constant folding and standard-op fusions
    only, no contrib ops) folds them, so we use it rather than a folder of our own.

    ONNX Runtime gets the graph without its weights (:func:`_is_weight`): each is an input of its type and
    shape instead, so nothing serialises them (protobuf stops at 2 GB; a decoder's weights pass that) and
    no copy of them is made; folding a weight's own arithmetic is numpy's work here anyway.

    Parameters
    ----------
    model : onnx.ModelProto
        The model (its opsets, functions and initializers).
    view : _GraphView
        Its graph as prepared for import: the nodes and inputs (pinned) to fold.
    repinned : list
        :func:`_repinned`: the dimensions pinned against the model's own fixed values, which a failure names
        (a graph traced at one length keeps constants of that length).

    Returns
    -------
    (onnx.ModelProto, dict)
        The folded model, without the weights, and ``{name: initializer}`` of the weights (the model's own).
    """
    import tempfile

    import onnxruntime as ort

    weights = {init.name: init for init in model.graph.initializer if _is_weight(init)}
    skeleton = onnx.ModelProto(ir_version=max(model.ir_version, 4), producer_name=model.producer_name)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(view.node)
    graph.input.extend(view.input)
    graph.input.extend(helper.make_tensor_value_info(name, init.data_type, list(init.dims))
                       for name, init in weights.items())
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    graph.initializer.extend(init for init in model.graph.initializer if init.name not in weights)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3  # not a line per initializer the folding leaves unused
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "folded.onnx")
        try:
            ort.InferenceSession(skeleton.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # ORT rejects models it cannot run; say so rather than import a half-folded graph
            said = str(err).strip().splitlines()[0]
            if not repinned:
                raise FrontendError(f"cannot fold its shape computations ({said})") from None
            (name, axis, fixed, pinned), more = repinned[0], len(repinned) - 1
            raise FrontendError(
                f"cannot fold its shape computations: input {name!r} has axis {axis} fixed at {fixed}, pinned to "
                f"{pinned}" + (f" (and {more} more fixed axes pinned to other values)" if more else "")
                + f"; export that axis dynamic (torch.onnx.export(..., dynamic_shapes=...)) or pin it to {fixed} "
                f"(ONNX Runtime: {said})") from None
        return onnx.load(options.optimized_model_filepath), weights


_TE_MIN_MAX = re.compile(r"^(maximum|minimum)\d*$")
_NUMPY_ELEMENTWISE = {
    "relax.sqrt": np.sqrt, "relax.exp": np.exp, "relax.negative": np.negative, "relax.add": np.add,
    "relax.subtract": np.subtract, "relax.multiply": np.multiply, "relax.divide": np.divide, "relax.power": np.power,
}


def _owned_const(array: np.ndarray) -> relax.Constant:
    """A Relax constant over one fresh copy of ``array`` (``relax.const`` of a numpy array copies it again:
    a folded weight would exist three times at once)."""
    if array.dtype.kind not in "iuf" or array.size == 0:
        return relax.const(np.ascontiguousarray(array))
    return relax.const(tvm.runtime.from_dlpack(aligned_copy(array)))


NARROW_WEIGHT_BYTES = 1 << 16  # a widened constant this large is a weight the model stores narrow


def _stored_narrow(value: np.ndarray, dtype: str) -> bool:
    """Whether ``astype(value, dtype)`` widens a large fp16 weight to fp32: left as it is, so that lpx stores
    the fp16 bytes the model holds (widening is exact) and no fp32 copy is made; the host widens at run time
    what lpx does not take."""
    return value.dtype == np.float16 and dtype == "float32" and value.nbytes >= NARROW_WEIGHT_BYTES


@mutator
class _FoldConstantShapes(PyExprMutator):
    """Numpy folding the importer leaves undone, so that patterns see plain ops.

    - reshape / permute_dims / astype of a constant ─► a constant (but a large fp16 weight's widening:
      :func:`_stored_narrow`);
    - elementwise arithmetic on constants alone (sqrt, add, ...) ─► a constant;
    - isnan / where on constants ─► a constant (the importer's NaN-bound guard for Clip);
    - quantize of a constant ─► integers (a QDQ weight stored as Q(float));
    - dequantize of a constant vector or scalar ─► floats (biases, layer-norm scales; weights keep theirs);
    - ``call_tir(maximum|minimum, x, scalar)`` (Clip, which the importer emits as TE
      functions) ─► ``relax.maximum|minimum``, and ``minimum(maximum(x, lo), hi)`` ─► ``clip``;
    - ``split`` of a static shape ─► a tuple of ``strided_slice`` (GPT-2's fused QKV), which lpx runs;
    - ``take`` of a float tensor at constant indices that are one position or a run of them ─► ``strided_slice``
      (and a reshape where the axis goes: ``x[:, 0]``); a constant index may come behind the importer's wrap of
      negative indices (``where(i < 0, i + n, i)``), which is then left unused;
    - ``scatter_nd`` of rows at constant indices that are a run (index depth 1, no reduction) ─► ``concat`` of
      the rows kept and the rows written (``key[..., :n] = k_nope``, as DeepSeek's attention fills its keys,
      exported with the last axis moved first).
    """

    def _constant(self, expr):
        if isinstance(expr, relax.Var):
            expr = self.lookup_binding(expr)
        return expr if isinstance(expr, Constant) and not isinstance(expr, PRIM_TYPES) else None

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        if name == "relax.call_tir":
            return self._te_min_max(call)
        if name == "relax.minimum":
            return self._clip(call)
        if name == "relax.split":
            return self._split(call)
        if name == "relax.take":
            return self._take(call)
        if name == "relax.scatter_nd":
            return self._scatter_rows(call)
        consts = [self._constant(a) for a in call.args]
        if consts[0] is None:
            return call
        value = constant_value(consts[0])
        if name == "relax.reshape":
            return _owned_const(value.reshape([int(d) for d in call.ty.shape.values]))
        if name == "relax.permute_dims":
            axes = None if call.attrs.axes is None else [int(a) for a in call.attrs.axes]
            return _owned_const(value.transpose(axes))
        if name == "relax.astype":
            if _stored_narrow(value, str(call.ty.dtype)):
                return call
            return _owned_const(value.astype(str(call.ty.dtype), copy=False))
        if name == "relax.quantize" and all(c is not None for c in consts):
            return relax.const(quantize_array(value, *(constant_value(c) for c in consts[1:]),
                                              int(call.attrs.axis), str(call.ty.dtype)))
        if name == "relax.dequantize" and value.ndim <= 1 and all(c is not None for c in consts):
            # a quantised bias, layer-norm scale or scalar: no pattern holds it alone, so it would be
            # dequantised on the host at every call; a weight (rank 2 and up) keeps its integers for int8 kernels
            s, z = axis_params(value, *(constant_value(c) for c in consts[1:]), int(call.attrs.axis))
            return relax.const(((value.astype(np.float32) - z) * s).astype(np.float32))
        if name in _NUMPY_ELEMENTWISE and all(c is not None for c in consts):
            # an importer's constant arithmetic (ONNX functions write sqrt(2) as Sqrt(CastLike(2)))
            result = _NUMPY_ELEMENTWISE[name](value, *(constant_value(c) for c in consts[1:]))
            dtype = str(call.ty.dtype)  # (named: relax.const makes an int64 array int32)
            return relax.const(np.asarray(result).astype(dtype), dtype)
        if name == "relax.isnan":
            return relax.const(np.isnan(value))
        if name == "relax.where" and all(c is not None for c in consts):
            dtype = str(call.ty.dtype)
            return relax.const(np.where(value, *(constant_value(c) for c in consts[1:])).astype(dtype), dtype)
        return call

    def _index(self, expr):
        """The integers of a constant index, or of one behind the importer's wrap of negative indices
        (``where(less(i, 0), add(i, n), i)``, ``i`` a constant): None where ``expr`` is neither."""
        known = self._constant(expr)
        if known is None and isinstance(expr, relax.Var):
            wrap = self.lookup_binding(expr)
            if _is_op(wrap, "relax.where"):
                cond, shifted = (self.lookup_binding(a) if isinstance(a, relax.Var) else a for a in wrap.args[:2])
                index = self._constant(wrap.args[2])
                if (index is not None and _is_op(cond, "relax.less") and _is_op(shifted, "relax.add")
                        and all(self._same_constant(a, index) for a in (cond.args[0], shifted.args[0]))):
                    known = index
        return None if known is None else np.asarray(constant_value(known)).astype(np.int64)

    def _same_constant(self, expr, constant) -> bool:
        value = self._constant(expr)
        return value is not None and np.array_equal(constant_value(value), constant_value(constant))

    def _take(self, call):
        """``take`` of a float tensor (not a constant: a table lookup stays one) at constant indices that are one
        position or a run of them ─► a slice."""
        index, shape = self._index(call.args[1]), _static_dims(call.args[0])
        if (index is None or shape is None or self._constant(call.args[0]) is not None
                or not str(call.ty.dtype).startswith(("float", "bfloat"))):
            return call
        axis = int(call.attrs.axis) % len(shape)
        if np.any((index < -shape[axis]) | (index >= shape[axis])):
            return call  # (out of range: whatever the mode says, not ours to decide)
        flat = (index % shape[axis]).reshape(-1)
        if index.ndim > 1 or not flat.size or np.any(np.diff(flat) != 1):
            return call
        first = int(flat[0])
        piece = self.builder_.emit(relax.op.strided_slice(call.args[0], axes=[axis], begin=[first],
                                                          end=[first + flat.size], strides=[1]))
        return relax.op.reshape(piece, [int(d) for d in call.ty.shape.values]) if index.ndim == 0 else piece

    def _scatter_rows(self, call):
        """``scatter_nd(data, indices, updates)`` writing a run of rows (axis 0) at constant indices ─► the
        rows of ``data`` before and after the run, and the updates between them, concatenated."""
        data, indices, updates = call.args
        index, shape = self._index(indices), _static_dims(data)
        if (index is None or shape is None or str(getattr(call.attrs, "reduction", "update")) != "update"
                or _static_dims(updates) is None):
            return call
        if index.ndim < 1 or index.shape[-1] != 1 or not index.size:
            return call
        rows = index.reshape(-1)
        if np.any((rows < -shape[0]) | (rows >= shape[0])):
            return call
        rows = rows % shape[0]
        if np.any(np.diff(rows) != 1):
            return call
        first, count = int(rows[0]), int(rows.size)
        updates = (updates if len(_static_dims(updates)) == len(shape)
                   else self.builder_.emit(relax.op.reshape(updates, [count, *shape[1:]])))
        known = self._constant(data)
        parts = []
        for begin, end in ((0, first), (first + count, shape[0])):
            if end > begin:
                parts.append((_owned_const(np.ascontiguousarray(constant_value(known)[begin:end])) if known is not None
                              else self.builder_.emit(relax.op.strided_slice(data, axes=[0], begin=[begin], end=[end],
                                                                             strides=[1]))))
        parts.insert(1 if first else 0, updates)
        return relax.op.concat(parts, axis=0) if len(parts) > 1 else updates

    def _te_min_max(self, call):
        callee, args = call.args[0], call.args[1]
        match = _TE_MIN_MAX.match(getattr(callee, "name_hint", ""))
        if not match or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
            return call
        bound = self._constant(args.fields[1])
        if bound is None or constant_value(bound).ndim != 0:
            return call
        if match.group(1) == "maximum":
            return relax.op.maximum(args.fields[0], bound)
        return self._clip(relax.op.minimum(args.fields[0], bound))

    def _split(self, call):
        shape, axis = call.args[0].ty.shape, int(call.attrs.axis)
        if shape is None or not isinstance(call.ty, relax.TupleType):
            return call
        sizes = [f.shape.values[axis] for f in call.ty.fields]
        if not all(isinstance(d, IntImm) for d in sizes):
            return call
        ends = np.cumsum([int(d) for d in sizes])
        return relax.Tuple([self.builder_.emit(relax.op.strided_slice(call.args[0], axes=[axis],
                                                                      begin=[int(end - int(d))], end=[int(end)], strides=[1]))
                            for d, end in zip(sizes, ends)])

    def _clip(self, call):
        inner = call.args[0]
        inner = self.lookup_binding(inner) if isinstance(inner, relax.Var) else inner
        if not (isinstance(inner, relax.Call) and isinstance(inner.op, tvm.ir.Op)
                and inner.op.name == "relax.maximum"):
            return call
        lo, hi = self._constant(inner.args[1]), self._constant(call.args[1])
        if lo is None or hi is None or constant_value(lo).ndim or constant_value(hi).ndim:
            return call
        return relax.op.clip(inner.args[0], float(constant_value(lo)), float(constant_value(hi)))


def _static_dims(expr) -> list | None:
    """The dims of a tensor of static shape, else None."""
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(d, IntImm) for d in values):
        return None
    return [int(d) for d in values]


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def fold_constant_shapes(mod: tvm.IRModule) -> tvm.IRModule:
    """Fold what the importer leaves (see ``_FoldConstantShapes``), inline constants, drop dead functions."""
    folder = _FoldConstantShapes(mod)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gvar] = folder.visit_expr(func)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return relax.transform.DeadCodeElimination(["main"])(mod)


def _import_named(view, weights: dict | None = None) -> tvm.IRModule:
    """TVM's ONNX importer, each op it makes spanned with the ONNX tensor the op computes (so that reports can
    name a layer as ``compare`` and ONNX Runtime do). As TVM's ``from_onnx``, but for onnx's checker, which
    cannot read a view (and :func:`from_onnx` keeps its warnings for ``--debug`` anyway). An initializer
    held as external data is bound from ``weights`` in place (see :func:`from_onnx`)."""
    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

    class NamingImporter(ONNXGraphImporter):
        def _parse_array(self, tensor_proto):
            if weights is not None and uses_external_data(tensor_proto) and tensor_proto.name in weights:
                return tvm.runtime.from_dlpack(weights[tensor_proto.name])
            return super()._parse_array(tensor_proto)

        def _parse_value_proto(self, value_proto):
            if isinstance(value_proto, onnx.NodeProto) and value_proto.output:  # (only a node's "name" is a node)
                return value_proto.output[0]
            return super()._parse_value_proto(value_proto)

        def _convert_operator(self, op_name, inputs, attrs, opset):
            if op_name == "Cast" and _widens_narrow_weight(inputs[0], attrs.get("to")):
                out = self.bb.normalize(relax.op.astype(inputs[0], "float32"))  # (TVM's Cast would fold it)
            else:
                out = super()._convert_operator(op_name, inputs, attrs, opset)
            tensor = attrs.get("tvm_custom", {}).get("name")
            if isinstance(out, relax.Call) and tensor:
                span = tvm.ir.Span(tvm.ir.SourceName(tensor), 0, 0, 0, 0)
                out = self.bb.normalize(relax.Call(out.op, out.args, out.attrs, out.ty_args, span))
            return out

    if view.ir_version < 3:
        raise FrontendError(f"ONNX IR version {view.ir_version} is older than TVM's importer reads (3)")
    opset = next((o.version for o in view.opset_import if str(o.domain) in ("", "ai.onnx")), 1)
    return NamingImporter(None, "float32", keep_params_in_input=False, sanitize=True).from_onnx(view.graph, opset)


def _widens_narrow_weight(value, to) -> bool:
    """Whether an ONNX Cast to ``to`` of ``value`` widens a large fp16 weight (:func:`_stored_narrow`)."""
    return (isinstance(value, Constant) and to is not None
            and _stored_narrow(constant_value(value), str(onnx.helper.tensor_dtype_to_np_dtype(int(to)))))


def external_weights(graph, weights: dict | None) -> dict:
    """The arrays that ``graph``'s external-data initializers bind to, checked against them: each name
    given, of the initializer's dtype and shape, and 64-byte aligned (TVM binds it without a copy)."""
    given = weights or {}
    bound = {}
    for init in graph.initializer:
        if not uses_external_data(init):
            continue
        if init.name not in given:
            where = ExternalDataInfo(init).location
            raise FrontendError(f"initializer {init.name!r} is held as external data ({where}) that was not "
                                "loaded: load the model from its file, or pass its arrays as weights={name: array}")
        array = np.asarray(given[init.name])
        want = (onnx.helper.tensor_dtype_to_np_dtype(init.data_type), tuple(init.dims))
        if (array.dtype, array.shape) != want:
            raise FrontendError(f"weights[{init.name!r}] is {array.dtype} {list(array.shape)}; the graph's "
                                f"initializer is {want[0]} {list(want[1])}")
        if array.size and (array.ctypes.data % 64 or not array.flags.c_contiguous):
            array = aligned_copy(array)  # (TVM wants 64-byte aligned, contiguous data to bind in place)
        bound[init.name] = array
    if given and not bound:
        raise FrontendError(f"weights were given ({len(given)} arrays), but no initializer of the model is held as "
                            "external data that is not loaded: its weights are inside it (or were loaded with it "
                            "from its file), and the arrays would not be used")
    return bound


def from_onnx(model, input_shapes: dict | None = None, weights: dict | None = None) -> tvm.IRModule:
    """Import an ONNX model as a Relax module with its weights bound as constants.

    Parameters
    ----------
    model : str, Path, bytes or onnx.ModelProto
    input_shapes : dict, optional
        ``{input name: dims}`` to pin dynamic input shapes.
    weights : dict, optional
        ``{initializer name: array}`` for initializers the model holds as external data that is not loaded
        (a decoder's graphs sharing one set of weights): each is bound as a constant in place, never
        copied (a 64-byte aligned array; another is copied once).

    Raises
    ------
    FrontendError
        Naming the file and the problem (unreadable file, unsupported opset or op).
    """
    name = model if isinstance(model, (str, Path)) else getattr(model, "name", "") or "model"
    if isinstance(model, (str, Path)) and weights is None:
        # a file's external data (every exporter's form past 2 GB) is mapped and bound in place, not loaded into
        # the graph (which TVM would then copy again)
        proto = load_onnx(model, external_data=False)
        try:
            weights = mapped_external_data(proto, Path(model).parent) or None
        except LpxUserError as err:
            raise FrontendError(f"{name}: {err}") from None
    else:
        proto = load_onnx(model)
    try:
        bound = external_weights(proto.graph, weights)
        view = _import_view(proto, input_shapes, bound)
    except FrontendError as err:
        raise FrontendError(f"{name}: {err}") from None
    dynamic = dynamic_inputs(view.graph)
    failure = None
    with warnings.catch_warnings(record=True) as caught, native_output_to_log("TVM's ONNX importer"):
        # the importer's warnings (onnx's checker, which cannot read the view and would otherwise serialise
        # every weight, and its own notes) and what it prints are for --debug, not for the user
        warnings.simplefilter("always")
        try:
            with contextlib.redirect_stdout(_DebugLog("TVM's ONNX importer")):
                mod = fold_constant_shapes(_import_named(view, bound))
        except Exception as err:  # the importer raises assorted types; name the model and the reason
            failure = _last_line(err)
            del err
            gc.collect()  # the importer's half-built blocks complain as they go: let them go while captured
    for warning in caught:
        _LOG.debug("TVM's ONNX importer: %s", warning.message)
    if failure is not None:
        if dynamic:  # the usual cause: a shape computation the importer cannot follow symbolically
            raise FrontendError(f"{name}: {pin_advice(dynamic)}")
        raise FrontendError(f"{name}: TVM's ONNX importer failed: {failure}")
    if dynamic:
        warnings.warn(f"{name}: {pin_advice(dynamic)}; until then what depends on them runs on the host",
                      DynamicShapeWarning, stacklevel=2)
    # the importer makes input names identifiers (past_key_values.0.key ─► past_key_values_0_key); keep the
    # model's own, so a compiled model is called with the names its ONNX file gives
    names = [i.name for i in view.graph.input]
    if len(names) == len(mod["main"].params):
        mod["main"] = mod["main"].with_attr("onnx_input_names", names)
    symbolic = {name: dims for name, dims in dynamic.items() if any(isinstance(d, str) and d != "?" for d in dims)}
    if symbolic:  # (an empty dim is not a symbol: a model of empty tensors runs on the host as it is)
        mod["main"] = mod["main"].with_attr("onnx_pin_advice", pin_advice(symbolic))
    return mod


class DynamicShapeWarning(UserWarning):
    """A model input has symbolic dimensions: lpx compiles static shapes only."""


def dynamic_inputs(graph) -> dict:
    """``{input name: [dim, ...]}`` for graph inputs with a symbolic or unknown dimension (a dim is its int
    size, its symbol's name, or ``"?"``); initializers listed as inputs are not inputs."""
    inits = {i.name for i in graph.initializer}
    found = {}
    for value_info in graph.input:
        if value_info.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
                for d in value_info.type.tensor_type.shape.dim]
        if any(isinstance(d, str) for d in dims):
            found[value_info.name] = dims
    return found


def pin_advice(dynamic: dict) -> str:
    """One line naming each dynamic input, its symbolic dims and the ``--input-shape`` to add."""
    parts = []
    for name, dims in dynamic.items():
        symbols = [d for d in dims if isinstance(d, str)]
        parts.append(f"input {name!r} has symbolic dims {symbols} "
                     f"(add --input-shape {name}={','.join(str(d) for d in dims)} with numbers for them)")
    return "; ".join(parts)


class _DebugLog(io.TextIOBase):
    """A text stream whose lines go to the debug log (for libraries that ``print``)."""

    def __init__(self, what: str):
        self.what = what

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                _LOG.debug("%s: %s", self.what, line)
        return len(text)


def _last_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
