"""lpx-tvm plan: capacity and speed from the compiler's own numbers, checked against the full simulation."""

import json
from math import ceil

import pytest

from lpx_tvm.app.cli import main
from lpx_tvm.app.llm.generate import generate
from lpx_tvm.app.plan.search import PlanError, model_spec, plan, table
from lpx_tvm.runtime_sim import load_config
from lpx_tvm.runtime_sim.system import load_system

SMALL_MOE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.slow
def test_plan_agrees_with_the_full_multi_chip_simulation():
    """llama-small compiled whole, a 4-stage pipeline on tsp-node, its decode steps simulated chip by chip and
    link by link; the plan composes one block's cycles with the network model."""
    simulated = generate("llama-small", tokens=2, system="tsp-node", chips=4, parallel="pipeline", prompt_len=8)
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(4, 1))
    tsp = load_config("tsp")
    assert planned["per_token_us"] * tsp.clock_hz / 1e6 == pytest.approx(simulated["per_token_cycles"], rel=0.05)
    assert planned["chips"] == len(simulated["chips"]) == 4


@pytest.mark.parametrize("chips", [2, 4])
@pytest.mark.slow
def test_plan_agrees_with_the_compiled_tensor_parallel_decoder(chips):
    """The plan splits attention by heads and the MLP, two all-reduces a block; so does the compiler (each
    chip its heads of the cache, storing its own new K/V), and a step simulates within 5% of the plan (21%
    and 26% over it when the compiler gathered around the attention)."""
    simulated = generate("llama-small", tokens=2, system="tsp-node", chips=chips, parallel="tensor", prompt_len=8)
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(1, chips))
    tsp = load_config("tsp")
    assert f"{2 * 4} all-reduces" in simulated["notes"]  # llama-small: 4 blocks
    assert planned["per_token_us"] * tsp.clock_hz / 1e6 == pytest.approx(simulated["per_token_cycles"], rel=0.05)


