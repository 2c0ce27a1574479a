"""plan --gpu: the GPU half is AIConfigurator's, the exchanges between the halves worked out by hand."""

import json
from types import SimpleNamespace

import aiconfigurator_core  # noqa: F401  (the test extra installs it: these tests always run)
import pytest

from lpx_tvm.app.plan import gpu as gpus
from lpx_tvm.app.plan.afd import exchange_us, ffn_stages, pingpong, return_itemsize
from lpx_tvm.app.cli import main
from lpx_tvm.app.plan.hetero import hetero_plan, kv_handoff_bytes, kv_handoff_ms, plot, table
from lpx_tvm.app.plan.model import model_spec
from lpx_tvm.runtime_sim.errors import LpxUserError

FP8 = {"gemm_quant_mode": "fp8", "kvcache_quant_mode": "fp8", "fmha_quant_mode": "fp8"}


@pytest.fixture(scope="module")
def gpu_only():
    return hetero_plan("llama-3-8b", "lpx-rack", "gb300:8", dtype="fp8", context=4096, prompt=512, mode="gpu-only")


def _config_dir(tmp_path):
    """llama-3-8b's published config.json as the package keeps it, in a folder of its own for AIConfigurator."""
    from lpx_tvm.app.plan.model import _CONFIG_DIR

    data = json.loads((_CONFIG_DIR / "llama-3-8b.json").read_text())
    data.setdefault("architectures", ["LlamaForCausalLM"])
    data.setdefault("model_type", "llama")
    data.setdefault("max_position_embeddings", 131072)
    data.setdefault("rms_norm_eps", 1e-5)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


def test_gpu_only_is_aiconfigurators_own_figures(gpu_only, tmp_path):
    from aiconfigurator_core.sdk.engine import EngineHandle

    chosen = gpu_only["modes"]["gpu-only"]
    c = chosen["config"]
    path = _config_dir(tmp_path)
    # AIConfigurator called directly: its own compile_engine, its GB300 tables, the same model, width and batch
    handle = EngineHandle.compile(path, "gb300", "trtllm", tp_size=c["tp"], **FP8)
    assert chosen["tpot_ms"] == pytest.approx(handle.decode_step_latency(c["batch"], 4096, 2), rel=1e-9)
    prefill = EngineHandle.compile(path, "gb300", "trtllm", tp_size=c["prefill_tp"], **FP8)
    assert chosen["ttft_ms"] == pytest.approx(prefill.predict_prefill_latency(1, 512), rel=1e-9)
    # the decode replicas on the 8 GPUs the prefills leave: tokens/s = replicas × batch ÷ TPOT
    assert c["replicas"] * c["tp"] <= 8
    assert chosen["tokens_per_s"] == pytest.approx(c["replicas"] * c["batch"] * 1e3 / chosen["tpot_ms"])
    # every candidate's step is AIConfigurator's too (TP1 at batch 8, for one)
    one = gpus.decode_step(gpus.model_dir("llama-3-8b"), gpus.gpu_system("gb300:8"), 1, "fp8", 8, 4096)
    tp1 = EngineHandle.compile(path, "gb300", "trtllm", tp_size=1, **FP8)
    assert one["tpot_ms"] == pytest.approx(tp1.decode_step_latency(8, 4096, 2), rel=1e-9)
    # the fastest per user is the widest group at batch 1 here; GB300's power is its system file's 1,400 W
    assert chosen["tokens_per_s_per_user"] == max(p["tokens_per_s_per_user"] for p in gpu_only["candidates"])
    watts = (chosen["gpus_decode"] + chosen["prefill_gpus"]) * 1400
    assert chosen["tokens_per_s_per_mw"] == pytest.approx(chosen["tokens_per_s"] / watts * 1e6)


