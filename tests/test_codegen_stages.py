"""The stage runner's own rules: the resident-weight budgets it tries, and options refused by name."""

import pytest

from lpx_tvm.codegen import Target
from lpx_tvm.codegen.stages import budgets


def test_budgets_go_from_every_free_byte_down_to_streaming_everything():
    """4 MiB of SRAM and a 1 MiB activation peak: every byte the peak leaves (3 MiB), twice the peak left
    (2 MiB), then half of SRAM and its halves (2, 1, 0.5, 0.25 MiB), then 0; each once, largest first."""
    mib = 1 << 20
    assert budgets(4 * mib, mib) == [3 * mib, 2 * mib, mib, mib // 2, mib // 4, 0]


def test_a_peak_beyond_sram_leaves_no_negative_budget():
    """A 5 MiB peak on 4 MiB: the first two tries would be negative and become 0."""
    mib = 1 << 20
    assert budgets(4 * mib, 5 * mib) == [2 * mib, mib, mib // 2, mib // 4, 0]


@pytest.mark.parametrize("options, message", [
    ({"config": "nope"}, "unknown chip config 'nope'"),
    ({"parallel": "tensor"}, "needs a system of chips"),
    ({"system": "tiny-2", "config": "tiny", "chips": 3}, "chips must be 1..2"),
    ({"system": "tiny-2", "config": "tiny", "parallel": "sideways"}, "parallel must be one of"),
])
def test_options_that_cannot_hold_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        Target.parse(**options)


def test_the_codegen_leaves_older_objects_out_of_full_collections_and_puts_them_back(monkeypatch):
    """While a model compiles, an object made before it is frozen (out of the collector's generations, so a
    full collection skips it); after, it is back, whether the compile returned or raised."""
    import gc
    import importlib

    codegen = importlib.import_module("lpx_tvm.codegen")
    older = [object()]  # a container: the collector tracks it
    tracked_during = []

    def compile_inside(functions, options, state_args):
        tracked_during.append(any(o is older for o in gc.get_objects()))
        if functions == "fail":
            raise ValueError("a bad model")
        return {}

    monkeypatch.setattr(codegen, "_compile_model", compile_inside)
    assert codegen.compile_model({}) == {}
    with pytest.raises(ValueError, match="a bad model"):
        codegen.compile_model("fail")
    assert tracked_during == [False, False]
    assert any(o is older for o in gc.get_objects())
    assert gc.get_freeze_count() == 0


def test_the_codegen_leaves_a_callers_frozen_objects_frozen(monkeypatch):
    """A process that froze objects of its own before compiling (as a forking server does) keeps them frozen:
    the codegen neither thaws them nor freezes more."""
    import gc
    import importlib

    codegen = importlib.import_module("lpx_tvm.codegen")
    monkeypatch.setattr(codegen, "_compile_model", lambda functions, options, state_args: {})
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        codegen.compile_model({})
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
