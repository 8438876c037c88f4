"""The precision search's second strategy, its verification and its cost model (issue 62):
``search="program"`` (per-module contributions, an exact integer program, measured after),
``PrecisionPlan.verify`` (float32 and the rules trained over seeds, fidelity.py's verdict) and
``PrecisionPlan.predicted_speedup`` (datasheet peaks, labelled a prediction)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp.diagnostics import ModuleRung, PrecisionPlan, compare_to_float32
from jaxmp.diagnostics._program import solve

pytestmark = pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")

_K = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(_K[3], (32, 16))
Y = jnp.arange(32) % 8
TX = optax.adam(1e-2)


def init(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"l1": jax.random.normal(k[0], (16, 32)) * 0.3, "l2": jax.random.normal(k[1], (32, 32)) * 0.2,
            "head": jax.random.normal(k[2], (32, 8)) * 0.2}


def loss_fn(p, x, y):
    with jax.named_scope("l1"):
        h = jnp.tanh(x @ p["l1"])
    with jax.named_scope("l2"):
        h = jnp.tanh(h @ p["l2"])
    with jax.named_scope("head"):
        # features on an offset of 256 that cancels in float32: bf16's 8 bits lose them
        z = (h + 256.0) @ p["head"] - 256.0 * jnp.sum(p["head"], 0)
    return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(32), y])


@pytest.fixture(scope="module")
def program():
    return compare_to_float32(loss_fn, init(0), X, Y, choose=("O2-bf16", "float32"), steps=4, optimizer=TX,
                              search="program")


def test_the_program_measures_each_module_alone_and_picks_the_cheapest_fit(program):
    assert program.search == "program" and not program.gave_up and program.within_band
    assert {m.path: m.rung for m in program.modules} == {"l1": "O2-bf16", "l2": "O2-bf16", "head": "float32"}
    # one measurement per module per rung below the top, the rest at float32
    assert [(p, r) for p, r, _ in program.contributions] == [("l1", "O2-bf16"), ("l2", "O2-bf16"),
                                                             ("head", "O2-bf16")]
    alone = {p: d for p, _, d in program.contributions}
    assert alone["head"] > program.threshold >= alone["l1"] - program.floor + alone["l2"] - program.floor
    # the prediction: the all-float32 drift plus the chosen rungs' contributions (the head's is 0 at the top)
    want = program.floor + (alone["l1"] - program.floor) + (alone["l2"] - program.floor)
    assert program.predicted_drift == pytest.approx(want) and program.predicted_drift <= program.threshold
    assert program.drift_after <= program.threshold and program.promotions == ()  # measured: no miss
    # cost: reference, twin, all-float32, 3 modules alone, the chosen rules measured
    assert program.cost_steps == 4 * (2 + 1 + 3 + 1)
    text = str(program)
    assert "program search" in text and "alone (the rest at float32): head: O2-bf16" in text
    assert "predicted from datasheet peaks, not measured" in text
    assert program.rules.scope_rules == (("head", "float32"),)


def test_verify_trains_float32_and_the_rules_per_seed_within_the_spread(program):
    batches = [(X, Y), (X[::-1], Y[::-1])] * 2
    got = program.verify(init, batches)
    v = got.verification
    assert v.seeds == (0, 1, 2) and v.steps == 4 and len(v.float32) == len(v.rules) == 3
    lo, hi = v.spread
    assert lo < hi and v.tolerance == pytest.approx(max(hi - lo, 0.01 * abs(np.mean(v.float32))))
    assert v.within and abs(v.gap) <= v.tolerance
    # the chosen rules keep the head in float32: each seed lands within 1e-3 of its float32 run
    assert np.allclose(v.rules, v.float32, rtol=1e-3)
    assert got.modules == program.modules and program.verification is None  # a copy, the search untouched
    assert "Verified: 4 steps per run" in str(got) and "WITHIN" in str(got)
    # deterministic for the given seeds
    again = program.verify(init, batches).verification
    assert (again.float32, again.rules) == (v.float32, v.rules)


def test_verify_fails_rules_that_put_the_sensitive_head_in_nvfp4(program):
    bad = dataclasses.replace(program, rules=jaxmp.AutocastRules().with_scope("head", "O2-nvfp4"))
    v = bad.verify(init, seeds=(0, 1, 2), steps=6).verification
    assert not v.within and abs(v.gap) > v.tolerance
    assert "OUTSIDE" in str(v)
    lo, hi = v.spread
    assert not all(lo <= r <= hi for r in v.rules)


def test_verify_refuses_inputs_the_seeds_cannot_change_and_short_batches(program):
    with pytest.raises(ValueError, match="seeds must change something"):
        program.verify(init(0))
    with pytest.raises(ValueError, match="at least two ints"):
        program.verify(init, seeds=(0,))
    with pytest.raises(ValueError, match="fewer than steps=4"):
        program.verify(init, [(X, Y)])
    with pytest.raises(TypeError, match="optax"):
        program.verify(init, optimizer="adam")
    gave_up = dataclasses.replace(program, rules=None, gave_up="even float32 at every module ...")
    with pytest.raises(ValueError, match="no rules to verify"):
        gave_up.verify(init)


def _plan(modules, unscoped=0, policy="O2-bf16"):
    return PrecisionPlan(tuple(modules), ("O2-nvfp4", "O2-mxfp8", "O2-bf16", "float32"), policy,
                         jaxmp.AutocastRules(), "", "", 4, 0.0, 0.0, 0.0, 0.0, unscoped_flops=unscoped)


def test_the_predicted_speedup_is_the_datasheet_arithmetic_by_hand():
    plan = _plan([ModuleRung("a", "O2-nvfp4", 4000), ModuleRung("b", "O2-mxfp8", 2000),
                  ModuleRung("c", "O2-bf16", 1000), ModuleRung("d", "float32", 500)], unscoped=500)
    total = 8000
    # B200 (HGX B200 datasheet, dense): FP4 9000, FP8 4500, BF16 2250, TF32 1125 TFLOP/s; unscoped at bf16
    t = 4000 / 9000 + 2000 / 4500 + 1000 / 2250 + 500 / 1125 + 500 / 2250
    b200 = plan.predicted_speedup("B200")
    assert b200.vs_bf16 == pytest.approx((total / 2250) / t)
    assert b200.vs_float32 == pytest.approx((total / 1125) / t)
    # H100 SXM: no FP4, no block-scaled GEMMs: NVFP4 and MXFP8 priced at bf16 (emulated there)
    t = (4000 + 2000 + 1000 + 500) / 989.4 + 500 / 494.7
    h100 = plan.predicted_speedup("NVIDIA H100 80GB HBM3")
    assert h100.device == "H100" and h100.vs_bf16 == pytest.approx((total / 989.4) / t)
    assert {r: (k, f) for r, k, f in h100.priced_as}["O2-nvfp4"] == ("bf16", 989.4)
    assert "predicted from datasheet peaks, not measured" in str(h100)
    # TPU v5p: bf16 only; float32 at JAX's default precision is one bf16 pass
    tpu = plan.predicted_speedup("TPU v5p")
    assert (tpu.vs_bf16, tpu.vs_float32) == (pytest.approx(1.0), pytest.approx(1.0))
    # per-tensor fp8 runs on Hopper's fp8 Tensor Cores
    fp8 = _plan([ModuleRung("a", "O2-fp8-current", 1000), ModuleRung("b", "O2-bf16", 1000)])
    assert fp8.predicted_speedup("H200").vs_bf16 == pytest.approx((2000 / 989.4) / (1000 / 1978.9 + 1000 / 989.4))
    with pytest.raises(ValueError, match="known are H100, H200, B200, TPU v5p"):
        plan.predicted_speedup("A100")


def test_the_program_is_solved_exactly():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, r = int(rng.integers(1, 5)), int(rng.integers(2, 4))
        options = [[(float(rng.integers(1, 9)), float(rng.uniform(0, 1))) for _ in range(r)] for _ in range(n)]
        budget = float(rng.uniform(0, n * 0.6))
        fits = [(sum(options[i][c][0] for i, c in enumerate(pick)), pick)
                for pick in itertools.product(range(r), repeat=n)
                if sum(options[i][c][1] for i, c in enumerate(pick)) <= budget]
        got = solve(options, budget)
        if not fits:
            assert got is None
        else:
            assert sum(options[i][c][0] for i, c in enumerate(got)) == min(f[0] for f in fits)


def test_an_einsum_belongs_to_the_module_that_calls_it():
    from jaxmp.diagnostics._choose import _module_flops

    def attn(p, x):
        with jax.named_scope("attn"):
            s = jnp.einsum("btd,bsd->bts", x, x)  # jnp.einsum names a scope after its spec
            return jnp.sum(s @ p)

    found, loose = _module_flops(attn, (jnp.ones((4, 4)), jnp.ones((2, 4, 4))))
    assert set(found) == {"attn"} and found["attn"][0] == 2 * (2 * 2 * 4 * 4 * 4) and loose == 0


def test_a_bad_search_is_refused_by_name():
    with pytest.raises(ValueError, match="'greedy', 'program'"):
        compare_to_float32(loss_fn, init(0), X, Y, choose=True, search="ilp")
    with pytest.raises(ValueError, match="give choose= too"):
        compare_to_float32(loss_fn, init(0), X, Y, search="program")


@pytest.mark.slow
def test_both_strategies_side_by_side_on_the_three_rung_ladder():
    ladder = ("O2-mxfp8", "O2-bf16", "float32")
    greedy = compare_to_float32(loss_fn, init(0), X, Y, choose=ladder, steps=6, optimizer=TX)
    program = compare_to_float32(loss_fn, init(0), X, Y, choose=ladder, steps=6, optimizer=TX, search="program")
    for plan in (greedy, program):
        assert plan.within_band, str(plan)
        rungs = {m.path: m.rung for m in plan.modules}
        assert rungs["head"] == "float32" and {rungs["l1"], rungs["l2"]} <= {"O2-mxfp8", "O2-bf16"}, str(plan)
    # the program measures 3 modules x 2 rungs alone, the floor and its choice (and, had it missed,
    # one trial per movable module per promotion)
    assert len(program.contributions) == 6 and program.predicted_drift <= program.threshold
    assert program.cost_steps >= 6 * (2 + 1 + 6 + 1) and (program.cost_steps == 6 * 10) == (program.promotions == ())
