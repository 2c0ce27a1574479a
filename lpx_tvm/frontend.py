"""ONNX ─► Relax with weights bound, and the cheap folding the patterns need.

Folding here is numpy work on the ONNX graph or on Relax constants; it never
builds anything with LLVM (``FoldConstant`` would, once per constant).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .codegen.relax_ops import PRIM_TYPES, Constant, constant_value, quantize_array


class FrontendError(ValueError):
    """A model that cannot be read or imported, with the reason and the file."""


def load_onnx(model) -> onnx.ModelProto:
    """Read an ONNX model from a path, bytes or a ModelProto, with clear errors."""
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
            proto = onnx.load(str(path))
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


def _set_shape(value_info, dims) -> None:
    shape = value_info.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = int(d)


def prepare_onnx(model: onnx.ModelProto, input_shapes: dict | None = None) -> onnx.ModelProto:
    """Normalise an ONNX model for import.

    - graph inputs that are really initializers are dropped (old IR versions
      list them, and the importer would then duplicate the weights);
    - ``Sum`` becomes a chain of ``Add`` (the importer's stack+sum hides the adds);
    - ``Dropout`` becomes ``Identity`` (inference);

    Batch norm is folded into the convolution before it once, in the codegen
    (lowering makes it a per-channel scale and shift, ``fuse`` folds those).
    - ``input_shapes`` (name -> dims) pins dynamic input dimensions.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    init_names = {i.name for i in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in init_names]
    del graph.input[:]
    graph.input.extend(real_inputs)
    nodes = []
    for node in graph.node:
        if node.op_type == "Dropout":  # identity at inference; its mask output is never used by a model
            nodes.append(helper.make_node("Identity", node.input[:1], node.output[:1], name=node.name))
        elif node.op_type == "Sum" and len(node.input) >= 2:
            acc = node.input[0]
            for k, name in enumerate(node.input[1:]):
                out = node.output[0] if k == len(node.input) - 2 else f"{node.output[0]}__sum{k}"
                nodes.append(helper.make_node("Add", [acc, name], [out], name=f"{node.name}_add{k}"))
                acc = out
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    for name, dims in (input_shapes or {}).items():
        match = [i for i in graph.input if i.name == name]
        if not match:
            raise FrontendError(f"--input-shape names {name!r}, but the model's inputs are "
                                f"{[i.name for i in graph.input]}")
        _set_shape(match[0], dims)
    if model.ir_version < 4:
        model.ir_version = 4
    if any(node.op_type == "Shape" for node in graph.node) and _all_inputs_static(graph):
        model = _fold_shape_computations(model)
    return model


def _all_inputs_static(graph) -> bool:
    return all(d.HasField("dim_value") and d.dim_value > 0
               for i in graph.input for d in i.type.tensor_type.shape.dim)


def _fold_shape_computations(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape ─► Slice ─► Concat ─► Reshape chains on static shapes become constants.

    TVM's importer needs Reshape targets it can see; exporters (paddle2onnx,
    torch) compute them at run time. With every input shape pinned, ONNX
    Runtime's basic graph optimiser (constant folding and standard-op fusions
    only, no contrib ops) folds them, so we use it rather than a folder of our own.
    """
    import tempfile

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3  # not a line per initializer the folding leaves unused
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "folded.onnx")
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # ORT rejects models it cannot run; say so rather than import a half-folded graph
            raise FrontendError(f"{model.graph.name or 'model'}: cannot fold its shape computations "
                                f"({str(err).strip().splitlines()[0]})") from None
        return onnx.load(options.optimized_model_filepath)


_TE_MIN_MAX = re.compile(r"^(maximum|minimum)\d*$")
_NUMPY_ELEMENTWISE = {
    "relax.sqrt": np.sqrt, "relax.exp": np.exp, "relax.negative": np.negative, "relax.add": np.add,
    "relax.subtract": np.subtract, "relax.multiply": np.multiply, "relax.divide": np.divide, "relax.power": np.power,
}


@mutator
class _FoldConstantShapes(PyExprMutator):
    """Numpy folding the importer leaves undone, so that patterns see plain ops.

    - reshape / permute_dims / astype of a constant ─► a constant;
    - elementwise arithmetic on constants alone (sqrt, add, ...) ─► a constant;
    - isnan / where on constants ─► a constant (the importer's NaN-bound guard for Clip);
    - quantize of a constant ─► integers (a QDQ weight stored as Q(float));
    - ``call_tir(maximum|minimum, x, scalar)`` (Clip, which the importer emits as TE
      functions) ─► ``relax.maximum|minimum``, and ``minimum(maximum(x, lo), hi)`` ─► ``clip``.
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
        consts = [self._constant(a) for a in call.args]
        if consts[0] is None:
            return call
        value = constant_value(consts[0])
        if name == "relax.reshape":
            return relax.const(value.reshape([int(d) for d in call.ty.shape.values]))
        if name == "relax.permute_dims":
            axes = None if call.attrs.axes is None else [int(a) for a in call.attrs.axes]
            return relax.const(np.ascontiguousarray(value.transpose(axes)))
        if name == "relax.astype":
            return relax.const(value.astype(str(call.ty.dtype)))
        if name == "relax.quantize" and all(c is not None for c in consts):
            return relax.const(quantize_array(value, *(constant_value(c) for c in consts[1:]),
                                              int(call.attrs.axis), str(call.ty.dtype)))
        if name in _NUMPY_ELEMENTWISE and all(c is not None for c in consts):
            # an importer's constant arithmetic (ONNX functions write sqrt(2) as Sqrt(CastLike(2)))
            result = _NUMPY_ELEMENTWISE[name](value, *(constant_value(c) for c in consts[1:]))
            return relax.const(np.asarray(result).astype(str(call.ty.dtype)))
        if name == "relax.isnan":
            return relax.const(np.isnan(value))
        if name == "relax.where" and all(c is not None for c in consts):
            return relax.const(np.where(value, *(constant_value(c) for c in consts[1:])).astype(str(call.ty.dtype)))
        return call

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


def fold_constant_shapes(mod: tvm.IRModule) -> tvm.IRModule:
    """Fold what the importer leaves (see ``_FoldConstantShapes``), inline constants, drop dead functions."""
    folder = _FoldConstantShapes(mod)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gvar] = folder.visit_expr(func)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return relax.transform.DeadCodeElimination(["main"])(mod)


def from_onnx(model, input_shapes: dict | None = None) -> tvm.IRModule:
    """Import an ONNX model as a Relax module with its weights bound as constants.

    Parameters
    ----------
    model : str, Path, bytes or onnx.ModelProto
    input_shapes : dict, optional
        ``{input name: dims}`` to pin dynamic input shapes.

    Raises
    ------
    FrontendError
        Naming the file and the problem (unreadable file, unsupported opset or op).
    """
    name = model if isinstance(model, (str, Path)) else getattr(model, "name", "") or "model"
    proto = prepare_onnx(load_onnx(model), input_shapes)
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    try:
        mod = tvm_from_onnx(proto, keep_params_in_input=False)
    except Exception as err:  # the importer raises assorted types; name the model and the reason
        raise FrontendError(f"{name}: TVM's ONNX importer failed: {str(err).strip().splitlines()[-1]}") from None
    return fold_constant_shapes(mod)