def test_the_afd_exchange_by_hand():
    # Llama-3-8B in fp8: a token's hidden state out to LPX in fp8 (4,096 bytes), its FFN output back in bf16
    # (8,192 bytes: the GPUs keep the residual stream in bf16)
    hidden, item = 4096, 1
    assert return_itemsize(1) == 2 and return_itemsize(2) == 2 and return_itemsize(4) == 4
    # a micro-batch of 64 tokens from 8 GPUs at 100 GB/s each (800 GB/s), 5 µs latency: 262,144 bytes out,
    # 524,288 back
    out = exchange_us(64, hidden, item, 8 * 100e9, 5.0)
    back = exchange_us(64, hidden, 2, 8 * 100e9, 5.0)
    assert out == pytest.approx(5.0 + 262144 / 800e9 * 1e6)  # 5.32768 µs
    assert back == pytest.approx(5.0 + 524288 / 800e9 * 1e6)  # 5.65536 µs
    t_rt, t_ser = out + back, back - 5.0  # the return direction is the busier
    # attention 10 µs and FFN 8 µs a layer a micro-batch, 32 layers: one micro-batch waits on every exchange,
    # 32 × (10 + 8 + 10.98304) µs, and the link binds (the exchange is not hidden)
    one = pingpong(10.0, 8.0, t_rt, t_ser, 1, 32)
    assert one["token"] == pytest.approx(32 * (10 + 8 + 10.98304))
    assert one["regime"] == "link" and not one["hidden"]
    # two micro-batches: the GPUs busy 2 × 10 µs a layer, less than a round trip (28.98 µs): still the chain
    two = pingpong(10.0, 8.0, t_rt, t_ser, 2, 32)
    assert two["token"] == pytest.approx(32 * 28.98304) and not two["hidden"]
    # three: 3 × 10 = 30 µs ≥ 28.98: the exchange is hidden and attention binds (32 × 30 µs a token)
    three = pingpong(10.0, 8.0, t_rt, t_ser, 3, 32)
    assert three["token"] == pytest.approx(32 * 30) and three["hidden"] and three["regime"] == "attention"
    # an FFN slower than attention binds instead (on one LPX stage holding all 32 layers)
    assert pingpong(8.0, 10.0, t_rt, t_ser, 3, 32)["regime"] == "FFN"
    # a slow link (1 GB/s): the return's occupancy, 3 × 524.288 µs a layer, binds
    slow_out, slow_back = exchange_us(64, hidden, 1, 1e9, 5.0), exchange_us(64, hidden, 2, 1e9, 5.0)
    slow = pingpong(10.0, 8.0, slow_out + slow_back, slow_back - 5.0, 3, 32)
    assert slow["bounds"]["link"] == pytest.approx(32 * 3 * 524.288) and slow["regime"] == "link"


def test_afd_stages_dense_first_layers_and_experts_by_their_own_weights_and_times():
    # five layers, the first two dense (30 bytes of FFN weights a chip), the rest experts (50)
    spec = SimpleNamespace(layers=5, is_moe=lambda layer: layer >= 2)
    resident = {False: 30, True: 50}
    # 100 bytes a chip: 30 + 30 | 50 + 50 | 50, and spread evenly (2, 2, 1) they fit the same way
    assert ffn_stages(spec, resident, 100) == [2, 2, 1]
    # 110: 30 + 30 + 50 | 50 + 50
    assert ffn_stages(spec, resident, 110) == [3, 2]
    assert ffn_stages(spec, resident, 49) is None  # an expert layer alone does not fit
    # spread evenly where the even split fits (10, 10 | 10, 90), packed where it does not (60 | 60 + 10 + ...)
    assert ffn_stages(SimpleNamespace(layers=4, is_moe=lambda layer: layer == 3), {False: 10, True: 90}, 100) == [2, 2]
    assert ffn_stages(SimpleNamespace(layers=6, is_moe=lambda layer: layer < 2), {True: 60, False: 10}, 100) == [1, 5]
    # each layer's FFN time: 1 µs dense, 5 µs experts; stages of 2, 2 and 1 layers, 2 micro-batches
    timing = pingpong(1.0, [1, 1, 5, 5, 5], 2.0, 0.5, 2, 5, [2, 2, 1])
    assert timing["bounds"] == {"attention": 2 * 5 * 1.0, "FFN": 2 * (5 + 5), "link": 2 * 5 * 0.5,
                                "chain": 5 * (1 + 2) + (1 + 1 + 5 + 5 + 5)}
    assert timing["token"] == 32 and timing["regime"] == "link" and not timing["hidden"]