@pytest.mark.slow
def test_plan_agrees_with_the_compiled_eight_way_tensor_parallel_decoder(tmp_path):
    """At 8 chips, where a decoder's heads divide them (8 query and 8 K/V heads), attention still splits by heads
    (no all-gather) and a step simulates within 5% of the plan."""
    from lpx_tvm.app.models import llama

    config = llama.LlamaConfig(hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=8, intermediate_size=512,
                               vocab_size=512, max_context=128)
    llama.save_llama(config, tmp_path, prompt_len=8)
    simulated = generate(str(tmp_path), tokens=2, system="tsp-node", chips=8, parallel="tensor")
    planned = plan(config, "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(1, 8))
    assert "0 all-gathers, 4 all-reduces" in simulated["notes"]  # 2 blocks, two all-reduces each
    assert planned["per_token_us"] * load_config("tsp").clock_hz / 1e6 == pytest.approx(
        simulated["per_token_cycles"], rel=0.05)


@pytest.mark.parametrize("chips", [8, 16])
@pytest.mark.slow
def test_plan_and_its_verify_agree_with_the_compiled_decoder_on_an_lpx_node(tmp_path, chips):
    """A decoder block 8 and 16 wide on lpx-node (16 heads of 32, two blocks): the compiler splits it by heads
    and the MLP, each block's two all-reduces direct over the node's links (one-shot: the hidden state whole to
    every peer, one 350-cycle hop); the plan compiles the same all-reduces into the block it measures, and
    --verify compiles each stage whole with them. Both land within 5% of the whole system simulated."""
    from lpx_tvm.app.models import llama

    config = llama.LlamaConfig(hidden_size=512, num_layers=2, num_heads=16, num_kv_heads=16, intermediate_size=1024,
                               vocab_size=512, max_context=128)
    llama.save_llama(config, tmp_path, prompt_len=8)
    simulated = generate(str(tmp_path), tokens=2, system="lpx-node", chips=chips, parallel="tensor")
    assert sorted(int(c) for c in simulated["chips"]) == list(range(chips))  # the chips the programs ran on
    assert "0 all-gathers, 4 all-reduces (direct)" in simulated["notes"] and simulated["agree"]  # ORT's tokens
    planned = plan(config, "lpx-node", dtype="fp32", context=128, prompt=8, mapping=(1, chips), verify=True)
    clock = load_config("lp30").clock_hz
    assert planned["per_token_us"] * clock / 1e6 == pytest.approx(simulated["per_token_cycles"], rel=0.05)
    assert planned["verified_cycles"] == pytest.approx(simulated["per_token_cycles"], rel=0.05)


@pytest.mark.slow
def test_plan_needs_the_chips_the_compiler_needs_and_times_them(tmp_path):
    """A decoder too big for one tsp chip (322 MB of fp32 weights on the chips): the plan's fewest pipeline
    chips are the fewest the compiler can pipeline it on, and there its per-token latency is the simulation's
    within 5%."""
    import lpx_tvm
    from lpx_tvm.app.models import llama
    from lpx_tvm.codegen import SystemCompileError

    config = llama.LlamaConfig(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8,
                               intermediate_size=2816, vocab_size=32000, max_context=128)
    llama.save_llama(config, tmp_path, prompt_len=8)
    planned = plan(config, "tsp-node", dtype="fp32", context=128, prompt=8)
    fewest = min(m["chips"] for m in planned["frontier"] if m["width"] == 1)
    assert fewest > 1
    with pytest.raises(SystemCompileError, match="need more than"):
        lpx_tvm.compile(llama.build_decode(config), system="tsp-node", parallel="pipeline", chips=fewest - 1,
                        state=llama.cache_names(config))
    simulated = generate(str(tmp_path), tokens=2, system="tsp-node", chips=fewest, parallel="pipeline")
    at = plan(config, "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(fewest, 1))
    tsp = load_config("tsp")
    assert len(simulated["chips"]) == fewest
    assert at["per_token_us"] * tsp.clock_hz / 1e6 == pytest.approx(simulated["per_token_cycles"], rel=0.05)


def test_a_model_no_system_holds_is_named_with_its_bytes():
    with pytest.raises(PlanError, match=r"llama-3.1-405b needs [\d,]+ bytes .* but lpx-rack holds [\d,]+"):
        plan("llama-3.1-405b", "lpx-rack", dtype="fp8")


@pytest.mark.parametrize("given, message", [
    ({"prompt": 0}, "prompt must be a positive integer, got 0"),
    ({"batch": 0}, "batch must be a positive integer, got 0"),
    ({"context": -5}, "context must be a positive integer, got -5"),
    ({"chips": 0}, "chips must be a positive integer, got 0"),
    ({"batches": (1, 0)}, r"batches must be positive integers, got \(1, 0\)"),
    ({"mapping": (2,)}, r"mapping must be two positive integers, got \(2,\)"),
    ({"target_tps_per_user": -5.0}, "the target tokens/s per user must be a positive number, got -5.0"),
    ({"prompt": 9000, "context": 4096}, "a prompt of 9000 tokens does not fit a cache of 4096 positions"),
])
def test_sizes_that_are_no_sizes_are_named(given, message):
    """(A prompt or context of 0 died in an IndexError, a batch of 0 deep in the program format; 0 chips and a
    negative target were taken as no limit and no target, and a prompt longer than its cache was planned.)"""
    with pytest.raises(PlanError, match=message):
        plan("llama-tiny", "tsp-node", **given)


def test_an_unknown_config_key_is_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**SMALL_MOE, "hidden_sise": 64}))
    with pytest.raises(PlanError, match="unknown config key hidden_sise"):
        model_spec(str(config))


def test_fp8_on_a_chip_without_it_names_what_it_runs():
    with pytest.raises(ValueError, match="'tsp' has no fp8 matrix unit .*fp16.*int8"):
        plan("llama-tiny", "tsp-node", dtype="fp8")


@pytest.mark.parametrize("chips, placement", [(2, "4 experts over 2 chips: 2 a chip"),
                                              (4, "4 experts over 4 chips: each split over 1; 2 K/V heads "
                                                  "replicated, each on 2 chips")])
@pytest.mark.slow
def test_experts_are_placed_over_the_tensor_parallel_chips(chips, placement):
    report = plan(SMALL_MOE, "tiny-fc-8", dtype="fp32", context=32, prompt=8, mapping=(1, chips))
    assert report["mapping"]["experts"] == placement
    # every expert's weights are on some chip: the chips' memory holds at least all the experts' MLPs
    experts = 4 * 4 * 3 * 64 * 128 * 4
    assert report["memory_per_chip"] * chips >= experts


