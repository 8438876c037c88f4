"""experiments.precision_reports: the precision of the experiments' real train steps, O0 vs O2-fp16."""

import functools

import jax
import jax.numpy as jnp
import pytest

from experiments import precision_reports as pr

# Tiny versions (feature dims multiples of 8) of the two models the README reports.
TINY = {
    "resnet9": {"input_shape": (8, 8, 3), "width": 8},
    "transformer": {"input_shape": (16,), "num_layers": 1, "model_dim": 16, "num_heads": 2, "mlp_dim": 32},
}
# The dims the data and the labels fix: 3 input channels / 1 feature per token, 10 classes
# (the classifier forward, and its two backward matmuls).
DATA_FIXED = {
    "resnet9": {("C_in=3",), ("N=10",), ("M=10",), ("K=10",)},
    "transformer": {("K=1",), ("N=1",), ("N=10",), ("M=10",), ("K=10",)},
}
NORMS = ("BatchNorm", "LayerNorm")


def _report(model, policy):
    return pr.train_step_report(model, policy, batch_size=8, **TINY[model])


@pytest.fixture(scope="module")
def report():
    """The tiny models' train-step reports by (model, policy), traced once for this module."""
    return functools.cache(_report)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("model", list(TINY))
def test_o0_is_all_float32(report, model):
    rep = report(model, "O0")
    assert rep.total_flops > 0 and rep.low_precision_share == 0.0 and rep.tensor_core_share == 0.0
    assert {(op.lhs_dtype, op.rhs_dtype) for op in rep.ops} == {("f32", "f32")}
    assert rep.amdahl_bound == 1.0
    assert not rep.risky and not rep.missed


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("model", list(TINY))
def test_o2_fp16_runs_every_matmul_in_half_and_keeps_norms_in_float32(report, model):
    o0, rep = report(model, "O0"), report(model, "O2-fp16")
    # Same program, other dtypes: the same matmuls/convs with the same FLOPs, now in f16, bar
    # the fused attention's, which XLA:CPU computes in float32 (it has no f16 x f16 -> f32 dot).
    assert len(rep.ops) == len(o0.ops) and rep.total_flops == o0.total_flops
    attention = [op for op in rep.ops if "dot_product_attention" in op.name]
    assert bool(attention) == (model == "transformer")
    assert {(op.lhs_dtype, op.rhs_dtype) for op in rep.ops if op not in attention} == {("f16", "f16")}
    assert {(op.lhs_dtype, op.rhs_dtype) for op in attention} <= {("f32", "f32")}
    assert rep.low_precision_share > 0.75 and all(op in attention for op in rep.missed)
    # Only the dims fixed by the data and the 10 classes miss the multiple-of-8 rule.
    assert {op.shape_problems for op in rep.shape_ineligible if op not in attention} == DATA_FIXED[model]
    assert sum(op.flops for op in rep.shape_ineligible) < 0.05 * rep.total_flops
    assert 0.75 < rep.tensor_core_share < 1.0 and rep.amdahl_bound_tensor_core < rep.amdahl_bound <= 8.0
    # No risky half op in a norm: BatchNorm / LayerNorm statistics run in float32 ...
    assert not [r for r in rep.risky if any(n in r.name for n in NORMS)]
    # ... because their params and running statistics are float32 while the rest is f16 (O2).
    _, (state, _, _), _ = pr.build(model, "O2-fp16", 8, **TINY[model])
    leaves = jax.tree_util.tree_leaves_with_path({"params": state.params, **state.model_state})
    norm = {jax.tree_util.keystr(p): x.dtype for p, x in leaves if any(n in jax.tree_util.keystr(p) for n in NORMS)}
    assert norm and set(norm.values()) == {jnp.dtype(jnp.float32)}
    assert any(x.dtype == jnp.float16 for x in jax.tree.leaves(state.params))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_o2_fp16_risky_ops_are_where_o2_puts_them(report):
    # ResNet-9: the model itself has no risky half op; the only flags are jaxmp's own
    # finiteness check of the f16 gradients (sum of x * 0: 0 or NaN, it cannot overflow).
    rep = report("resnet9", "O2-fp16")
    assert all(r.category == "loss" and "all_finite" in r.source for r in rep.risky)
    # Transformer: O2 keeps norms and the loss in float32, and the fused attention keeps its
    # softmax in float32, so no softmax is risky either.
    rep = report("transformer", "O2-fp16")
    assert not [r for r in rep.risky if r.category == "softmax"]
    assert not [r for r in rep.risky if r.category == "loss" and "all_finite" not in r.source]


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_compact_table_lists_flagged_ops_first(report):
    rep = report("transformer", "O2-fp16")
    text = pr.compact_table(rep, max_rows=3)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["#", "op", "dtypes"] and ("not x8" in lines[1] or "MISSED" in lines[1])
    assert max(map(len, lines)) <= 88   # each op's module path on a line of its own, clipped to fit
    assert f"... {len(rep.ops) - 3} more ops" in text
