"""The debugger's block report (jaxmp/diagnostics/_block_report.py): under a block-scaled format,
a block that saturates (the OCP floor rule at amax 1.9) or underflows (NVFP4's per-tensor scale
against a row of 1e-3 values) is counted and named by its module path, and the rules that cannot
saturate, or the scales that cannot underflow, report none on the same inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
from jaxmp import fp8
from jaxmp.diagnostics import _block_report

RS = np.random.RandomState(0)
# Powers of two only: no block's amax has a mantissa that the floor rule saturates (above 1.75).
X = (RS.choice([-1.0, -0.5, 0.5, 1.0], size=(8, 32))).astype(np.float32)
W1 = (RS.choice([-0.25, 0.125, 0.25], size=(32, 32))).astype(np.float32)
W2 = (RS.choice([-0.25, 0.25], size=(32, 4))).astype(np.float32)


def _model(x, w1, w2):
    with jax.named_scope("encoder"):
        h = x @ w1
    with jax.named_scope("head"):
        return h @ w2


def _forward(policy, x, rules=None):
    return _block_report.block_report(_model, x, W1, W2, policy=policy, rules=rules, backward=False)


def _counts(report):
    return {(r.path, r.leg, r.operand): (r.saturated, r.underflowed) for r in report.rows}


def test_a_saturating_block_under_the_floor_rule_is_named_by_its_module_path():
    x = X.copy()
    x[3, 5] = 1.9  # floor rule: X = 2**-8, 1.9 * 256 = 486 > 448, clipped
    floor = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule="floor")
    got = _counts(_forward("O2-bf16", x, jaxmp.AutocastRules(fp8_matmuls=floor)))
    assert got[("encoder", "forward", "lhs")] == (1, 0)  # the one block holding 1.9
    assert got[("encoder", "forward", "rhs")] == (0, 0)
    assert set(got) == {(p, "forward", o) for p in ("encoder", "head") for o in ("lhs", "rhs")}
    # The preset's round-up rule never saturates: the same input, nothing flagged.
    assert _forward("O2-mxfp8", x).flagged() == ()
    assert "encoder" in str(_forward("O2-bf16", x, jaxmp.AutocastRules(fp8_matmuls=floor)))


def test_nvfp4_underflowing_blocks_are_counted_where_mxfp8_has_none():
    x = X.copy()
    x[0, 0] = 1000.0
    x[7] = 1e-3 * np.sign(x[7])  # a row 1e6 below the tensor's amax: its E4M3 block scales round to 0
    nv = _counts(_forward("O2-nvfp4", x))
    assert nv[("encoder", "forward", "lhs")] == (0, 2)  # row 7's two 1x16 blocks
    assert _counts(_forward("O2-mxfp8", x))[("encoder", "forward", "lhs")] == (0, 0)  # a scale per block


def test_the_backward_legs_are_reported_with_the_path_of_their_forward():
    # Both kernels differentiated (the gradient is taken with respect to the first argument): a leg
    # whose gradient is not asked for (the head's wgrad when only W1 is) does not run.
    report = _block_report.block_report(lambda w, x: jnp.sum(_model(x, *w).astype(jnp.float32) ** 2),
                                        (W1, W2), X, policy="O2-mxfp8")
    legs = {(r.path, r.leg, r.operand) for r in report.rows}
    assert {("encoder", "wgrad", "gradient"), ("encoder", "wgrad", "lhs"), ("head", "dgrad", "gradient"),
            ("head", "wgrad", "gradient")} <= legs
    assert all(r.blocks > 0 for r in report.rows)


def test_inputs_the_backward_pass_cannot_take_are_refused_naming_what_to_pass():
    import pytest

    loss = lambda w1, x, w2: jnp.sum(_model(x, w1, w2).astype(jnp.float32))  # noqa: E731
    cases = [
        (lambda: _block_report.block_report(lambda w1, x, w2: _model(x, w1, w2), W1, X, W2),
         r"returns shape \(8, 4\) \S+, not a floating scalar.*backward=False"),
        (lambda: _block_report.block_report(lambda n, x: loss(W1, x, W2) * jnp.float32(n), 3, X),
         r"first argument, which holds no floating leaf \(int\).*parameters first"),
        (lambda: _block_report.block_report(lambda n, x: loss(W1, x, W2) * jnp.float32(n), jnp.arange(3), X),
         r"no floating leaf \(int32\)"),
        (lambda: _block_report.block_report(lambda: loss(W1, X, W2)), r"fn was given no inputs.*backward=False"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
    # The ways out the messages name run: the forward pass alone (a non-scalar output), integer leaves held fixed.
    assert _block_report.block_report(lambda w1, x, w2: _model(x, w1, w2), W1, X, W2, backward=False).rows
    mixed = _block_report.block_report(lambda p, x: loss(p["w1"], x, W2) * p["n"].astype(jnp.float32), {"w1": W1, "n": jnp.int32(2)}, X)
    assert {r.leg for r in mixed.rows} == {"forward", "dgrad", "wgrad"}