def test_a_width_no_collective_can_join_is_refused_with_the_reason():
    """tiny-8 is a ring of 8: 4 of its chips make no ring (nor a node or a grid), so the compiler could not run
    their all-reduces, and the plan says so rather than pricing them."""
    with pytest.raises(PlanError, match="4-way tensor parallel: system 'tiny-8': no ring, node or grid of 4 chips"):
        plan(SMALL_MOE, "tiny-8", dtype="fp32", context=32, prompt=8, mapping=(1, 4))


def test_more_chips_never_slow_the_chosen_mapping():
    latencies = [plan("llama-small", "tsp-node", dtype="fp16", context=128, prompt=8, chips=n)["per_token_us"]
                 for n in (1, 2, 4, 8)]
    assert all(b <= a for a, b in zip(latencies, latencies[1:])), latencies


@pytest.mark.slow
def test_the_floor_by_hand_for_llama_3_8b_on_an_lpx_node():
    """lp30: weights install at 6 planes × 8 streams × 320 B = 15,360 B a cycle; SRAM reads 480 slices × 320 B =
    153,600 B a cycle; a hop is 350 cycles; a link moves 14 B a cycle, 4 links a pair. Llama-3-8B in fp8 (hidden
    4,096, 32 layers, 32 heads and 8 K/V heads of 128, FFN 14,336, vocab 128,256), a 2,048-position cache:
    a layer's weights are 4,096 × 128 × (2 × 32 + 2 × 8) + 3 × 4,096 × 14,336 + 2 × 4,096 = 218,112,000 bytes.
    At 16 wide (the best: 32 heads would need two nodes' hops): 888 cycles of weights a layer, the K/V cache
    (2 × 8 × 2,048 × 128 bytes over 8 chips) 4, two all-reduces of 1 hop and 4,096/16 bytes over 4 links
    (5 cycles) each; the head's 4,096 × 128,256 bytes over 16 chips 2,138; one stage holds it all."""
    report = plan("llama-3-8b", "lpx-node", dtype="fp8", context=2048, prompt=16, mapping=(2, 8))
    layer = ceil(218_112_000 / 16 / 15_360) + ceil(2 * 8 * 2048 * 128 / 8 / 153_600) + 2 * (350 + ceil(256 / 56))
    assert layer == 888 + 4 + 710
    assert report["floor_us"] == pytest.approx((32 * layer + 2138) / 1e3)
    assert report["floor"]["width"] == 16 and report["floor"]["stages"] == 1
    assert report["floor_ratio"] == pytest.approx(report["per_token_us"] / report["floor_us"])


def test_the_lpx_rack_is_256_times_its_chip():
    """NVIDIA's rack figures against 256 × the lp30 preset (the blog's per-chip figures are rounded)."""
    rack = load_system("lpx-rack")
    chip = rack.chip
    assert rack.chips == 256
    assert rack.chips * chip.sram_bytes == pytest.approx(rack.figures["rack_sram_bytes"], rel=1e-3)
    assert rack.chips * chip.peak_ops_per_s("fp8") == pytest.approx(rack.figures["rack_fp8_flops"], rel=0.01)
    assert rack.chips * chip.sram_bytes_per_cycle * chip.clock_hz == pytest.approx(
        rack.figures["rack_sram_bytes_per_s"], rel=0.02)
    # 96 links of 14 GB/s each way is 2.69 TB/s a chip: 7.5% over the 640 TB/s rack, which counts 90 links
    both_ways = 2 * chip.c2c_links * chip.c2c_bytes_per_s_per_link
    assert rack.chips * both_ways == pytest.approx(rack.figures["rack_scale_up_bytes_per_s"], rel=0.08)
    assert rack.chips * 2 * 90 * chip.c2c_bytes_per_s_per_link == pytest.approx(
        rack.figures["rack_scale_up_bytes_per_s"], rel=0.01)


