"""Timing-only simulation: the schedule verified and its cycles counted, no arithmetic; the same figures as a
full simulator on every zoo model, and the same rejections. On every zoo model the whole-program check proves
the schedule with the timeline of the instruction-by-instruction walk."""

import numpy as np
import pytest

import lpx_tvm
from lpx_tvm.app.tools.zoo import ZOO
from lpx_tvm.runtime_sim import Simulator, check_timing
from lpx_tvm.runtime_sim.check_batch import proven_timeline
from lpx_tvm.runtime_sim.program import validated_columns
from lpx_tvm.runtime_sim.simulator import CallError

from programs import Layout, ins, program


def _figures(stats):
    return (stats.cycles, stats.predicted_cycles, stats.unit_busy, stats.plane_busy, stats.macs,
            stats.sram_bytes_moved, stats.host_bytes, [(r["name"], r["cycles"], r["bound"]) for r in stats.layers])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_timing_only_gives_a_full_runs_cycles_on_every_zoo_model(name):
    entry = ZOO[name]
    model = entry.load()
    feeds = entry.feeds(model)
    compiled = lpx_tvm.compile(model, input_shapes=entry.input_shapes)
    del model
    compiled(*[feeds[n] for n, _, _ in compiled.input_signature])  # the full simulators ran the arithmetic
    for name_, full in compiled.simulators.items():
        timing = Simulator(compiled.programs[name_], timing_only=True)
        # the timing-only load proves the schedule whole-program (check_batch); the instruction-by-instruction walk
        # (check.py) is the independent reference: the same timeline, and the timing-only cycles are its makespan
        where = (full.resident, full.sram_size, full.protected)
        walked = check_timing(full.program, full.config, *where)
        assert proven_timeline(validated_columns(full.program), *where) == walked
        assert timing.stats.cycles == walked.makespan == max(
            ins.cycle + occ.finish for ins, occ in zip(full.program.instructions, walked.occupancies))
        # and the full run's, whose arithmetic ran above: the figures the test's name promises
        assert _figures(timing.stats) == _figures(full.stats)


def test_timing_only_refuses_to_run_and_still_rejects_a_bad_schedule():
    from lpx_tvm.runtime_sim import DType, ScheduleError

    layout = Layout()
    x = layout.const(np.ones((4, 32), np.float32))
    y, z = layout.take((4, 32), DType.F32), layout.take((4, 32), DType.F32)
    # tiny: a 32-lane vector of fp32 in and out is 256 bytes, 8 streams of 32 bytes, all 8 of one direction:
    # one vector per cycle, so 4 rows take 4 cycles, and the result lands after the vector latency of 4
    done = 4 + 4
    legal = program([ins("RELU", [x], [y]), ins("NEG", [y], [z], cycle=done, unit_index=1)], layout,
                    predicted=2 * done)
    timing = Simulator(legal, timing_only=True)
    assert timing.stats.cycles == 2 * done
    with pytest.raises(CallError, match="timing-only"):
        timing.run([])
    racing = program([ins("RELU", [x], [y]), ins("NEG", [y], [z], cycle=1, unit_index=1)], layout)
    with pytest.raises(ScheduleError, match="RAW hazard"):
        Simulator(racing, timing_only=True)
