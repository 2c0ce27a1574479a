"""The one compile road for systems (codegen/parallel/__init__.py, base.py, runner.py): the registry, the stages
every part runs through (their dumps, their one capacity policy), and the defaults every door shares."""

import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import mlp_model, ort_reference, run_on_lpx
import lpx_tvm
from lpx_tvm.app.cli import build_parser
from lpx_tvm.codegen import Target, SystemCompileError
from lpx_tvm.codegen.parallel import STRATEGIES, Mapping, Part, choices, strategy


def test_the_choices_are_the_registry_and_the_cli_reads_them():
    assert choices() == ("pipeline", "tensor", "expert", "auto")
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions
                  if a.dest == "parallel")
    assert tuple(action.choices) == choices()
    with pytest.raises(ValueError, match="parallel must be one of pipeline, tensor, expert, auto, got 'ring'"):
        Target.parse(config="tiny", system="tiny-2", parallel="ring")


def test_a_new_strategy_is_a_registered_split_and_nothing_else(monkeypatch):
    """A strategy that puts the whole graph on the system's last chip: registered, it is a choice of the options
    and compiles through the same runner."""
    monkeypatch.setattr("lpx_tvm.codegen.parallel.base.STRATEGIES", dict(STRATEGIES))
    from lpx_tvm.codegen.parallel import base

    @strategy("last", "the whole graph on the last chip")
    def split_last(g, chip, system, dtype, chips):
        last = system.chips - 1
        return Mapping("last", [Part(last, g)], tuple(((last, k),) for k in range(len(g.inputs))),
                       tuple((last, k) for k in range(len(g.outputs))), f"on chip {last}")

    monkeypatch.setattr("lpx_tvm.codegen.parallel.STRATEGIES", base.STRATEGIES)
    model = mlp_model()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    compiled = lpx_tvm.compile(model, config="tiny", system="tiny-4", parallel="last")
    (out,) = run_on_lpx(compiled, [x])
    (sim,) = compiled.simulators.values()
    assert sim.program.chips == (3,) and sim.program.notes == "on chip 3"
    np.testing.assert_allclose(out, ort_reference(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallel, chips", [("pipeline", 2), ("tensor", 2)])
def test_dump_dir_writes_every_parts_stages_on_a_system(tmp_path, parallel, chips):
    """dump_dir was ignored under system=: now each part writes its tile, alloc, schedule and emit."""
    compiled = lpx_tvm.compile(mlp_model(), config="tiny", system="tiny-2", parallel=parallel, chips=chips,
                               dump_dir=str(tmp_path))
    (name,) = compiled.programs
    written = sorted(p.name for p in tmp_path.iterdir())
    for chip in range(chips):
        for stage in ("4_tile", "5_alloc", "6_schedule", "7_emit"):
            assert f"{name}.chip{chip}.{stage}.txt" in written
    assert f"{name}.1_lower.txt" in written  # the whole function's graph stages, once
    schedule = (tmp_path / f"{name}.chip1.6_schedule.txt").read_text()
    assert ("RECV" in schedule) and schedule.splitlines()[-1].startswith("makespan ")


@pytest.mark.parametrize("parallel", ["pipeline", "tensor", "auto"])
def test_a_part_whose_activations_do_not_fit_is_named_with_its_chip(parallel):
    """The one capacity policy: a part streams what weights it can (as one chip does); one whose activations
    alone do not fit is a SystemCompileError naming the strategy, the chip and the tensor (the pipeline raised a
    raw CapacityError, which auto did not catch)."""
    from lpx_tvm.codegen.graph import Graph
    from lpx_tvm.codegen.parallel import compile_system
    from lpx_tvm.runtime_sim.system import load_system

    g = Graph()
    x = g.add_tensor((1024, 1024), "float32")  # 4 MiB: the whole of a tiny chip's SRAM
    g.inputs = [x]
    g.outputs = [g.add_node("matmul", [x, g.constant(np.ones((1024, 64), np.float32))], (1024, 64), "float32", "mm",
                            act=lpx_tvm.runtime_sim.Opcode.NOP, act_args=())]
    options = Target.parse(config="tiny", system="tiny-2", parallel=parallel)
    expected = "pipeline" if parallel == "auto" else parallel
    with pytest.raises(SystemCompileError, match=rf"{expected} parallel does not fit chip 0: layer 'mm': .* does not "
                                                 "fit in SRAM"):
        compile_system("big", g, options, load_system("tiny-2"))


def test_partition_then_a_bare_runcodegen_compiles_for_the_chip_it_partitioned_for():
    """partition_for_lpx defaults to tsp, and so does a RunCodegen given no options (it compiled for tiny)."""
    from lpx_tvm import pipeline
    from lpx_tvm.runtime_sim import decode

    mod = relax.transform.RunCodegen()(lpx_tvm.partition_for_lpx(lpx_tvm.from_onnx(mlp_model())))
    ex = tvm.compile(mod, target="lpx")
    assert {decode(blob).config_name for blob in pipeline._EXTERN_PROGRAMS.values()} >= {"tsp"}
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, ort_reference(mlp_model(), {"x": x})[0], rtol=1e-5, atol=1e-5)
    assert Target.parse().config == "tsp"


def test_one_chip_and_a_system_answer_alike():
    """A program on one chip is a system of one: both results name their chips, chip, inputs' destinations,
    links and notes, so that profile, generate, trace and state access never ask which they hold."""
    from lpx_tvm.runtime_sim import load_config

    model = mlp_model()
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    one = lpx_tvm.compile(model, config="tiny")
    two = lpx_tvm.compile(model, config="tiny", system="tiny-2", parallel="pipeline", chips=2)
    one(x), two(x)
    (single,) = one.simulators.values()
    (system,) = two.simulators.values()
    assert [c for c, _ in single.chips] == [0] and single.chips[0][1] is single
    assert [c for c, _ in system.chips] == [0, 1]
    assert single.chip_config == system.chip_config == load_config("tiny")
    assert single.destinations(0) == ((0, 0),) and system.destinations(0) == ((0, 0),)  # stage 0 loads x
    assert single.links == {} and sum(v["bytes"] for v in system.links.values()) == 4 * 32 * 4  # h: [4, 32] fp32
    assert single.notes == "one chip" and system.notes == "2 stages on chips [0, 1]"
