"""export_library ─► load_module in a fresh process reproduces the result."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lpx_tvm
from conftest import host_op_between_model


@pytest.mark.slow
def test_export_and_reload_in_fresh_process(tmp_path, rng):
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    compiled = lpx_tvm.compile(host_op_between_model(), config="tiny")
    expected = compiled(x)[0]
    lib = tmp_path / "model.so"
    compiled.export_library(lib)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import numpy as np, tvm
        import lpx_tvm
        from tvm import relax
        vm = relax.VirtualMachine(tvm.runtime.load_module({str(lib)!r}), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(np.load({str(tmp_path / 'x.npy')!r}))).numpy()
        assert lpx_tvm.runtime.total_offloaded_calls() == 2
        np.save({str(tmp_path / 'out.npy')!r}, out)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)


def _embedding_then_product(rng):
    """ids ─► Gather of a 2 MiB table (the host's) ─► MatMul by a 2 MiB weight (lpx's)."""
    from onnx import TensorProto, helper, numpy_helper

    table = rng.standard_normal((1024, 512)).astype(np.float32)
    weight = rng.standard_normal((512, 1024)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("MatMul", ["rows", "w"], ["y"])],
        "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1024])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table, weight


@pytest.mark.slow
def test_export_stores_large_constants_in_the_library(tmp_path, rng):
    """The 2 MiB table (a host constant) and the program holding the 2 MiB weight are each stored in the
    library's own section, read back by ``lpx.runtime.stored`` in a fresh process, and the result is numpy's.
    Two such libraries loaded in one process each find their own constants, whichever runs first (a search
    for one export's constants once set aside every other library it looked in)."""
    ids = np.array([3, 1000, 0, 77], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    expected = []
    for k in range(2):
        model, table, weight = _embedding_then_product(rng)
        compiled = lpx_tvm.compile(model)
        assert compiled.report.lpx_functions == 1
        lib = tmp_path / f"embed{k}.so"
        compiled.export_library(lib)
        assert lib.stat().st_size > 2 * table.nbytes  # (both constants are in the file: none left behind)
        expected.append(table[ids] @ weight)
    for order in ((0, 1), (1, 0)):
        script = textwrap.dedent(f"""
            import numpy as np, tvm
            import lpx_tvm
            from tvm import relax
            vms = [relax.VirtualMachine(tvm.runtime.load_module({str(tmp_path)!r} + f"/embed{{k}}.so"), tvm.cpu())
                   for k in (0, 1)]
            ids = tvm.runtime.tensor(np.load({str(tmp_path / 'ids.npy')!r}))
            for k in {order!r}:
                np.save({str(tmp_path)!r} + f"/out{{k}}.npy", vms[k]["main"](ids).numpy())
            assert lpx_tvm.runtime.total_offloaded_calls() == 2
            assert len(lpx_tvm.runtime._STORED_TENSORS) == 4, lpx_tvm.runtime._STORED_TENSORS.keys()
        """)
        subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
        for k in (0, 1):
            np.testing.assert_allclose(np.load(tmp_path / f"out{k}.npy"), expected[k], rtol=1e-4, atol=1e-3)


def test_stored_constants_of_a_library_not_loaded_are_refused_by_name():
    from lpx_tvm.runtime_sim.errors import LpxUserError

    with pytest.raises(LpxUserError, match="id 00000000deadbeef.*not loaded in this process"):
        lpx_tvm.runtime.stored("00000000deadbeef", 0, "<f4", "4")