@pytest.mark.slow
def test_the_plan_command(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-small", "--system", "tsp-node", "--dtype", "fp16", "--context", "128",
                 "--prompt", "8", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "tokens/s per user" in text and "bound by" in text
    # it says what it measures as it goes: llama-small's 8 heads, 4 kv heads and FFN 512 split 1, 2, 4 and 8 ways
    progress = [line for line in captured.err.splitlines() if line.startswith("plan: llama-small at batch 1, ")]
    assert [line.split(", ")[1].split("-way")[0] for line in progress] == ["1", "2", "4", "8"]
    assert "1-way tensor parallel (1 of 8; 0 mappings so far" in progress[0] and "left" not in progress[0]
    assert all(f"({k + 1} of 8; " in line and " s left)" in line for k, line in enumerate(progress) if k)
    report = json.loads(out.read_text())
    assert report["bottleneck"] == max(report["split_cycles"], key=report["split_cycles"].get)
    assert report["chips"] == report["mapping"]["pipeline_stages"] * report["mapping"]["tensor_parallel"]


def test_every_user_in_flight_holds_a_cache():
    """4 stages × batch 2 serve 8 users at once (the throughput counts them all), so the chips hold 8 users'
    caches: llama-small has 4 layers, 4 kv heads of 32, and an fp32 cache of 128 positions: K and V are
    2·4·4·32·4 = 4,096 bytes a position a user, 4,194,304 bytes for 8 users. One stage × batch 2 holds 2
    users' (a quarter of that)."""
    pipelined = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, batch=2, mapping=(4, 1))
    assert pipelined["users"] == 8 and pipelined["cache_bytes"] == 2 * 4 * 4 * 32 * 4 * 128 * 8 == 4194304
    assert pipelined["tokens_per_s"] == pytest.approx(pipelined["tokens_per_s_per_user"] * 8)
    alone = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, batch=2, mapping=(1, 1))
    assert alone["users"] == 2 and alone["cache_bytes"] == 4194304 // 4


@pytest.mark.slow
def test_a_pipeline_takes_as_many_users_as_their_caches_leave_room_for():
    """At 49,152 positions one user's cache on one llama-small block is 2·4·32·4·49152 = 50,331,648 bytes.
    4 stages (a block each) cannot hold 4 users' caches; the plan takes the most that fit: the chip's memory
    stays within its SRAM and one user more would not, and the throughput counts only those users."""
    report = plan("llama-small", "tsp-node", dtype="fp32", context=49152, prompt=8, mapping=(4, 1))
    one_more = 2 * 4 * 32 * 4 * 49152
    sram = load_config("tsp").sram_bytes
    assert report["users"] < 4 and report["memory_per_chip"] <= sram < report["memory_per_chip"] + one_more
    assert report["cache_bytes"] == report["users"] * 4 * one_more
    assert report["tokens_per_s"] == pytest.approx(report["tokens_per_s_per_user"] * report["users"])


def test_a_config_file_names_the_model_by_its_stem_or_its_hugging_face_folder(tmp_path):
    """configs/llama-2-70b.json is "llama-2-70b" (it was planned as "configs"); Hugging Face's
    llama-2-70b/config.json is named by its folder."""
    config = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-llama.json").write_text(json.dumps(config))
    (tmp_path / "tiny-hf").mkdir()
    (tmp_path / "tiny-hf" / "config.json").write_text(json.dumps(config))
    assert model_spec(str(tmp_path / "configs" / "tiny-llama.json")).name == "tiny-llama"
    assert model_spec(str(tmp_path / "tiny-hf" / "config.json")).name == "tiny-hf"


def test_a_plan_counts_its_chips_power_at_the_preset_s_tdp():
    """tsp's preset gives 300 W a chip (its source: TechSpot, 2019): 4 chips draw 1.2 kW, and tokens/s per
    kW is the plan's tokens/s over that; lp30's preset gives no power, and the plan says so."""
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(4, 1))
    assert load_config("tsp").power_watts == 300
    assert planned["power_kw"] == 4 * 300 / 1000
    assert planned["tokens_per_s_per_kw"] == pytest.approx(planned["tokens_per_s"] / 1.2)
    assert "power: 1.2 kW for the chips at their TDP" in str(table(planned))
    assert load_config("lp30").power_watts is None


@pytest.mark.slow
def test_users_picks_the_fewest_chips_holding_them_in_flight():
    """llama-small on tsp-node, 8 users at a 128-position cache: a full pipeline holds stages × batch users
    (their caches are tiny beside SRAM), so the plan takes the fewest chips with stages × batch ≥ 8; a
    million users fit nowhere, and the error names the most that do."""
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, batches=(1, 4), users=8)
    assert planned["users"] == planned["mapping"]["pipeline_stages"] * planned["batch"] >= 8
    holding = [r for r in planned["frontier"] if r["stages"] * r["batch"] >= 8]
    assert planned["chips"] == min(r["chips"] for r in holding)
    assert "the fewest chips holding 8 users in flight" == planned["mapping"]["why"]
    # llama-small has 4 layers, so at most 4 stages, at batch 4 at most: 16 users
    with pytest.raises(PlanError, match=r"holds 1000000 users in flight .*; the most is 16 \(4 stages × batch 4"):
        plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, batches=(1, 4), users=10**6)


