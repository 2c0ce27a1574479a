"""Import a model of more than 2 GB whose shape computations the frontend folds with ONNX Runtime.

Protobuf cannot serialise a message past 2 GB, and folding once handed ONNX Runtime the whole model
(``Failed to serialize proto``); it now hands over the graph without its weights. This builds such a model
(an embedding table of ``--gb`` GB, a Reshape whose target is computed from the input's shape), stores it
with external data, loads it as a user would (``onnx.load``, weights and all), imports it with
``lpx_tvm.from_onnx`` and prints the time and the peak resident memory. Run by the ``slow`` test in
``tests/test_regressions_round.py``; exits non-zero if the import fails or a row of the table comes back
wrong.

    python scripts/fold_large_model.py --gb 2.2
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 1024


def build(path: Path, gigabytes: float) -> int:
    """Write the model to ``path`` (its table as external data in ``<path>.data``); returns the table's rows.
    Row ``i`` of the table holds ``i`` everywhere, so any row read back names itself."""
    rows = int(gigabytes * 1e9) // (HIDDEN * 4)
    data = path.with_name(path.name + ".data")
    # written straight to the data file, a block of rows at a time: a message past 2 GB cannot even be built
    # (protobuf copies a tensor into a graph by serialising it)
    with open(data, "wb") as out:
        for first in range(0, rows, 1 << 16):
            block = np.arange(first, min(first + (1 << 16), rows), dtype=np.float32)
            out.write(np.repeat(block[:, None], HIDDEN, axis=1).tobytes())
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[rows, HIDDEN],
                        data_location=TensorProto.EXTERNAL)
    for key, value in (("location", data.name), ("offset", "0"), ("length", str(rows * HIDDEN * 4))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    inits = [table, numpy_helper.from_array(np.array([HIDDEN], np.int64), "hidden")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], axis=0),
             helper.make_node("Shape", ["ids"], ["shape"]),
             helper.make_node("ReduceProd", ["shape"], ["tokens"], keepdims=1),
             helper.make_node("Concat", ["tokens", "hidden"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                                   ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return rows


def main(argv=None) -> int:
    """Build, load and import the model; print ``{"rows", "table_gb", "build_s", "load_s", "import_s",
    "peak_rss_gb"}`` as JSON (the peak as the import ends: the model as loaded, and TVM's copy of it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="the table's size in GB (default 2.2: past 2 GB)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "embedding.onnx"
        start = time.perf_counter()
        rows = build(path, args.gb)
        built = time.perf_counter()
        model = onnx.load(str(path))
        loaded = time.perf_counter()
        import lpx_tvm

        mod = lpx_tvm.from_onnx(model, input_shapes={"ids": [1, 4]})
        imported = time.perf_counter()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # (kB on Linux)
    del model
    import tvm
    from tvm import relax

    tables = []
    def table(expr):
        data = getattr(expr, "value", None) if isinstance(expr, tvm.ir.Constant) else None
        if hasattr(data, "shape") and tuple(data.shape) == (rows, HIDDEN):
            tables.append(data)
    relax.analysis.post_order_visit(mod["main"].body, table)
    if not tables:
        print("the table is not among the imported module's constants", file=sys.stderr)
        return 1
    value = np.from_dlpack(tables[0])  # (the one table, read by the Gather and by the Shape the importer kept)
    probes = [0, 1, rows // 2, rows - 1]
    if any(not (value[r] == r).all() for r in probes):
        print("a row of the table came back wrong", file=sys.stderr)
        return 1
    print(json.dumps({"rows": rows, "table_gb": rows * HIDDEN * 4 / 1e9, "build_s": round(built - start, 1),
                      "load_s": round(loaded - built, 1), "import_s": round(imported - loaded, 1),
                      "peak_rss_gb": round(peak, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
