"""Precision report: planted problems are flagged, clean code is not, FLOPs match hand counts."""

import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxmp
from jaxmp.diagnostics._precision_report import amdahl, analyze_jaxpr

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def nhwc(lhs, rhs):
    return lax.conv_dimension_numbers(lhs, rhs, ("NHWC", "HWIO", "NHWC"))


# ------------------------------------------------------------------------------------------
# FLOPs by hand


def test_batched_dot_flops_and_dimension_30_is_not_tensor_core_eligible():
    x, w = sds((4, 16, 30), F16), sds((4, 30, 24), F16)
    dn = (((2,), (1,)), ((0,), (0,)))
    rep = jaxmp.precision_report(lambda a, b: lax.dot_general(a, b, dn), x, w)
    (op,) = rep.ops
    assert (op.batch, op.m, op.n, op.k) == (4, 16, 24, 30)
    assert op.flops == 2 * 4 * 16 * 24 * 30
    assert op.low_precision and not op.tensor_core_eligible
    assert op.shape_problems == ("K=30",)
    assert rep.shape_ineligible == (op,)
    assert rep.tensor_core_share == 0.0 and rep.low_precision_share == 1.0


def test_multi_dim_free_and_contracting_dims_are_flattened():
    # (2, 3, 8, 5) x (8, 5, 7): contract over (8, 5) -> M = 2*3, N = 7, K = 40.
    rep = jaxmp.precision_report(
        lambda a, b: lax.dot_general(a, b, (((2, 3), (0, 1)), ((), ()))),
        sds((2, 3, 8, 5), F32), sds((8, 5, 7), F32))
    (op,) = rep.ops
    assert (op.batch, op.m, op.n, op.k) == (1, 6, 7, 40)
    assert op.flops == 2 * 6 * 7 * 40
    assert op.accum_dtype == "f32" and op.out_shape == (2, 3, 7)


def test_conv_flops_by_hand_with_stride_and_groups():
    # SAME 3x3 conv, stride 1: out (2, 16, 16, 16); each output = 8 in-channels x 9 taps.
    lhs, rhs = (2, 16, 16, 8), (3, 3, 8, 16)
    rep = jaxmp.precision_report(
        lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=nhwc(lhs, rhs)),
        sds(lhs, F16), sds(rhs, F16))
    (op,) = rep.ops
    assert op.primitive == "conv_general_dilated"
    assert op.flops == 2 * (2 * 16 * 16 * 16) * (8 * 9)
    assert op.tensor_core_eligible and op.shape_problems == ()

    # Stride 2 VALID, 2 groups: out (2, 7, 7, 16); each output sees 8 / 2 = 4 channels x 9 taps.
    lhs, rhs = (2, 16, 16, 8), (3, 3, 4, 16)
    rep = jaxmp.precision_report(
        lambda a, b: lax.conv_general_dilated(a, b, (2, 2), "VALID", dimension_numbers=nhwc(lhs, rhs),
                                              feature_group_count=2),
        sds(lhs, F16), sds(rhs, F16))
    (op,) = rep.ops
    assert op.out_shape == (2, 7, 7, 16)
    assert op.flops == 2 * (2 * 7 * 7 * 16) * (4 * 9)
    # 4 input channels per group breaks the multiple-of-8 rule.
    assert "C_in=4" in op.shape_problems and not op.tensor_core_eligible


def test_conv_with_three_input_channels_is_flagged():
    lhs, rhs = (8, 32, 32, 3), (3, 3, 3, 16)
    rep = jaxmp.precision_report(
        lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=nhwc(lhs, rhs)),
        sds(lhs, BF16), sds(rhs, BF16))
    assert rep.ops[0].shape_problems == ("C_in=3",)
    assert rep.ops[0].flops == 2 * 8 * 32 * 32 * 16 * 3 * 9


# ------------------------------------------------------------------------------------------
# Sub-jaxprs


def test_matmul_in_scan_counts_trip_count_and_nesting_multiplies():
    w = sds((32, 32), F16)

    def f(w, c):
        def outer(c, _):
            def inner(c, _):
                return c @ w, None
            c, _ = lax.scan(inner, c, None, length=3)
            return c, None
        c, _ = lax.scan(outer, c, None, length=5)
        return c

    rep = jaxmp.precision_report(f, w, sds((8, 32), F16))
    (op,) = rep.ops
    assert op.calls == 15
    assert op.flops_per_call == 2 * 8 * 32 * 32
    assert op.flops == rep.total_flops == 15 * 2 * 8 * 32 * 32
    assert op.context == "scan x5 > scan x3"