def test_a_time_per_output_token_target_is_a_tokens_per_second_target(capsys):
    """--target-tpot-ms T asks for 1000 / T tokens/s per user."""
    assert main(["plan", "--model", "llama-small", "--system", "tsp-node", "--dtype", "fp32", "--context", "128",
                 "--prompt", "8", "--batches", "1", "--target-tpot-ms", "0.1"]) == 0
    assert "the fewest chips reaching 10000.0 tokens/s per user" in capsys.readouterr().out


@pytest.mark.slow
def test_a_first_token_target_takes_the_fewest_chips_that_meet_it_or_names_the_quickest():
    """llama-small on tsp-node, a 64-token prompt: its time to first token on one chip is under 1 ms, so that
    target takes one chip; a target below every mapping's is an error naming the quickest (8 chips: their
    all-reduces are one direct hop)."""
    args = dict(dtype="fp32", context=128, prompt=64, batches=(1,))
    easy = plan("llama-small", "tsp-node", target_ttft_ms=1.0, **args)
    assert (easy["chips"], easy["mapping"]["why"]) == (1, "the fewest chips, with a first token within 1.0 ms")
    assert easy["ttft_ms"] <= 1.0
    quickest = plan("llama-small", "tsp-node", mapping=(1, 8), **args)["ttft_ms"]
    assert quickest < easy["ttft_ms"]
    with pytest.raises(PlanError, match=rf"no mapping on 8 chips gives a first token within 1e-06 ms for a "
                                        rf"64-token prompt; the quickest is {quickest:.3g} ms, on 8 chips$"):
        plan("llama-small", "tsp-node", target_ttft_ms=1e-6, **args)
    assert easy["not_static"] == ["host-side sampling of each token",
                                  "the host link's transfers outside the chips' schedule"]


@pytest.mark.slow
def test_speculative_decoding_is_the_hand_worked_rate_over_the_measured_steps():
    """A round: k draft steps on the draft's own chip, then one target step verifying k + 1 rows; it yields
    1 + a + … + a^k tokens (Leviathan et al.). Tokens/s per user = clock · (1 - a^(k+1)) / (1 - a) /
    (k · draft + verify), over the cycles the compiler measured: the draft's step is its own plan's, the
    one-row step is the target's plain one. Without k, the plan takes the best k: each neighbour is slower. The
    draft is llama-tiny's shape with llama-small's vocabulary (a draft proposes the target's tokens); llama-tiny
    itself, of another vocabulary, is refused before the target is searched."""
    args = dict(dtype="fp32", context=128, prompt=8, batches=(1,))
    tiny = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 1024}
    target = plan("llama-small", "tsp-node", chips=4, **args)
    draft = plan(tiny, "tsp-node", chips=8 - target["chips"], **args)
    clock = load_system("tsp-node").chip.clock_hz
    planned = plan("llama-small", "tsp-node", chips=4, draft=tiny, accept_rate=0.8, **args)
    s = planned["speculative"]
    k, a = s["draft_tokens"], 0.8
    assert s["draft_cycles"] == round(draft["per_token_us"] * clock / 1e6)
    assert s["one_row_cycles"] == round(target["per_token_us"] * clock / 1e6)
    assert s["verify_cycles"] > s["one_row_cycles"]  # k + 1 rows cost more than one, if little
    assert s["expected_tokens"] == pytest.approx(sum(a ** j for j in range(k + 1)))
    rate = clock * (1 - a ** (k + 1)) / (1 - a) / (k * s["draft_cycles"] + s["verify_cycles"])
    assert s["tokens_per_s_per_user"] == pytest.approx(rate, rel=1e-12)
    assert s["chips"] == planned["chips"] + draft["chips"]
    for other in (k - 1, k + 1):
        if other >= 1:
            fixed = plan("llama-small", "tsp-node", chips=4, draft=tiny, accept_rate=0.8, draft_tokens=other,
                         **args)["speculative"]
            assert fixed["tokens_per_s_per_user"] <= s["tokens_per_s_per_user"]
    with pytest.raises(PlanError, match=r"the acceptance rate must be a probability in \[0, 1\], got 1.5"):
        plan("llama-small", "tsp-node", chips=4, draft=tiny, accept_rate=1.5, **args)
    with pytest.raises(PlanError, match=r"the draft llama-tiny has a vocabulary of 256 tokens, the target "
                                        r"llama-small 1,024: a draft must propose the target's tokens"):
        plan("llama-small", "tsp-node", chips=4, draft="llama-tiny", **args)