def test_the_kv_handoff_by_hand():
    spec = model_spec("llama-3-8b")
    # 32 layers × 2 (K, V) × 8 K/V heads × 128 × 512 prompt positions × 1 byte (fp8)
    assert kv_handoff_bytes(spec, 512, "fp8") == 32 * 2 * 8 * 128 * 512 * 1 == 33_554_432
    g = gpus.gpu_system("gb300:72")
    ctx = SimpleNamespace(spec=spec, prompt=512, dtype="fp8", gpu=g)
    # from 4 prefill GPUs at 100 GB/s each (the assumed link), after its 5 µs latency
    nbytes, ms = kv_handoff_ms(ctx, 4)
    assert ms == pytest.approx(0.005 + 33_554_432 / (4 * 100e9) * 1e3)  # 0.0889 ms
    # --gpu-link 25,2: a quarter of the rate, 2 µs
    slow = SimpleNamespace(spec=spec, prompt=512, dtype="fp8", gpu=gpus.gpu_system("gb300", "25,2"))
    assert kv_handoff_ms(slow, 4)[1] == pytest.approx(0.002 + 33_554_432 / (4 * 25e9) * 1e3)
    # the LPX rack's side caps the GPUs' sum: 72 GPUs × 100 GB/s is more than its 6.4 TB/s
    assert g.link.rate(72, 1) == 6400e9 and g.link.rate(72, 2) == 7200e9


def test_vr200_is_derived_from_published_figures_in_sol_mode(tmp_path):
    import yaml

    g = gpus.gpu_system("vr200")
    assert "derived from published figures" in g.label and g.mode == "SOL" and g.gpus == 72
    figures = yaml.safe_load((gpus._HERE / "vr200.yaml").read_text())
    assert figures["gpu"]["mem_capacity"] == 288e9 and figures["gpu"]["mem_bw"] == 22e12  # 288 GB HBM4, 22 TB/s
    assert figures["gpu"]["fp8_tc_flops"] == 17.5e15  # 17.5 PFLOPS FP8 dense
    assert 2 * figures["node"]["intra_node_bw"] == 3.6e12  # NVLink 6, 3.6 TB/s a GPU both ways
    step = gpus.decode_step(_config_dir(tmp_path), g, 1, "fp8", 8, 4096)
    assert {"sol"} <= {source for *_, source in gpus.engine(_config_dir(tmp_path), g, 1, "fp8")[0]
                       .decode_step_per_op(8, 4096, 2)}
    # at the speed of light 22 TB/s reads llama-3-8b's 8 GB of fp8 weights in no less than 0.35 ms
    assert step["tpot_ms"] >= 7.5e9 / 22e12 * 1e3


