"""generate --users: several sequences through a pipeline at once, each checked against ONNX Runtime, and the
steady state the compiled schedule allows."""

from dataclasses import replace

import pytest

from lpx_tvm.app.cli import main
from lpx_tvm.app.users import generate_users
from lpx_tvm.runtime_sim import ScheduleError, Simulator, load_config


@pytest.fixture(scope="module")
def four_users():
    return generate_users("llama-small", users=4, tokens=3, system="tsp-node", chips=4, prompt_len=8)


def test_each_user_decodes_its_own_sequence_as_onnx_runtime_does(four_users):
    """Four seeded prompts, each with its own cache and its own ORT reference: every token of every user is
    ORT's (computed in ORT on that user's history), and the users' sequences differ (their caches were not
    mixed up: one user's cache in another's step changes its tokens)."""
    report = four_users
    assert report["agree"] and report["agree_by_user"] == [True] * 4
    assert all(len(tokens) == 1 + 3 for tokens in report["tokens"])
    assert report["tokens"] == report["reference_tokens"]
    assert len({tuple(tokens) for tokens in report["tokens"]}) == 4


def _repeated(program, period, copies):
    shifted = tuple(replace(ins, cycle=ins.cycle + k * period) for k in range(copies) for ins in program.instructions)
    return replace(program, instructions=shifted, predicted_cycles=program.predicted_cycles + (copies - 1) * period)


def test_the_steady_state_is_the_closest_the_machines_rules_let_users_steps_follow(four_users):
    """The next user's step may start ``period`` cycles after one's: on every chip the step repeated at that
    distance (three copies and more, on the same addresses) keeps the simulator's rules, and on some chip one
    cycle less breaks one (a unit, a link port, or a hazard on a reused buffer). With 4 users and a step far
    longer than the period, the pipeline issues a step every period: tokens/s = clock / period."""
    import lpx_tvm
    from lpx_tvm.app.generate import _open_decoder

    report = four_users
    period = report["period_cycles"]
    decoder = _open_decoder("llama-small", 8, 0, None)
    _, (graph, shapes) = decoder.graphs(8, 128)
    compiled = lpx_tvm.compile(graph, input_shapes=shapes, state=decoder.cache_names, system="tsp-node",
                               parallel="pipeline", chips=4)
    (system,) = compiled.simulators.values()
    broken = 0
    for _, chip_sim in system.chips:
        program = chip_sim.program
        copies = -(-program.predicted_cycles // (period - 1)) + 1
        Simulator(_repeated(program, period, copies), chip_sim.config, timing_only=True)  # raises if broken
        try:
            Simulator(_repeated(program, period - 1, copies), chip_sim.config, timing_only=True)
        except ScheduleError:
            broken += 1
    assert broken >= 1
    assert 4 / report["step_cycles"] > 1 / period
    assert report["tokens_per_s"] == pytest.approx(load_config("tsp").clock_hz / period, rel=1e-12)
    assert report["tokens_per_s_per_chip"] == pytest.approx(report["tokens_per_s"] / 4, rel=1e-12)


def test_the_generate_command_takes_users(capsys):
    assert main(["generate", "llama-tiny", "--system", "tiny-2", "--users", "2", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "user 1: 1 token after the prompt, each equal to ONNX Runtime's" in out
    assert "user 2: 1 token after the prompt, each equal to ONNX Runtime's" in out
    assert main(["generate", "llama-tiny", "--system", "tiny-2", "--users", "2", "--parallel", "tensor"]) == 1
    assert "--users runs users through a pipeline" in capsys.readouterr().err


def test_the_plan_counts_users_in_flight_at_the_busiest_stages_pace(four_users):
    """The plan's users in flight start a step no more often than its busiest stage allows: llama-small on 4
    tsp chips holds a block a stage, and the last stage the LM head too, so a step can start every block +
    head cycles (worked here from the plan's own measured block and head, with no all-reduce at width 1),
    and 4 users then make clock / period tokens a second, against the step's 4 / 7,456 a cycle. The plan is
    within 10% of the steady state the compiled pipeline's rules allow (6.8% under it on 2026-12-01: the
    plan's head is a whole program, its input's host transfer included)."""
    from lpx_tvm.app.plan import block_cost, head_cost, model_spec, plan, shard_shape

    spec, tsp = model_spec("llama-small"), load_config("tsp")
    shape, _, _ = shard_shape(spec, 1, 1, 128)
    block, head = block_cost(tsp, shape, "fp32").cycles, head_cost(tsp, spec.hidden, spec.vocab, 1, "fp32").cycles
    planned = plan("llama-small", "tsp-node", dtype="fp32", context=128, prompt=8, mapping=(4, 1))
    assert planned["users"] == 4 and planned["period_cycles"] == block + head
    assert 4 / (planned["per_token_us"] * 900) > 1 / planned["period_cycles"]  # the stages' pace binds
    assert planned["tokens_per_s_per_chip"] == pytest.approx(tsp.clock_hz / (block + head) / 4, rel=1e-12)
    assert planned["tokens_per_s_per_chip"] == pytest.approx(four_users["tokens_per_s_per_chip"], rel=0.10)