def test_fori_loop_with_static_bounds_counts_trips():
    rep = jaxmp.precision_report(lambda c, w: lax.fori_loop(0, 7, lambda i, c: c @ w, c),
                                 sds((8, 16), F32), sds((16, 16), F32))
    assert rep.ops[0].calls == 7 and rep.total_flops == 7 * 2 * 8 * 16 * 16
    assert rep.unknown_trip_counts == 0


def test_matmul_inside_custom_vjp_is_found_forward_and_backward():
    @jax.custom_vjp
    def mm(x, w):
        return x @ w

    mm.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    x, w = sds((8, 16), F16), sds((16, 24), F16)

    rep = jaxmp.precision_report(mm, x, w)
    (op,) = rep.ops
    assert "custom_vjp" in op.context and op.flops == 2 * 8 * 24 * 16

    # Under grad the user's bwd rule supplies two more matmuls: (8x24)@(24x16) and (16x8)@(8x24).
    rep = jaxmp.precision_report(jax.grad(lambda x, w: jnp.sum(mm(x, w).astype(F32)), argnums=(0, 1)), x, w)
    assert sorted((o.m, o.n, o.k) for o in rep.ops) == sorted([(8, 24, 16), (8, 16, 24), (16, 24, 8)])
    assert rep.total_flops == 3 * 2 * 8 * 16 * 24


def test_custom_jvp_remat_and_nested_jit_are_walked():
    @jax.custom_jvp
    def cj(x, w):
        return x @ w

    cj.defjvp(lambda p, t: (cj(*p), t[0] @ p[1] + p[0] @ t[1]))

    @jax.jit
    def inner(x, w):
        return x @ w

    def f(x, w):
        return cj(x, w) + inner(x, w) + jax.checkpoint(lambda x: x @ w)(x)

    rep = jaxmp.precision_report(f, sds((8, 8), F16), sds((8, 8), F16))
    contexts = sorted(op.context for op in rep.ops)
    assert len(rep.ops) == 3
    assert any("custom_jvp" in c for c in contexts)
    assert any("jit(inner)" in c for c in contexts)
    assert any("remat" in c or "checkpoint" in c for c in contexts)


def test_cond_counts_costliest_branch_and_while_counts_body_once():
    def f(p, x, w):
        a = lax.cond(p, lambda x: (x @ w) @ w, lambda x: x @ w, x)
        b = lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c @ w, x)
        return a + b

    rep = jaxmp.precision_report(f, sds((), jnp.bool_), sds((8, 16), F32), sds((16, 16), F32))
    one = 2 * 8 * 16 * 16
    assert len(rep.ops) == 4
    assert [op.counted for op in rep.ops].count(False) == 1  # the cheaper cond branch
    assert rep.total_flops == 2 * one + one  # two-matmul branch + while body once
    assert rep.unknown_trip_counts == 1
    assert "while loop" in rep.summary()


def test_name_stack_of_enclosing_scopes_is_kept_inside_scan():
    def f(c, w):
        with jax.named_scope("encoder"):
            def body(c, _):
                with jax.named_scope("layer"):
                    return c @ w, None
            return lax.scan(body, c, None, length=2)[0]

    rep = jaxmp.precision_report(f, sds((8, 8), F32), sds((8, 8), F32))
    assert rep.ops[0].name.endswith("encoder/layer")
    assert rep.ops[0].source.startswith(__file__)


def test_half_precision_all_reduce_under_pmap_is_risky():
    n = jax.device_count()
    f16 = jax.pmap(lambda x: lax.psum(x.astype(F16), "i"), axis_name="i")
    f32 = jax.pmap(lambda x: lax.psum(x, "i"), axis_name="i")
    assert [r.category for r in jaxmp.precision_report(f16, sds((n, 4), F32)).risky] == ["all-reduce"]
    assert jaxmp.precision_report(f32, sds((n, 4), F32)).risky == ()


# ------------------------------------------------------------------------------------------
# Risky and missed ops


def test_softmax_in_fp16_is_risky_and_in_fp32_is_not():
    x = sds((8, 128), F16)
    rep = jaxmp.precision_report(lambda x: jax.nn.softmax(x), x)
    assert [r.category for r in rep.risky] == ["softmax"]
    assert rep.risky[0].dtype == "f16"

    rep = jaxmp.precision_report(lambda x: jax.nn.softmax(x.astype(F32)).astype(F16), x)
    assert rep.risky == ()