def test_errors_are_one_line(capsys):
    with pytest.raises(LpxUserError, match="unknown GPU 'tpu9'"):
        gpus.gpu_system("tpu9")
    assert issubclass(gpus.GpuError, LpxUserError)
    for argv, said in ((["--gpu", "tpu9"], "unknown GPU 'tpu9'"), (["--gpu", "gb300:0"], "positive integer"),
                       (["--gpu", "gb300", "--gpu-link", "fast"], "--gpu-link fast"),
                       (["--mode", "afd"], "--mode afd needs --gpu"),
                       (["--gpu", "gb300", "--lpx-chip-watts", "0"], "--lpx-chip-watts must be a positive")):
        assert main(["plan", "--model", "llama-3-8b", "--system", "lpx-rack", "--dtype", "fp8", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err and err.startswith("lpx-tvm plan: error:")


def test_without_lpx_watts_the_report_says_per_mw_is_unknown(gpu_only, tmp_path):
    text = str(table(gpu_only))
    assert "tokens/s per MW: unknown for modes using LPX" in text and "--lpx-chip-watts" in text
    assert "ASSUMED" in text  # the link's figure
    assert plot(gpu_only, tmp_path / "pareto.png") and (tmp_path / "pareto.png").stat().st_size > 1000


def test_max_racks_names_what_binds(gpu_only):
    # gpu-only decodes on every GPU given: 144 GB300s are two NVL72 racks
    report = hetero_plan("llama-3-8b", "lpx-rack", "gb300:144", dtype="fp8", mode="gpu-only", max_racks=1)
    assert report["modes"]["gpu-only"]["error"] == ("needs 2 racks (2 GPU, 0 LPX), more than --max-racks 1: bound by "
                                                    "the GPUs it decodes and prefills on (144)")
    from lpx_tvm.app.plan.hetero import _choose

    point = dict(gpu_only["candidates"][0], racks=3, gpu_racks=2, lpx_racks=1, gpus=100)
    said = _choose("gpu-only", [point], 2, None, 144)["error"]
    assert said.startswith("needs 3 racks (2 GPU, 1 LPX), more than --max-racks 2: bound by the GPUs")


@pytest.mark.slow
def test_lpx_decode_and_afd_time_their_exchanges_and_verify_their_lpx_half():
    """The LPX half is the plan's (its compiled blocks), the handoff and the exchange timed over the link, and
    --verify compiles that half whole: lpx-decode's stages (the plan's --verify at its mapping) and AFD's FFN
    stage (its layers as one program at the program rows the chosen point used), each within 5% of the plan.
    (One test: both modes plan the same model, whose blocks the plan measures once in a process.)"""
    from math import ceil

    from lpx_tvm.app.plan.search import plan

    report = hetero_plan("llama-3-8b", "lpx-rack", "gb300:8", dtype="fp8", context=2048, prompt=256,
                         mode="lpx-decode", lpx_chip_watts=300, verify=True)
    r = report["modes"]["lpx-decode"]
    assert r["config"]["kv_bytes"] == 32 * 2 * 8 * 128 * 256
    pre = r["config"]["prefill_tp"]
    handoff = 0.005 + 32 * 2 * 8 * 128 * 256 / (pre * 100e9) * 1e3
    assert r["config"]["handoff_ms"] == pytest.approx(handoff)
    assert r["tokens_per_s_per_mw"] is not None and r["lpus"] > 0
    alone = plan("llama-3-8b", "lpx-rack", dtype="fp8", context=2048, prompt=256, batches=(1, 4))
    assert r["tokens_per_s_per_user"] == pytest.approx(alone["tokens_per_s_per_user"])  # the compiler's decode
    d = r["verify"]
    assert sum(stage["stages"] for stage in d["stages"]) == r["config"]["stages"]
    assert sum(stage["blocks"] * stage["stages"] for stage in d["stages"]) == 32
    assert abs(d["verify_error"]) < 0.05, d

    afd = hetero_plan("llama-3-8b", "lpx-rack", "gb300:8", dtype="fp8", context=2048, prompt=256, mode="afd",
                      verify=True)
    a = afd["modes"]["afd"]
    c, v = a["config"], a["verify"]
    tokens = c["attention_instances"] * c["batch"] // c["micro_batches"]
    rate = min(c["attention_instances"] * c["tp"] * 100e9, 6400e9)
    # there in fp8 (1 byte an element), back in bf16 (2)
    assert c["t_exchange_us"]["out"] == pytest.approx(5 + tokens * 4096 / rate * 1e6)
    assert c["t_exchange_us"]["back"] == pytest.approx(5 + tokens * 4096 * 2 / rate * 1e6)
    assert sum(c["ffn_stage_layers"]) == 32 and len(c["ffn_stage_layers"]) == c["ffn_stages"]
    assert v["layers"] == max(c["ffn_stage_layers"]) == ceil(32 / c["ffn_stages"])  # spread evenly
    assert v["rows"] == c["ffn_program_rows"]
    assert abs(v["verify_error"]) < 0.05, v
    assert v["planned_cycles"] / v["verified_cycles"] - 1 == pytest.approx(v["verify_error"])
    rows = f"{v['rows']} row{'s' if v['rows'] > 1 else ''}"
    assert f"verify afd: a stage's {v['layers']} FFN layers at {rows} compiled whole: " in str(table(afd))


def test_a_speed_of_light_gpu_is_said_to_price_no_collective():
    """AIConfigurator's SOL mode counts no GPU-to-GPU all-reduce (no communication tables): the report says its
    GPU figures are a bound, and says nothing of the kind for a measured system."""
    from lpx_tvm.app.plan.hetero import table

    def report(mode):
        return {"gpu": {"name": "vr200", "gpus": 72, "racks": 1, "label": "x", "watts": 2300.0, "mode": mode},
                "link": {"GBps_per_gpu": 200, "GBps_per_lpx_rack": 6400, "latency_us": 5, "assumed": False},
                "lpx_chip_watts": None, "model": "m", "dtype": "fp8", "system": "lpx-rack", "context": 2048,
                "prompt": 128, "modes": {}, "frontier": [], "candidates": [], "plan_s": 0.0}
    assert "prices no collective between GPUs" in str(table(report("SOL")))
    assert "prices no collective" not in str(table(report("SILICON")))


def test_a_mode_aiconfigurator_has_no_data_for_is_named_not_a_crash(monkeypatch):
    """gpt-oss-120b in fp8 on GB300: AIConfigurator's measured tables hold no MoE entry for its shape and raise
    PerfDataNotAvailableError. The mode's report names that, without the database's path, and the others go on."""
    from aiconfigurator_core.sdk.errors import PerfDataNotAvailableError

    import lpx_tvm.app.plan.hetero as hetero

    def missing(ctx):
        raise PerfDataNotAvailableError("perf database error: MoE data missing for MoeKey { topk: 4 } at /x/gb300")
    monkeypatch.setattr(hetero, "_gpu_only", missing)
    report = hetero_plan("llama-3-8b", "lpx-rack", gpu="gb300:8", mode="gpu-only", dtype="fp8")
    assert report["modes"]["gpu-only"]["error"] == (
        "AIConfigurator's gb300 tables cannot price it (gemm fp8, moe fp8, fmha fp8, kv fp8): perf database error: "
        "MoE data missing for MoeKey { topk: 4 }")


# ---- the GPU side's quantisation: --dtype where AIConfigurator's tables hold it, else as it deploys the model ----
def _direct(path, tp, q, moe_ep=None):
    """AIConfigurator called directly: its own compile_engine, GB300's tables, the modes and expert split given."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    split = {} if moe_ep is None else {"moe_tp_size": 1, "moe_ep_size": moe_ep}
    return EngineHandle.compile(path, "gb300", "trtllm", tp_size=tp, **split, **q.kwargs())


def test_gpt_oss_at_fp8_prices_its_experts_in_a_mode_the_tables_hold_and_says_so():
    """GB300's tables hold no fp8 MoE for gpt-oss-120b's experts (128 × 2880 × 2880, top-4): the experts are priced
    as the published checkpoint is deployed, MXFP4 weights, here with fp8 (MXFP8) activations; the report names it."""
    from aiconfigurator_core.sdk.models.helpers import _get_model_info

    g, path = gpus.gpu_system("gb300:8"), gpus.model_dir("gpt-oss-120b")
    q = gpus.resolve_quant(path, g, "fp8")
    held = gpus._moe_table(gpus.database(g), _get_model_info(path))
    assert "fp8" not in held and q.moe in held and q.moe == "w4a8_mxfp4_mxfp8"
    assert (q.gemm, q.fmha, q.kv) == ("fp8", "fp8", "fp8")  # the rest is --dtype's: the tables hold it
    why = dict(q.why)
    assert set(why) == {"moe"} and "no fp8 MoE for 128 experts of 2880×2880, top-4" in why["moe"]
    # expert parallel across the group (the table holds gpt-oss's experts at moe_tp 1 only)
    assert q.split(8) == (1, 8) and q.split(64) == (1, 64)
    # the figure is AIConfigurator's for those modes and that split
    step = gpus.decode_step(path, g, 8, q, 4, 4096, True)
    assert step["tpot_ms"] == pytest.approx(_direct(path, 8, q, 8).decode_step_latency(4, 4096, 2), rel=1e-9)
    # and the plan's report says which modes priced the GPU side
    report = hetero_plan("gpt-oss-120b", "lpx-rack", "gb300:8", dtype="fp8", mode="gpu-only")
    r = report["modes"]["gpu-only"]
    assert "error" not in r and r["config"]["moe_ep"] * r["config"]["moe_tp"] == r["config"]["tp"]
    assert report["gpu"]["quant"]["modes"]["moe"] == "w4a8_mxfp4_mxfp8"
    assert "GPU side in AIConfigurator's modes: gemm fp8, moe w4a8_mxfp4_mxfp8 (AIConfigurator's gb300 trtllm " \
           "tables have no fp8 MoE" in str(table(report))
    c = r["config"]
    assert r["tpot_ms"] == pytest.approx(
        _direct(path, c["tp"], q, c["moe_ep"]).decode_step_latency(c["batch"], 4096, 2), rel=1e-9)


def test_deepseek_is_priced_in_its_checkpoints_fp8_and_bf16_context_mla():
    """DeepSeek-V3's checkpoint is block-scaled fp8 (AIConfigurator reads fp8_block from its quantization_config);
    GB300's context MLA tables are bfloat16 only, so attention falls back to bfloat16 as AIConfigurator's own
    estimate path does; the KV cache stays fp8."""
    g, path = gpus.gpu_system("gb300:72"), gpus.model_dir("deepseek-v3")
    q = gpus.resolve_quant(path, g, "fp8")
    assert (q.gemm, q.moe, q.fmha, q.kv) == ("fp8_block", "fp8_block", "bfloat16", "fp8")
    why = dict(q.why)
    assert "no fp8 context MLA" in why["fmha"] and "fp8_block" in why["moe"] and "kv" not in why
    assert q.split(64) == (1, 64)
    assert gpus.decode_step(path, g, 8, q, 2, 4096, True)["tpot_ms"] == pytest.approx(
        _direct(path, 8, q, 8).decode_step_latency(2, 4096, 2), rel=1e-9)


def test_gpu_quant_chooses_and_checks_against_the_tables(capsys):
    g, path = gpus.gpu_system("gb300:8"), gpus.model_dir("gpt-oss-120b")
    # checkpoint: AIConfigurator's own reading of the published quantization_config (bf16 GEMMs, W4A16 MXFP4)
    q = gpus.resolve_quant(path, g, "fp8", "checkpoint")
    assert (q.gemm, q.moe) == ("bfloat16", "w4a16_mxfp4")
    q = gpus.resolve_quant(path, g, "fp8", "moe=w4a16_mxfp4,fmha=bfloat16")
    assert (q.gemm, q.moe, q.fmha, q.kv) == ("fp8", "w4a16_mxfp4", "bfloat16", "fp8")
    assert dict(q.why) == {"moe": "--gpu-quant", "fmha": "--gpu-quant"}
    with pytest.raises(gpus.GpuError, match=r"hold no fp8 MoE for 128 experts .*\(they hold .*w4a8_mxfp4_mxfp8"):
        gpus.resolve_quant(path, g, "fp8", "moe=fp8")
    with pytest.raises(gpus.GpuError, match="no moe mode 'fp7'"):
        gpus.parse_gpu_quant("moe=fp7")
    # dense Llama at fp8: every family in fp8, nothing to say
    q = gpus.resolve_quant(gpus.model_dir("llama-3-8b"), g, "fp8")
    assert q.why == () and q.describe() == "gemm fp8, moe fp8, fmha fp8, kv fp8"
    for argv, said in ((["--gpu", "gb300", "--gpu-quant", "attn=fp8"], "--gpu-quant attn=fp8"),
                       (["--gpu-quant", "moe=fp8"], "--gpu-quant needs --gpu")):
        assert main(["plan", "--model", "gpt-oss-120b", "--system", "lpx-rack", "--dtype", "fp8", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err


def test_a_model_aiconfigurator_cannot_build_is_a_user_error_naming_it():
    """Gemma 3's architecture has no AIConfigurator model: the GPU side says so in one line (it used to surface
    as an internal error from deep inside AIConfigurator)."""
    from lpx_tvm.runtime_sim.errors import LpxUserError

    try:
        report = hetero_plan("gemma-3-27b", "lpx-rack", gpu="gb300:8", mode="gpu-only", dtype="fp8")
    except LpxUserError as err:
        message = str(err)
    else:
        message = report["modes"]["gpu-only"]["error"]
    assert "AIConfigurator cannot model" in message and "Gemma3" in message


def test_plan_refuses_a_flag_its_path_would_not_use():
    """--batch is for a plan of LPX alone, --lpx-chip-watts for one beside GPUs: given to the other path, each is
    refused by name, not dropped; and a GPU plan's LPX side must be LP30s."""
    from lpx_tvm.app.cli import main
    from lpx_tvm.runtime_sim.errors import LpxUserError

    assert main(["plan", "--model", "llama-3-8b", "--gpu", "gb300:8", "--batch", "4"]) == 1
    assert main(["plan", "--model", "llama-3-8b", "--lpx-chip-watts", "400"]) == 1
    with pytest.raises(LpxUserError, match="tsp-rack is made of tsp chips"):
        hetero_plan("llama-3-8b", "tsp-rack", gpu="gb300:8", mode="gpu-only", dtype="fp8")


def test_plan_refusals_name_the_flags(capsys):
    from lpx_tvm.app.cli import main

    main(["plan", "--model", "llama-3-8b", "--gpu", "gb300:8", "--batch", "4", "--users", "2"])
    assert "--batch, --users are for a plan of LPX alone" in capsys.readouterr().err
    main(["plan", "--model", "llama-3-8b", "--max-racks", "2"])
    assert "--max-racks needs --gpu (a plan beside GPUs" in capsys.readouterr().err
