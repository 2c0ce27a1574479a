"""Trained models with real weights, taken from wheels that ship them (no downloads).

The PP-OCR det/rec/cls models come inside ``rapidocr-onnxruntime`` (the
``models`` extra: ``pip install "lpx-tvm[models]"``). They are found through the
package's import spec without importing it, so opencv and friends stay unloaded.
Their dynamic input shapes are pinned to the sizes RapidOCR itself feeds them.

Inputs are synthetic text images, seeded: dark glyph strokes in lines on a light
page, normalised the way RapidOCR normalises (``(x / 255 - 0.5) / 0.5``). Random
normal noise would drive the detector's sigmoid map to ~1e-5 everywhere, where a
relative-error comparison measures nothing but rounding.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx

from ...runtime_sim.errors import LpxUserError

RAPIDOCR_PACKAGE = "rapidocr-onnxruntime"
# name -> (file in the wheel's models/, pinned NCHW shape of input "x")
OCR_MODELS = {
    "ppocr_det": ("ch_PP-OCRv4_det_infer.onnx", (1, 3, 320, 320)),
    "ppocr_rec": ("ch_PP-OCRv4_rec_infer.onnx", (1, 3, 48, 320)),
    "ppocr_cls": ("ch_ppocr_mobile_v2.0_cls_infer.onnx", (1, 3, 48, 192)),
}


class MissingExtraError(LpxUserError, RuntimeError):
    """A model needs an optional package that is not installed."""


def ocr_model_path(name: str) -> Path:
    """Path of a PP-OCR model inside the installed rapidocr-onnxruntime wheel.

    Raises
    ------
    MissingExtraError
        When rapidocr-onnxruntime is not installed.
    """
    if name not in OCR_MODELS:
        raise LpxUserError(f"unknown OCR model {name!r}; choose from {', '.join(OCR_MODELS)}")
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(f"{name} needs {RAPIDOCR_PACKAGE}: pip install \"lpx-tvm[models]\"")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / OCR_MODELS[name][0]
    if not path.is_file():
        raise MissingExtraError(f"{name}: {path} is missing from the installed {RAPIDOCR_PACKAGE}")
    return path


def ocr_model(name: str) -> onnx.ModelProto:
    """A PP-OCR model as shipped, trained weights and all."""
    return onnx.load(str(ocr_model_path(name)))


def ocr_input_shapes(name: str) -> dict:
    """The pinned input shape of a PP-OCR model, as ``{"x": dims}``."""
    return {"x": list(OCR_MODELS[name][1])}


def text_image(shape, seed: int = 1) -> np.ndarray:
    """A seeded synthetic text image, NCHW float32, normalised as RapidOCR does."""
    batch, channels, height, width = shape
    rng = np.random.default_rng(seed)
    page = np.full((height, width), 235.0) + rng.normal(0, 6, (height, width))
    line_height = max(8, min(height, 40) * 3 // 5)
    for top in range(max(2, height // 10), height - line_height, line_height * 2):
        left = int(rng.integers(2, max(3, width // 8)))
        while left < width - 8:
            glyph = int(rng.integers(line_height // 3, line_height))
            stroke = max(2, line_height // 6)
            for _ in range(3):  # a few strokes per glyph, vertical or horizontal
                if rng.random() < 0.5:
                    x = left + int(rng.integers(0, glyph))
                    page[top:top + line_height, x:x + stroke] = rng.uniform(10, 60)
                else:
                    y = top + int(rng.integers(0, line_height))
                    page[y:y + stroke, left:left + glyph] = rng.uniform(10, 60)
            left += glyph + int(rng.integers(2, line_height // 2 + 3))
    image = np.clip(page, 0, 255) / 255.0
    image = (image - 0.5) / 0.5
    return np.broadcast_to(image, (batch, channels, height, width)).astype(np.float32)
