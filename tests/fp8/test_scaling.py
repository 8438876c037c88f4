"""jaxmp/fp8/_scaling.py: amax, the scale an amax gives, quantize/dequantize, and the delayed history update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._formats import E4M3, E5M2
from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling, Fp8Meta
from jaxmp.fp8._scaling import amax, compute_scale, dequantize, qdq, quantize, update_meta
from jaxmp.fp8._scaling import update_meta as _update_meta


def test_amax_is_the_float32_absolute_maximum():
    out = amax(jnp.array([[-3.0, 2.0], [1.0, 0.5]], jnp.bfloat16))
    assert out.dtype == jnp.float32 and float(out) == 3.0


def test_compute_scale_maps_the_amax_to_the_formats_top_with_the_margin():
    assert float(compute_scale(4.0, 1.0, E4M3)) == 112.0
    assert float(compute_scale(4.0, 1.0, E4M3, margin=2)) == 28.0
    assert float(compute_scale(57344.0, 1.0, E5M2)) == 1.0
    out = compute_scale(jnp.float32(2.0), jnp.float32(1.0), E4M3)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("bad_amax", [0.0, float("inf"), float("nan"), 1e-45])
def test_compute_scale_keeps_the_old_scale_where_the_amax_gives_none(bad_amax):
    # 1e-45 (a float32 subnormal) gives a scale of 448 / 1e-45 = inf: not usable either.
    assert float(compute_scale(bad_amax, 7.0, E4M3)) == 7.0


def test_quantize_saturates_finite_values_and_lets_non_finite_through():
    q = quantize(jnp.array([1.0, 1000.0, -1000.0, jnp.inf, jnp.nan]), jnp.float32(1.0), E4M3)
    assert q.dtype == E4M3
    v = np.asarray(q, np.float32)
    assert v[:3].tolist() == [1.0, 448.0, -448.0]
    assert not np.isfinite(v[3]) and np.isnan(v[4])  # the overflow must reach the skip check


def test_dequantize_undoes_the_scale_in_the_requested_dtype():
    x = jnp.array([0.25, -1.5, 3.0], jnp.float32)
    scale = jnp.float32(64.0)
    out = dequantize(quantize(x, scale, E4M3), scale, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and np.asarray(out, np.float32).tolist() == [0.25, -1.5, 3.0]


def test_qdq_rounds_to_the_formats_grid_with_current_scaling_and_keeps_the_dtype():
    x = jnp.linspace(-1.0, 1.0, 33, dtype=jnp.float32)
    y = jax.jit(qdq, static_argnums=1)(x, E4M3)
    assert y.dtype == jnp.float32
    err = np.abs(np.asarray(y) - np.asarray(x))
    assert err.max() > 0  # it did round
    assert err.max() <= 2.0 ** -4  # e4m3 has 3 mantissa bits: relative error <= 2**-4 at the top
    assert float(jnp.max(jnp.abs(y))) == 1.0  # the amax maps to 448 exactly, and back
    fixed = qdq(x, E4M3, scale=jnp.float32(1.0))
    assert not np.array_equal(np.asarray(fixed), np.asarray(y))  # a fixed scale loses the small values' bits


def test_update_meta_records_the_amax_newest_first_and_rescales():
    recipe = DelayedScaling(history_length=3)
    meta = recipe.init_meta()
    update_meta = jax.jit(_update_meta, static_argnums=(2, 3))  # one compile, not dozens of eager ops
    for a in (2.0, 8.0, 4.0):
        meta = update_meta(meta, jnp.array([a, -a / 2]), recipe)
    assert meta.amax_history.tolist() == [4.0, 8.0, 2.0]
    assert float(meta.scale) == 448.0 / 8.0  # max over the history
    meta = update_meta(meta, jnp.float32(1.0), recipe)
    assert meta.amax_history.tolist() == [1.0, 4.0, 8.0]  # the oldest fell out
    recent = DelayedScaling(history_length=3, reduction="most_recent", margin=1)
    assert float(update_meta(meta, jnp.float32(2.0), recent).scale) == 448.0 / 2.0 / 2.0
    assert float(update_meta(meta, jnp.float32(2.0), recipe, E5M2).scale) == 57344.0 / 4.0  # history [2, 1, 4]


def test_update_meta_ignores_a_non_finite_amax_and_runs_under_jit():
    recipe = DelayedScaling(history_length=2)
    meta = Fp8Meta(jnp.float32(3.0), jnp.array([5.0, 1.0], jnp.float32))
    out = jax.jit(update_meta, static_argnums=2)(meta, jnp.array([jnp.inf]), recipe)
    assert float(out.scale) == 3.0 and out.amax_history.tolist() == [5.0, 1.0]


def test_update_meta_refuses_a_current_recipe_and_a_history_of_another_length():
    meta = DelayedScaling(history_length=4).init_meta()
    with pytest.raises(TypeError, match="needs a DelayedScaling recipe, got CurrentScaling"):
        update_meta(meta, jnp.ones(2), CurrentScaling())
    with pytest.raises(ValueError, match=r"amax_history has shape \(4,\), the recipe's history_length is 8"):
        update_meta(meta, jnp.ones(2), DelayedScaling(history_length=8))
