"""A compiled model's figures (``CompiledModel.stats``): its programs one after another, a system program at its
chips' makespan, utilisation over every chip; profile reports the same figures."""

import numpy as np
import pytest

import lpx_tvm
from conftest import mlp_stack


def test_a_pipelined_models_figures_are_its_chips_makespan_and_their_summed_work():
    model = mlp_stack(np.random.default_rng(0), [64, 64, 64, 64], batch=2)
    compiled = lpx_tvm.compile(model, config="tiny", system="tiny-2", parallel="pipeline", chips=2)
    (sim,) = compiled.simulators.values()
    chips = [s for _, s in sim.chips]
    stats = compiled.stats
    assert stats.chips == 2 and stats.programs[0].chips == (0, 1)
    assert stats.cycles == max(s.stats.cycles for s in chips) < sum(s.stats.cycles for s in chips)
    work = sum(s.stats.peak_macs_cycles for s in chips)
    room = sum(s.stats.planes * s.stats.array_macs * s.stats.cycles for s in chips)
    assert stats.mac_utilisation == pytest.approx(work / room)
    assert stats.microseconds == pytest.approx(1e6 * stats.cycles / chips[0].config.clock_hz)
    from lpx_tvm.app.tools.profile import profile

    report = profile(compiled)
    assert (report["simulated_cycles"], report["mac_utilisation"]) == (stats.cycles, stats.mac_utilisation)


def test_one_chips_figures_are_its_programs():
    model = mlp_stack(np.random.default_rng(1), [64, 32], batch=4)
    compiled = lpx_tvm.compile(model, config="tiny")
    (sim,) = compiled.simulators.values()
    stats = compiled.stats
    assert (stats.cycles, stats.predicted_cycles, stats.chips) == (sim.stats.cycles, sim.stats.predicted_cycles, 1)
    busy = sim.stats.unit_busy
    assert stats.utilisation == {u: b / (sim.stats.unit_instances[u] * sim.stats.cycles) for u, b in busy.items()}