def test_exp_log_pow_large_reduction_and_half_loss_are_risky():
    x = sds((64, 128), BF16)  # 8192 elements
    rep = jaxmp.precision_report(lambda x: (jnp.exp(x), jnp.log(x), x ** 3), x)
    assert sorted(r.category for r in rep.risky) == ["exp", "log", "pow"]

    x = sds((16, 2048), F16)
    big = jaxmp.precision_report(lambda x: lax.reduce_sum(x, (1,)), x)
    assert [r.category for r in big.risky] == ["reduction"]
    small = jaxmp.precision_report(lambda x: lax.reduce_sum(x[:, :64], (1,)), x)
    assert small.risky == ()
    # jnp.sum upcasts half inputs to float32 before reducing, so it is not flagged.
    assert jaxmp.precision_report(lambda x: jnp.sum(x, axis=1), x).risky == ()

    # The loss in half precision: returned as a half scalar, or computed in half and cast after.
    half_loss = jaxmp.precision_report(lambda x: jnp.mean(x * x), sds((8,), F16))
    assert [r.category for r in half_loss.risky] == ["loss"]
    cast_after = jaxmp.precision_report(lambda x: -jnp.mean(x * x).astype(F32), sds((8,), F16))
    assert [r.category for r in cast_after.risky] == ["loss"]
    returned = jaxmp.precision_report(lambda x: x[0] * x[1], sds((8,), F16))  # no reduction, still a half scalar
    assert [(r.category, r.primitive) for r in returned.risky] == [("loss", "output")]
    f32_loss = jaxmp.precision_report(lambda x: jnp.mean(jnp.square(x.astype(F32))), sds((8,), F16))
    assert f32_loss.risky == ()


def test_fp32_matmul_under_o2_policy_is_missed():
    policy = jaxmp.get_policy("O2")
    half = policy.compute_dtype

    def step(x, w1, w2):
        h = x @ w1                                        # half, as the policy asks
        return h.astype(F32) @ w2                         # planted: float32 matmul

    args = sds((16, 32), half), sds((32, 64), half), sds((64, 8), F32)
    rep = jaxmp.precision_report(step, *args, policy=policy)
    assert [op.missed for op in rep.ops] == [False, True]
    assert rep.missed == (rep.ops[1],)
    assert rep.policy == str(policy)
    # The same step checked against a float32 policy, or with no policy, has nothing missed.
    assert jaxmp.precision_report(step, *args, policy="O0").missed == ()
    assert jaxmp.precision_report(step, *args).missed == ()
    # Low-precision share and the Amdahl bound follow from the two FLOP counts.
    lo, hi = 2 * 16 * 64 * 32, 2 * 16 * 8 * 64
    p = lo / (lo + hi)
    assert rep.low_precision_share == pytest.approx(p)
    assert rep.amdahl_bound == pytest.approx(1.0 / ((1 - p) + p / 8.0))
    r4 = jaxmp.precision_report(step, *args, policy=policy, tensor_core_speedup=4.0)
    assert r4.amdahl_bound == pytest.approx(1.0 / ((1 - p) + p / 4.0))


def test_clean_mixed_precision_model_is_not_flagged(strict_promotion):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(64, dtype=F16, name="hidden")(x)
            x = nn.relu(x)
            return nn.Dense(16, dtype=F16, name="head")(x)

    model = MLP()
    x = np.ones((32, 128), F16)
    params = jax.eval_shape(model.init, jax.random.key(0), x)  # the report traces: shapes are all it needs

    def loss(params, x):
        logits = model.apply(params, x).astype(F32)       # loss and softmax in float32
        return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])

    rep = jaxmp.precision_report(jax.jit(jax.value_and_grad(loss)), params, x, policy="O1-fp16")
    assert len(rep.ops) == 5  # 2 forward; backward: dW and dx of head, dW of hidden (x needs no grad)
    assert rep.missed == () and rep.shape_ineligible == () and rep.risky == ()
    assert all(op.tensor_core_eligible for op in rep.ops)
    assert rep.tensor_core_share == 1.0 and rep.amdahl_bound == pytest.approx(8.0)
    # The name stack carries the Flax module path, so users can find the op.
    assert {"hidden", "head"} <= {op.name.rsplit("/", 1)[-1] for op in rep.ops}
    assert all(__file__.rsplit("/", 1)[-1] in op.source for op in rep.ops)


# ------------------------------------------------------------------------------------------
# Output formats and inputs


def _planted():
    return jaxmp.precision_report(lambda x, w: jax.nn.softmax(x @ w), sds((64, 30), F16), sds((30, 64), F16),
                                  policy="O2-fp16")


def test_dict_json_table_and_summary_carry_the_findings():
    rep = _planted()
    d = json.loads(rep.to_json())
    assert d["total_flops"] == rep.total_flops == 2 * 64 * 64 * 30
    assert d["ops"][0]["shape_problems"] == ["K=30"]
    assert d["risky"][0]["category"] == "softmax"
    assert d["num_missed"] == 0 and d["num_shape_ineligible"] == 1
    text = str(rep)
    assert "K=30" in text and "softmax" in text and " ".join(rep.summary().split()) in " ".join(text.split())
    assert max(map(len, rep.table(width=88).split("\n"))) <= 88  # the summary wraps with the tables
    line = rep.summary()
    assert "\n" not in line and "1 not multiple-of-8" in line and "1 risky" in line