def test_a_prefill_pool_hands_the_prompt_s_cache_over_in_the_hand_worked_time():
    """llama-small, a 64-token prompt, a pool of 2 prefill chips on tsp-node. The handoff moves
    2 · layers · kv_heads · head_dim · 64 fp32 values; the links between the pools work side by side, as many
    as the smaller pool has chips, one hop away inside a node: hop + ⌈⌈bytes / links⌉ / c2c bytes a cycle⌉.
    The first token is the pool's prefill plus that; the decode mapping takes the 6 chips left."""
    from lpx_tvm.app.models.llama import get_config

    c = get_config("llama-small")
    system = load_system("tsp-node")
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=64, batches=(1,), prefill_chips=2)
    pool = planned["prefill_pool"]
    nbytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 64 * 4
    assert pool["handoff_bytes"] == nbytes
    links = min(pool["chips"], planned["decode_chips"])
    assert pool["handoff_cycles"] == system.hop_cycles + ceil(ceil(nbytes / links) / system.chip.c2c_bytes_per_cycle)
    assert pool["ttft_cycles"] == pool["prefill_cycles"] + pool["handoff_cycles"]
    assert planned["ttft_ms"] == pytest.approx(1e3 * pool["ttft_cycles"] / system.chip.clock_hz)
    assert planned["chips"] == planned["decode_chips"] + pool["chips"] and pool["chips"] <= 2
    assert "the lowest per-token latency on at most 6 chips" == planned["mapping"]["why"]
    with pytest.raises(PlanError, match="a prefill pool of 8 chips leaves none of the 8 for decoding"):
        plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=64, batches=(1,), prefill_chips=8)


@pytest.mark.slow
def test_verify_compiles_each_stage_whole_and_agrees_with_the_full_simulation():
    """llama-small, 4 stages of one block on tsp-node: --verify compiles a stage's block as one program and
    times it (its host transfers at the ends left out: a stage takes its input over the links). The verified
    cycles and the plan's are both within 5% of the full multi-chip simulation of the compiled decoder."""
    simulated = generate("llama-small", tokens=2, system="tsp-node", chips=4, parallel="pipeline", prompt_len=8)
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(4, 1), verify=True)
    (stage,) = planned["verify_stages"]
    assert (stage["blocks"], stage["stages"]) == (1, 4)  # 4 layers over 4 stages
    assert planned["verified_cycles"] == pytest.approx(simulated["per_token_cycles"], rel=0.05)
    assert planned["per_token_us"] * 900 == pytest.approx(simulated["per_token_cycles"], rel=0.05)
    assert abs(planned["verify_error"]) < 0.05
    assert "verified: every stage compiled and timed whole (4 of 1 block: " in str(table(planned))


@pytest.mark.slow
def test_verify_agrees_on_llama_2_7b_on_an_lpx_rack():
    """Llama-2 7B in fp8 on lpx-rack, at the mapping the plan picks (5 stages × 4 chips): 32 layers are 4 stages
    , as evenly as they go, 2 stages of 7 blocks and 3 of 6, each compiled whole; the plan is within 5% of them."""
    planned = plan("llama-2-7b", "lpx-rack", dtype="fp8", mapping=(5, 4), verify=True)
    assert {(s["blocks"], s["stages"]) for s in planned["verify_stages"]} == {(7, 2), (6, 3)}
    assert abs(planned["verify_error"]) < 0.05


