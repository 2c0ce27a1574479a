"""``lpx_tvm.quantize``: an fp32 ONNX model ─► a QDQ int8 model, by ONNX Runtime's own quantiser.

Static quantisation, QDQ format, int8 activations and per-channel int8 weights:
the form ``lpx_tvm.compile(..., dtype="int8")`` runs as int8 on lpx. We write no
quantiser of our own; this only prepares the model, feeds the calibration data and
chooses what ONNX Runtime's quantiser quantises.

A decoder step (a graph with a KV cache: ``past_key_values.*`` inputs) is quantised
at its products, as int8 decoders run (W8A8): each MatMul's and Gemm's inputs are
int8, and everything between the products (norms, rotary embeddings, softmax, SiLU,
residual adds) stays float, its products' results included (unless a result is a
graph output: the logits stay quantised). Quantised whole, every one of those ops
sits between a DequantizeLinear and a QuantizeLinear of its own: a decode step is a
chain of small vector ops, each paying a pipeline's latency, and the round trips
made int8 half again slower than fp16 (issue 50). Other models (CNNs, encoders) are
quantised whole, as before.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx
import onnx.version_converter

from .frontend import load_onnx, prepare_onnx
from .runtime_sim.errors import LpxUserError

QDQ_MIN_OPSET = 13
PRODUCTS = ("MatMul", "Gemm")


def quantize(model, calibration_inputs, per_channel: bool = True, input_shapes: dict | None = None,
             activations: str = "int8", products_only: bool | None = None) -> onnx.ModelProto:
    """Quantise ``model`` statically with ONNX Runtime, calibrated on ``calibration_inputs``.

    Parameters
    ----------
    model : str, Path, bytes or onnx.ModelProto
        An fp32 model.
    calibration_inputs : dict or sequence of dict
        One or more ``{input name: array}`` feeds, representative of real inputs.
    per_channel : bool
        Per-output-channel weight scales (default), as lpx's int8 kernels expect.
    input_shapes : dict, optional
        ``{input name: dims}`` to pin dynamic input shapes first.
    activations : str
        ``"int8"`` (default) or ``"uint8"``, the form of many published int8 models.
    products_only : bool, optional
        Quantise only the matrix products' inputs (the rest stays float); default: for a decoder step (a
        ``past_key_values.*`` input), see the module's docstring.

    Returns
    -------
    onnx.ModelProto
        The QDQ model (QuantizeLinear/DequantizeLinear around each quantised op).
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if activations not in ("int8", "uint8"):
        raise LpxUserError(f"activations must be 'int8' or 'uint8', got {activations!r}")
    feeds = [calibration_inputs] if isinstance(calibration_inputs, dict) else list(calibration_inputs)
    if not feeds:
        raise LpxUserError("quantize needs at least one calibration input")
    prepared = prepare_onnx(load_onnx(model), input_shapes)
    opset = next((o.version for o in prepared.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < QDQ_MIN_OPSET:  # per-channel DequantizeLinear (its axis attribute) needs opset 13
        prepared = onnx.version_converter.convert_version(prepared, QDQ_MIN_OPSET)
    names = {i.name for i in prepared.graph.input}
    if products_only is None:
        products_only = is_decoder_step(prepared)
    for feed in feeds:
        if set(feed) != names:
            raise LpxUserError(f"calibration inputs name {sorted(feed)}, the model's inputs are {sorted(names)}")

    class _Reader(CalibrationDataReader):
        def __init__(self):
            self._feeds = iter(feeds)

        def get_next(self):
            return next(self._feeds, None)

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        source, optimised, target = (Path(tmp) / name for name in ("fp32.onnx", "fp32_pre.onnx", "int8.onnx"))
        onnx.save(prepared, str(source))
        # the calibration sessions log a line per unused initializer; errors still show
        ort.set_default_logger_severity(3)
        root = logging.getLogger()
        level = root.level
        root.setLevel(max(level, logging.ERROR))
        try:
            # ONNX Runtime's own pre-processing: shape inference and its basic optimiser, which folds batch
            # norm into the convolution before it, so the quantised convolution carries the folded weights
            quant_pre_process(str(source), str(optimised), skip_symbolic_shape=True)
            quantize_static(str(optimised), str(target), _Reader(), quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, weight_type=QuantType.QInt8,
                            activation_type=QuantType.QInt8 if activations == "int8" else QuantType.QUInt8,
                            op_types_to_quantize=list(PRODUCTS) if products_only else None)
        finally:
            ort.set_default_logger_severity(2)  # ONNX Runtime's default
            root.setLevel(level)
        quantised = onnx.load(str(target))
    if products_only:
        float_results(quantised)
    return quantised


def is_decoder_step(model: onnx.ModelProto) -> bool:
    """A decoder step as exporters write one: a KV cache in (``past_key_values.*``, optimum's and torch.onnx's
    name for it)."""
    return any(i.name.startswith("past_key_values") for i in model.graph.input)


def float_results(model: onnx.ModelProto) -> int:
    """Drop the QuantizeLinear ─► DequantizeLinear pair ONNX Runtime's quantiser puts on each product's result
    (MatMul, Gemm), unless it is a graph output or another product reads it: the readers take the float result
    (lpx's int8 product makes it in its epilogue, a product reading it requantises there). Edits ``model``;
    returns how many QuantizeLinears went."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    readers = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in model.graph.output}
    rename, dropped, pairs = {}, set(), 0
    for quant in nodes:
        source = producer.get(quant.input[0]) if quant.op_type == "QuantizeLinear" else None
        if source is None or source.op_type not in PRODUCTS or len(readers.get(quant.input[0], [])) != 1:
            continue
        dequants = readers.get(quant.output[0], [])
        if not dequants or any(d.op_type != "DequantizeLinear" or d.output[0] in outputs
                               or any(r.op_type in PRODUCTS for r in readers.get(d.output[0], [])) for d in dequants):
            continue  # a graph output, or another product's operand: it stays quantised
        dropped |= {id(quant)} | {id(d) for d in dequants}
        rename.update({d.output[0]: quant.input[0] for d in dequants})
        pairs += 1
    kept = [n for n in nodes if id(n) not in dropped]
    for n in kept:
        for k, name in enumerate(n.input):
            n.input[k] = rename.get(name, name)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    # the dropped pairs' own scales and zero points, where nothing kept reads them
    params = {i for n in nodes if id(n) in dropped for i in n.input[1:]} - {i for n in kept for i in n.input}
    initializers = [t for t in model.graph.initializer if t.name not in params]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    return pairs