def test_plain_text_table_without_rich(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.table", None)
    text = _planted().table()
    assert "K=30" in text and "┃" not in text and "Matmuls and convolutions" in text


def test_jitted_function_with_static_args_and_closed_jaxpr_input():
    f = jax.jit(lambda x, w, n: (x @ w) * n, static_argnums=2)
    rep = jaxmp.precision_report(f, sds((8, 16), F16), sds((16, 8), F16), 3)
    assert rep.total_flops == 2 * 8 * 8 * 16
    jx = jax.make_jaxpr(lambda x: x @ x)(jnp.ones((8, 8)))
    assert jaxmp.precision_report(jx).total_flops == analyze_jaxpr(jx).total_flops == 2 * 8 ** 3


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="callable"):
        jaxmp.precision_report("not a function", 1)
    with pytest.raises(ValueError, match="tensor_core_speedup"):
        jaxmp.precision_report(lambda x: x, jnp.ones(2), tensor_core_speedup=0)
    with pytest.raises(ValueError, match="tc_multiple"):
        jaxmp.precision_report(lambda x: x, jnp.ones(2), tc_multiple=0)
    with pytest.raises(ValueError):
        jaxmp.precision_report(lambda x: x, jnp.ones(2), policy="O9")
    with pytest.raises(ValueError, match="share"):
        amdahl(1.5, 8.0)


def test_amdahl_formula():
    assert amdahl(0.5, 8.0) == pytest.approx(16 / 9)
    assert amdahl(0.0, 8.0) == 1.0 and amdahl(1.0, 8.0) == 8.0


def test_report_handles_prng_keys_in_the_traced_function():
    import jax
    import jax.numpy as jnp

    import jaxmp

    def step(w, x, key):
        mask = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum((jnp.where(mask, x, 0).astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

    report = jaxmp.precision_report(step, jax.ShapeDtypeStruct((16, 8), jnp.float32),
                                    jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.random.key(0))
    assert len(report.ops) == 1 and report.low_precision_share == 1.0


def test_where_names_the_users_modules_not_jaxmps_own_scopes():
    # autocast wraps the function in a jaxmp[keep]:autocast(...) scope and, in explain mode, each
    # op in a jaxmp.rule=... scope: both are jaxmp's bookkeeping and would bury the module path.
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16, name="body")(x)
            h = jaxmp.float32_region(lambda v: nn.Dense(8, name="head")(v))(h)
            return h.sum()

    net = Net()
    x = np.ones((8, 16), np.float32)
    params = jax.eval_shape(net.init, jax.random.key(0), x)  # the report traces: shapes are all it needs
    loss = jaxmp.autocast(lambda p, x: net.apply(p, x), "O1-bf16")
    rep = jaxmp.precision_report(jax.grad(loss), params, x)
    names = [op.name for op in rep.ops] + [d.name for d in rep.decisions]
    assert len(rep.ops) == 5 and rep.decisions  # forward + weight grad per layer, input grad of head
    assert not [n for n in names if "jaxmp.rule=" in n or "jaxmp[keep]:autocast(" in n], names
    assert {op.name for op in rep.ops} >= {"jvp(Net)/body", "transpose(jvp(Net))/body"}
    head = [op.name for op in rep.ops if "head" in op.name]
    assert head and all("jaxmp[float32]" in n for n in head), head  # the user's region stays visible


def test_summary_names_the_risky_ops_and_a_zero_bias_gets_no_zero_ulp():
    """The summary says what it calls risky; a zero-initialised bias narrowed under O2 is
    described by its relative ulp, not as "|x| up to 0, ... a change smaller than 0 is lost"."""
    def f(p, x):
        with jax.named_scope("sched"):
            return jnp.mean(jnp.exp(x @ p["w"] + p["b"]))

    x = np.ones((8, 4), np.float32)
    for bias, said in ((0.0, "2**-7 of its magnitude"), (13.3, "a change smaller than 0.0312 is lost")):
        p = {"w": np.full((4, 1), 0.1, np.float32), "b": np.full((1,), bias, np.float32)}
        rep = jaxmp.precision_report(jaxmp.autocast(f, "O2-bf16"), p, x)
        assert [r.category for r in rep.risky] == ["narrowed"]
        assert "1 risky (narrowed add in sched)" in rep.summary(), rep.summary()
        assert said in rep.risky[0].detail and "up to 0," not in rep.risky[0].detail, rep.risky[0].detail
