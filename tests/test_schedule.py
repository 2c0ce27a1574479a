"""Static scheduling: predicted == simulated cycles, overlap is real, scheduling changes time not values."""

import numpy as np
import pytest

import lpx_tvm
from conftest import cnn_model, mlp_model, sin_between_model


@pytest.mark.parametrize("make", [mlp_model, cnn_model, sin_between_model])
def test_simulated_cycles_equal_predicted(make):
    compiled = lpx_tvm.compile(make(), config="tiny")
    for name, sim in compiled.simulators.items():
        assert sim.stats.cycles == sim.program.predicted_cycles > 0, name


def test_list_schedule_gives_same_values_as_in_order_and_is_not_slower(rng):
    model = cnn_model()
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    listed = lpx_tvm.compile(model, config="tiny")
    in_order = lpx_tvm.compile(model, config="tiny", in_order=True)
    np.testing.assert_array_equal(listed(x)[0], in_order(x)[0])
    (a,), (b,) = listed.simulators.values(), in_order.simulators.values()
    assert b.stats.cycles == b.stats.instruction_cycles_sum  # in order: nothing overlaps
    assert a.stats.cycles <= b.stats.cycles
