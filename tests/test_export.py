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
