"""``lpx_tvm.quantize``: an fp32 ONNX model ─► a QDQ int8 model, by ONNX Runtime's own quantiser.

Static quantisation, QDQ format, int8 activations and per-channel int8 weights:
the form ``lpx_tvm.compile(..., dtype="int8")`` runs as int8 on lpx. We write no
quantiser of our own; this only prepares the model and feeds the calibration data.
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


def quantize(model, calibration_inputs, per_channel: bool = True, input_shapes: dict | None = None,
             activations: str = "int8") -> onnx.ModelProto:
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
                            activation_type=QuantType.QInt8 if activations == "int8" else QuantType.QUInt8)
        finally:
            ort.set_default_logger_severity(2)  # ONNX Runtime's default
            root.setLevel(level)
        return onnx.load(str(target))
