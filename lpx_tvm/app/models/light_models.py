"""Models the installed packages ship, made meaningful with seeded random weights.

The onnx package's ``backend/test/data/light`` models build every weight with
``ConstantOfShape`` of one value, so every output is the same number. Here each
such weight becomes an initializer with seeded random values, scaled by its role
(He-style for convolution and Gemm weights, near-identity batch norm), so
activations stay in range through deep networks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...runtime_sim.errors import LpxUserError

LIGHT_MODELS = ("alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
                "squeezenet", "vgg19", "zfnet512")
_LIGHT_FILES = {"alexnet": "light_bvlc_alexnet.onnx"}


def light_model_path(name: str) -> Path:
    """Path of one of the onnx package's light models."""
    if name not in LIGHT_MODELS:
        raise LpxUserError(f"unknown light model {name!r}; choose from {', '.join(LIGHT_MODELS)}")
    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    return root / _LIGHT_FILES.get(name, f"light_{name}.onnx")


def _weight(rng, shape, op_type: str, position: int, bn_role: int | None) -> np.ndarray:
    shape = tuple(int(d) for d in shape)
    if bn_role is not None:  # scale, bias, mean, var
        return [rng.uniform(0.2, 0.5, shape), rng.normal(0, 0.05, shape),
                rng.normal(0, 0.1, shape), rng.uniform(0.5, 1.5, shape)][bn_role].astype(np.float32)
    if op_type in ("Conv", "Gemm", "MatMul") and position == 1 and len(shape) >= 2:
        fan_in = int(np.prod(shape[1:])) if op_type == "Conv" else shape[0] if op_type == "MatMul" else shape[1]
        return rng.normal(0, np.sqrt(2.0 / max(fan_in, 1)), shape).astype(np.float32)
    return rng.normal(0, 0.05, shape).astype(np.float32)


def randomize_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Replace constant-filled weights (ConstantOfShape of an initializer shape) with seeded random ones."""
    rng = np.random.default_rng(seed)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    uses = {}
    for node in graph.node:
        for pos, name in enumerate(node.input):
            uses.setdefault(name, (node.op_type, pos))
    keep = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input and node.input[0] in inits:
            shape = numpy_helper.to_array(inits[node.input[0]])
            op_type, pos = uses.get(node.output[0], ("", 0))
            role = pos - 1 if op_type == "BatchNormalization" and 1 <= pos <= 4 else None
            # added one at a time: a list of them all, then copied into the graph, would hold every weight twice
            graph.initializer.add().CopyFrom(numpy_helper.from_array(_weight(rng, shape, op_type, pos, role),
                                                                     node.output[0]))
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    used = {n for node in graph.node for n in node.input}
    for index in reversed([k for k, init in enumerate(graph.initializer) if init.name not in used]):
        del graph.initializer[index]
    init_names = {i.name for i in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in init_names and i.name in used]
    del graph.input[:]
    graph.input.extend(real_inputs)
    return model


def light_model(name: str, seed: int = 0) -> onnx.ModelProto:
    """A light model from the onnx package with seeded random weights."""
    return randomize_weights(onnx.load(str(light_model_path(name))), seed)
