"""One Target: parsed once at a door, carried as objects, hashable, round-tripped through plain values."""

import argparse

import numpy as np
import pytest

import lpx_tvm
from conftest import mlp_stack
from lpx_tvm.codegen import Target
from lpx_tvm.runtime_sim import ChipConfig, load_config
from lpx_tvm.runtime_sim.config import config_from_dict
from lpx_tvm.runtime_sim.errors import LpxUserError
from lpx_tvm.runtime_sim.system import SystemConfig, load_system


def test_parse_resolves_the_chip_and_system_into_objects_once():
    target = Target.parse(system="tiny-2", parallel="tensor", chips=2, dtype="fp16")
    assert isinstance(target.chip, ChipConfig) and isinstance(target.system, SystemConfig)
    assert target.chip == load_system("tiny-2").chip and target.system.chips == 2  # the system's chip by default
    assert target.config == "tiny"
    assert Target.parse().chip == load_config("tsp")


def test_a_target_is_frozen_and_hashable_and_equal_targets_hash_alike():
    a = Target.parse("tiny", "tiny-4", "fp16", "pipeline", 3)
    b = Target.parse("tiny", "tiny-4", "fp16", "pipeline", 3)
    assert a == b and hash(a) == hash(b) and len({a: 1, b: 2}) == 1
    assert a != Target.parse("tiny", "tiny-4", "fp32", "pipeline", 3)
    with pytest.raises(AttributeError):
        a.dtype = "fp32"


def test_a_target_holds_objects_not_names():
    with pytest.raises(LpxUserError, match="a Target's chip is a ChipConfig"):
        Target("tsp")
    with pytest.raises(LpxUserError, match="a Target's system is a SystemConfig"):
        Target(load_config("tiny"), "tiny-2")
    with pytest.raises(LpxUserError, match="made of 'tiny' chips, not 'tsp'"):
        Target(load_config("tsp"), load_system("tiny-2"))


def test_to_dict_and_back_carries_a_chip_that_no_registry_knows():
    """A chip built from parameters (a design point never registered by name) survives the plain-value door
    TVM's RunCodegen passes options through, by its parameters."""
    params = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(load_config("tiny")).items()}
    chip = config_from_dict({**params, "name": "tiny-unregistered", "sram_bytes": 8 << 20})
    target = Target(chip, dtype="fp16")
    back = Target.from_dict(target.to_dict())
    assert back == target and back.chip.sram_bytes == 8 << 20
    assert Target.from_dict(Target.parse(system="tiny-2").to_dict()) == Target.parse(system="tiny-2")
    with pytest.raises(LpxUserError, match=r"unknown lpx target options \['colour'\]"):
        Target.from_dict({"colour": "red"})


def test_key_tells_two_chips_of_one_name_apart():
    params = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(load_config("tiny")).items()}
    bigger = config_from_dict({**params, "sram_bytes": 8 << 20})  # named "tiny" too
    assert Target(bigger).key() != Target.parse("tiny").key()
    assert Target.parse("tiny").key() == Target.parse("tiny").key()


def test_the_command_lines_flags_come_from_the_target():
    parser = argparse.ArgumentParser()
    Target.add_arguments(parser)
    args = parser.parse_args(["--system", "tiny-2", "--parallel", "tensor", "--chips", "2", "--dtype", "fp16"])
    assert Target.from_args(args) == Target.parse(None, "tiny-2", "fp16", "tensor", 2)
    one_chip = argparse.ArgumentParser()
    Target.add_arguments(one_chip, system=False)
    with pytest.raises(SystemExit):
        one_chip.parse_args(["--system", "tiny-2"])


def test_compile_takes_a_target_and_refuses_it_said_twice():
    model = mlp_stack(np.random.default_rng(0), [64, 64, 64], batch=2)
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    by_words = lpx_tvm.compile(model, config="tiny", dtype="fp16")
    by_target = lpx_tvm.compile(model, target=Target.parse("tiny", dtype="fp16"))
    assert list(by_target.programs.values()) == list(by_words.programs.values())
    np.testing.assert_array_equal(by_target(x)[0], by_words(x)[0])
    with pytest.raises(LpxUserError, match="target= says what to compile for; dtype would say it again"):
        lpx_tvm.compile(model, target=Target.parse("tiny"), dtype="fp16")


