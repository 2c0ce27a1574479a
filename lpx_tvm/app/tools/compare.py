"""``lpx-tvm compare``: where lpx and ONNX Runtime part ways, layer by layer.

Every layer output worth watching (in a QDQ model, every QuantizeLinear output;
in a float one, every operator output that is not a weight) becomes an extra
output of the model, so one lpx run and one ONNX Runtime run give both sides of
every layer. Exposing an intermediate keeps it out of a fusion that would have
hidden it; the values are the same either way.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx

from ...runtime_sim.errors import LpxUserError
from ..output import Report, Table

_SKIP = {"Shape", "Constant", "ConstantOfShape", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity",
         "DequantizeLinear", "Cast", "Transpose", "Gather", "Concat", "Slice"}


def watched_tensors(model: onnx.ModelProto) -> list:
    """The layer outputs to compare, in graph order."""
    # weights: the initializers, and what nodes make from weights alone (a Constant, a chain of them on one)
    weights = {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        if all(i in weights for i in node.input if i):
            weights.update(node.output)
    quantized = any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    outputs = {o.name for o in model.graph.output}
    names = []
    for node in model.graph.node:
        if quantized and node.op_type != "QuantizeLinear":
            continue
        if not quantized and node.op_type in _SKIP:
            continue
        for out in node.output[:1]:
            if out and out not in weights and out not in outputs:
                names.append(out)
    return names


def exposed(model: onnx.ModelProto, names: list) -> onnx.ModelProto:
    """``model`` with ``names`` added as outputs (their types left for the importers to infer)."""
    model = copy.deepcopy(model)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for name in names:
        info = types.get(name)
        model.graph.output.append(copy.deepcopy(info) if info is not None and info.type.tensor_type.HasField("shape")
                                  else onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model


def _metrics(ours: np.ndarray, ref: np.ndarray) -> dict:
    a, b = np.asarray(ours, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    noise = float(np.sum((a - b) ** 2))
    signal = float(np.sum(b ** 2))
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    # two all-zero tensors agree exactly (a ReLU layer can be all zeros): cosine 1, not 0
    cosine = float(a @ b / norms) if norms else float(not a.any() and not b.any())
    with np.errstate(divide="ignore"):  # (a reference of zeros against a result that is not: -inf dB)
        sqnr = float(10 * np.log10(signal / noise)) if noise else float("inf")
    out = {"cosine": cosine, "sqnr_db": sqnr,
           "max_abs_err": float(np.abs(a - b).max()) if a.size else 0.0}
    if np.issubdtype(np.asarray(ref).dtype, np.integer):  # quantised: how many values agree within one step
        out["within_one_step_pct"] = 100.0 * float(np.mean(np.abs(a - b) <= 1))
    return out


def compare(model, config: str = "tsp", dtype: str = "fp32", input_shapes: dict | None = None,
            feeds: dict | None = None, min_cosine: float = 0.999) -> dict:
    """Run ``model`` on lpx and on ONNX Runtime and compare every watched layer output.

    Parameters
    ----------
    model : str, Path or onnx.ModelProto
        A float model, or a QDQ model with ``dtype="int8"``.
    min_cosine : float
        A layer below this cosine similarity is where the two part ways.

    Returns
    -------
    dict
        ``layers``: one record per watched tensor (name, op, cosine, SQNR in dB,
        max abs error, and for integers the share within one step), ``first_below``:
        the first layer under ``min_cosine`` (or None), and ``outputs``: the same
        for the model's own outputs.
    """
    import onnxruntime as ort

    from ... import compile as lpx_compile
    from ...frontend import load_onnx, prepare_onnx
    from .zoo import seeded_inputs

    if not -1 <= min_cosine <= 1:  # (a cosine is in [-1, 1]: above 1, every layer would part ways)
        raise LpxUserError(f"min_cosine must be a cosine, in [-1, 1], got {min_cosine}")

    proto = prepare_onnx(load_onnx(model), input_shapes)
    names = watched_tensors(proto)
    wide = exposed(proto, names)
    feeds = feeds or seeded_inputs(proto)
    session = ort.InferenceSession(wide.SerializeToString(), providers=["CPUExecutionProvider"])
    references = session.run(None, feeds)
    compiled = lpx_compile(wide, config=config, dtype=dtype)
    ours = compiled(*[feeds[name] for name, _, _ in compiled.input_signature])
    producers = {out: node.op_type for node in proto.graph.node for out in node.output}
    n_outputs = len(proto.graph.output)
    records = []
    for name, mine, ref in zip(names, ours[n_outputs:], references[n_outputs:]):
        records.append({"tensor": name, "op": producers.get(name, "?"), **_metrics(mine, ref)})
    first = next((r for r in records if r["cosine"] < min_cosine), None)
    outputs = [{"tensor": o.name, **_metrics(mine, ref)} for o, mine, ref in zip(proto.graph.output, ours, references)]
    return {"model": str(getattr(model, "name", model)) if not isinstance(model, onnx.ModelProto) else "model",
            "dtype": dtype, "config": config, "layers": records, "first_below": first, "outputs": outputs,
            "min_cosine": min_cosine}


def table(report: dict) -> Report:
    """The comparison's :class:`~lpx_tvm.app.output.Report`: a row a watched layer, then the first below
    ``min_cosine`` and each output's agreement."""
    rows = [[i, r["tensor"][-40:], r["op"], f"{r['cosine']:.6f}", f"{r['sqnr_db']:.1f}", f"{r['max_abs_err']:.3g}",
             f"{r['within_one_step_pct']:.1f}" if "within_one_step_pct" in r else ""]
            for i, r in enumerate(report["layers"])]
    first = report["first_below"]
    verdict = (f"first layer below cosine {report['min_cosine']}: {first['tensor']} ({first['op']}, cosine "
               f"{first['cosine']:.6f}, SQNR {first['sqnr_db']:.1f} dB)" if first else
               f"every layer at cosine >= {report['min_cosine']}")
    outs = "; ".join(f"{o['tensor']}: cosine {o['cosine']:.6f}, SQNR {o['sqnr_db']:.1f} dB" for o in report["outputs"])
    headers = ["#", "tensor", "op", "cosine", "SQNR dB", "max abs err", "% within 1 step"]
    return Report(f"{report['model']} against ONNX Runtime, layer by layer ({report['dtype']} on {report['config']})",
                  [Table(headers, rows), f"{verdict}\noutputs: {outs}"], report)