@pytest.mark.slow
def test_verify_measures_what_the_int8_plan_leaves_out():
    """int8 is planned as one-byte storage at the int8 matrix rate, without the QDQ flow's quantise and
    dequantise steps. --verify compiles a block of the shard through that flow: llama-small on one tsp chip,
    the plan's per-token cycles with its blocks at the measured cycles are within 5% of generate's int8 run
    (the QDQ graphs compiled whole, each step checked against ONNX Runtime); on 2026-12-01 the plan alone was a
    third short of it (5,605 cycles against 8,448)."""
    simulated = generate("llama-small", tokens=2, config="tsp", prompt_len=8, dtype="int8")
    assert simulated["agree"]
    planned = plan("llama-small", "tsp-node", dtype="int8", context=128, prompt=8, mapping=(1, 1), verify=True)
    measured = planned["int8_as_compiled"]
    assert measured["per_token_cycles"] == pytest.approx(simulated["per_token_cycles"], rel=0.05)
    assert "int8 as compiled: a block of this shard through the QDQ flow" in str(table(planned))


def test_a_tokens_cycles_are_its_blocks_head_links_and_cache_write_worked_by_hand():
    """llama-small (4 layers, hidden 256, 8 heads, 4 K/V heads of 32) in fp32 on tsp-node, 2 stages × 2 chips.
    Besides the compiled parts (a block's shard and the LM head's, measured by the codegen), every term is
    worked out here from tsp-node's figures: a hop 216 cycles, links of 15 GB/s at 900 MHz (16.7 bytes a
    cycle), the host link 35 bytes a cycle with a 450-cycle DMA latency.
    - A block's two all-reduces over 2 chips are in its compiled cycles: the 1,024-byte hidden state goes whole
      to the other chip (one hop and ceil(1,024 / 16.7) = 62 cycles, 278 against a reduce-scatter and an
      all-gather's 2 × (216 + 31) = 494), then an ADD: each at least 278 more than the shard alone.
    - One stage boundary inside the node: a hop and the whole hidden state, 216 + 62 = 278.
    - The K/V write: a chip holds 2 layers, 2 K/V heads each: 2 × 2 (K and V) × 2 × 32 × 4 bytes = 1,024,
      ceil(1,024 / 35) = 30 cycles + 450.
    The compiled parts come from the simulator, not the plan's cost code: a block mid-stage is two blocks'
    program less one block's, and the head its own program."""
    import numpy as np
    from programs import simulated_cycles

    from lpx_tvm.app.plan.graph import BlockShape, block_graph, head_graph

    tsp = load_config("tsp")
    # a chip's shard: hidden 256, 8 ÷ 2 query heads, 4 ÷ 2 K/V heads of 32, 512 ÷ 2 MLP columns, one new token
    # against 128 cached positions, its all-reduces over 2 chips of tsp-node
    shape = BlockShape(256, 4, 2, 32, 256, 1, 128, system="tsp-node", width=2)
    alone = BlockShape(256, 4, 2, 32, 256, 1, 128)

    def block(s):
        return (simulated_cycles(block_graph(s, np.float32, 2), tsp)
                - simulated_cycles(block_graph(s, np.float32, 1), tsp))
    shard = block(shape)
    assert shard - block(alone) >= 2 * 278
    head = simulated_cycles(head_graph(256, 1024 // 2, 1, np.float32), tsp)
    expected = 4 * shard + head + 278 + 30 + 450
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(2, 2))
    assert round(planned["per_token_us"] * 900) == expected
    assert planned["split_cycles"]["KV write"] == 480


@pytest.mark.slow
def test_the_plan_plot_labels_every_frontier_point(tmp_path, monkeypatch):
    """llama-small's plan on tsp-node at batches 1 and 4: a 6.5 × 4.5 inch figure at 120 dots an inch (780 × 540
    pixels); a series per batch, the frontier and the chosen mapping in the legend; and one annotation per
    frontier point, naming its mapping, batch and chips, the points picked here as the rows no other beats on
    both tokens/s per user and per chip."""
    pytest.importorskip("matplotlib", reason="needs the optional dependency matplotlib (lpx-tvm[plot])")
    from lpx_tvm.app.tools import plots

    report = plan("llama-small", "tsp-node", dtype="fp16", context=128, prompt=8, batches=(1, 4))
    rows = report["frontier"]
    best = [r for r in rows if not any(o["tokens_per_s_per_user"] >= r["tokens_per_s_per_user"]
                                       and o["tokens_per_s_per_chip"] >= r["tokens_per_s_per_chip"] and o != r
                                       and (o["tokens_per_s_per_user"], o["tokens_per_s_per_chip"])
                                       != (r["tokens_per_s_per_user"], r["tokens_per_s_per_chip"]) for o in rows)]
    drawn = {}
    real_save = plots._save

    def keep(plt, fig, ax, path, *labels):
        drawn["legend"] = ax.get_legend_handles_labels()[1]
        drawn["notes"] = sorted(t.get_text() for t in ax.texts)
        return real_save(plt, fig, ax, path, *labels)

    monkeypatch.setattr(plots, "_save", keep)
    png = plots.plan_frontier(report, tmp_path / "plan.png").read_bytes()
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (780, 540)
    assert drawn["legend"] == ["batch 1", "batch 4", "frontier", f"chosen: {report['chips']} chips"]
    assert drawn["notes"] == sorted(f"{r['stages']}×{r['width']}, batch {r['batch']}, {r['chips']} chips"
                                    for r in best)


@pytest.mark.slow
def test_a_model_larger_than_a_rack_spans_racks_at_the_rack_to_rack_latency():
    """lpx-system-N: N LPX racks; a tensor-parallel group stays within a rack, stages cross racks. Llama-3-8B
    16 stages × 32 wide on two racks: a rack holds 256 / 32 = 8 stages, so one stage boundary of the 15 crosses
    racks, at the system's rack-to-rack figure (Hot Chips 2026: 1.60 µs to reach 384 GB). 1,000 cycles more on
    that figure is 1,000 cycles more a token; the 405B, too big for a rack, plans on four."""
    from dataclasses import replace

    two = load_system("lpx-system-2")
    assert (two.chips, two.figures["rack_hop_cycles"]) == (512, 1600)
    slower = replace(two, figures={**two.figures, "rack_hop_cycles": 2600})
    base = plan("llama-3-8b", two, dtype="fp8", context=2048, prompt=16, mapping=(16, 32))
    more = plan("llama-3-8b", slower, dtype="fp8", context=2048, prompt=16, mapping=(16, 32))
    assert round((more["per_token_us"] - base["per_token_us"]) * 1000) == 1000
    with pytest.raises(ValueError, match="1 to 16 racks"):
        load_system("lpx-system-17")


def test_a_sliding_window_is_read_not_ignored():
    """A Mistral-style config.json with a 4,096-position window: every layer attends to the last 4,096
    positions (tests/test_plan_published.py prices it); a window switched off (Qwen2's use_sliding_window
    false) or null leaves every layer the whole context."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}
    assert model_spec(config).sliding == tuple(range(32)) and model_spec(config).window == 4096
    assert model_spec({**config, "sliding_window": None}).sliding == ()
    assert model_spec({**config, "use_sliding_window": False}).sliding == ()


def test_a_prefill_pool_hands_mla_s_latent_and_a_window_s_positions_over(monkeypatch):
    """The handoff moves the cache as the decode chips hold it. DeepSeek-V3 (MLA: kv_lora_rank 512 + rope 64 a
    position, no heads; 61 layers), a 1,000-token prompt in fp8, decoded 8 wide: the latent whole on each of the
    8 chips, 576 · 61 · 1,000 · 8 bytes. gpt-oss-20b (24 layers alternating a 128-position window with full
    attention, 8 K/V heads of 64): 12 · 1,000 + 12 · 128 positions of 2 · 8 · 64 bytes, once. The prefill
    mapping is a stand-in (its cycles are not what is checked)."""
    import lpx_tvm.app.plan.prefill_pool as pool_module
    from lpx_tvm.app.plan.model import Mapping, model_spec

    stand_in = Mapping(stages=1, width=8, batch=1, chips=8, per_token_cycles=1, ttft_cycles=1000, split={},
                       memory_per_chip=0)
    monkeypatch.setattr(pool_module, "evaluate", lambda *a, **k: stand_in)
    system = load_system("lpx-rack")
    decode = Mapping(stages=1, width=8, batch=1, chips=8, per_token_cycles=1, ttft_cycles=1, split={},
                     memory_per_chip=0)
    deepseek = pool_module.prefill_pool(model_spec("deepseek-v3"), system, "fp8", 8, decode, 2048, 1000)
    assert deepseek["handoff_bytes"] == (512 + 64) * 61 * 1000 * 8
    gpt_oss = pool_module.prefill_pool(model_spec("gpt-oss-20b"), system, "fp8", 8, decode, 2048, 1000)
    assert gpt_oss["handoff_bytes"] == (12 * 1000 + 12 * 128) * 2 * 8 * 64