def test_no_name_is_turned_into_a_machine_outside_the_target_parser():
    """``load_config``/``load_system`` appear only in codegen/target.py (chip_of, system_of) and among the presets
    (runtime_sim): every other layer receives the objects."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\bload_(config|system)\b")
    found = [f"{path.relative_to(root)}:{n}" for folder in ("lpx_tvm", "codegen")
             for path in sorted((root / folder).rglob("*.py")) if path != root / "codegen" / "target.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_each_compile_door_builds_one_target(tmp_path, targets_made):
    """The command line, lpx_tvm.compile and a TVM target each parse the user's words into one Target, which
    every layer below receives (a layer that parsed again would make a second)."""
    import onnx
    import tvm

    from lpx_tvm.app import cli

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_stack(np.random.default_rng(0), [64, 64, 64], batch=2), path)
    doors = {
        "lpx-tvm compile": lambda: cli.main(["compile", str(path), "--config", "tiny", "--dtype", "fp16",
                                             "--emit-program", str(tmp_path / "p.bin")]),
        "lpx_tvm.compile": lambda: lpx_tvm.compile(str(path), config="tiny", dtype="fp16"),
        "lpx_tvm.compile on a system": lambda: lpx_tvm.compile(str(path), system="tiny-2", parallel="tensor"),
    }
    for door, run in doors.items():
        targets_made.clear()
        run()
        assert len(targets_made) == 1, (door, targets_made)
    tvm_target = Target.parse("tiny", dtype="fp16").tvm_target()
    targets_made.clear()
    tvm.compile(lpx_tvm.from_onnx(str(path)), target=tvm_target)
    assert [(t.chip.name, t.dtype) for t in targets_made] == [("tiny", "fp16")]


def test_a_plan_target_may_be_described_but_a_compile_refuses_it():
    """A Target may name a system described by its figures (what plan searches); compiling for it is refused."""
    target = Target.parse(system="lpx-system-2", dtype="fp8")
    assert not target.system.simulated and target.system.chips == 512
    with pytest.raises(LpxUserError, match="'lpx-system-2' is described, not listed link by link"):
        lpx_tvm.compile(mlp_stack(np.random.default_rng(0), [64, 64], batch=2), target=target)


def test_the_plan_door_builds_one_target(targets_made, capsys, monkeypatch):
    """``lpx-tvm plan`` parses --system and --dtype into one Target, which the search receives whole (the
    compiles of its mappings' blocks make their own, one chip or group each)."""
    from lpx_tvm.app import cli
    from lpx_tvm.app.plan import search

    received = []
    plan = search.plan

    def spying(*args, **kwargs):
        received.append(kwargs.get("target"))
        return plan(*args, **kwargs)
    monkeypatch.setattr(search, "plan", spying)
    assert cli.main(["plan", "--model", "llama-tiny", "--system", "tiny-4", "--dtype", "fp32"]) == 0
    (where,) = received
    assert (where.system.name, where.system.chips, where.dtype) == ("tiny-4", 4, "fp32")
    assert targets_made[0] is where  # the first made is the door's, and it is what plan got
    assert "llama-tiny" in capsys.readouterr().out


def test_the_plan_beside_gpus_door_builds_one_target_with_its_gpu_pool(targets_made, monkeypatch, capsys):
    """``plan --gpu gb300:8 --system lpx-node --dtype fp8`` parses the LPX system, the dtype and the GPU pool into
    one Target at the door, the one the heterogeneous plan receives."""
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (aiconfigurator-core) is not installed")
    from lpx_tvm.app import cli
    from lpx_tvm.app.plan import hetero

    received = []

    def spying(model, **kwargs):
        received.append(kwargs.get("target"))
        raise LpxUserError("stopped here: the door is what is under test")
    monkeypatch.setattr(hetero, "hetero_plan", spying)
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpu", "gb300:8", "--system", "lpx-node",
                     "--dtype", "fp8", "--mode", "gpu-only"]) == 1
    assert "stopped here" in capsys.readouterr().err
    (where,) = received
    assert targets_made == [where]
    assert (where.system.name, where.dtype, where.gpu.name, where.gpu.gpus) == ("lpx-node", "fp8", "gb300", 8)
    with pytest.raises(LpxUserError, match="a GPU pool is planned beside LPX"):
        where.check_compilable()
