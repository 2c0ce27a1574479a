"""ResNet-50 from the onnx package (seeded random weights) against ONNX Runtime."""

import numpy as np
import onnx
import pytest

import lpx_tvm
from lpx_tvm import runtime
from lpx_tvm.app.models.light_models import light_model
from conftest import assert_close, ort_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resnet():
    model = light_model("resnet50")
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    model.graph.output.append(onnx.helper.make_tensor_value_info(softmax.input[0], onnx.TensorProto.FLOAT, None))
    return model, lpx_tvm.compile(model, config="tsp")


def test_resnet50_logits_match_ort_and_flops_are_offloaded(resnet):
    model, compiled = resnet
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    before = runtime.total_offloaded_calls()
    probs, logits = compiled(x)
    assert runtime.total_offloaded_calls() - before == compiled.report.lpx_functions >= 1
    ref_probs, ref_logits = ort_run(model, {model.graph.input[0].name: x})
    err = assert_close(logits, ref_logits, 1e-3)
    assert_close(probs, ref_probs, 1e-3)
    print(f"\nResNet-50: logits max rel err {err:.2e}; {compiled.report.summary()}")
    assert compiled.report.offloaded_pct >= 95.0


def test_resnet50_schedule_overlaps(resnet):
    _, compiled = resnet
    for name, sim in compiled.simulators.items():
        stats = sim.stats
        util = ", ".join(f"{u} {v:.1%}" for u, v in stats.utilisation.items())
        print(f"\n{name}: makespan {stats.cycles} cycles < sum of durations {stats.instruction_cycles_sum}; {util}")
        assert stats.cycles < stats.instruction_cycles_sum


def test_resnet50_cycles_fall_in_the_order_of_the_matrix_rates():
    from lpx_tvm.app.tools.zoo import ZOO, quantized_for_zoo

    model = ZOO["resnet50"].load()
    variants = {"fp32": model, "fp16": model, "int8": quantized_for_zoo(ZOO["resnet50"], model)}
    cycles = {}
    for dtype, variant in variants.items():
        compiled = lpx_tvm.compile(variant, config="tsp", dtype=dtype)
        cycles[dtype] = sum(sim.stats.cycles for sim in compiled.simulators.values())
    print("\nResNet-50 on tsp, predicted cycles: " + ", ".join(f"{d} {c}" for d, c in cycles.items()))
    assert cycles["fp32"] > cycles["fp16"] > cycles["int8"]
