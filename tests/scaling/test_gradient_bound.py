"""The gradient bound that stands in for the update check under O2-bf16 (float32 masters and state).

docs/design.md#the-gradient-bound: with float32 masters and no float16 leaf, a step is applied only
when every unscaled gradient is finite and within ``GRADIENT_BOUND``; the updates are not re-read.
These tests inject overflows in the update itself and check the step is skipped with nothing
changed, and hold the step's bytes to the hand-written floor with XLA's deterministic figures.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._scaling._transform import GRADIENT_BOUND, NON_FINITE_GRADIENTS, NON_FINITE_UPDATES, update_and_apply
from tests._support._arrays import leaf_bytes



def _squares():
    # An inner transform whose update overflows float32 from finite gradients: g**2 past 1.8e19.
    return optax.GradientTransformation(lambda p: optax.EmptyState(),
                                        lambda g, s, p=None: (jax.tree_util.tree_map(lambda x: -x * x, g), s))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("fused", [True, False])
def test_an_update_that_overflows_from_finite_gradients_is_skipped_and_changes_nothing(fused):
    params = {"w": jnp.array([1.0, 2.0], jnp.bfloat16)}
    grads = {"w": jnp.array([1e20, 1.0], jnp.float32)}  # finite; its square is inf in float32
    inners = (optax.chain(_squares(), optax.adam(1e-3)),) if not fused else (_squares(), optax.chain(_squares(), optax.adam(1e-3)))
    for inner in inners:
        tx = jaxmp.loss_scaling(inner, "none", master_weights=True)
        state = tx.init(params)
        if fused:
            new, new_state = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))(grads, state, params)
        else:
            updates, new_state = jax.jit(tx.update)(grads, state, params)
            new = jaxmp.apply_updates(params, updates, new_state)
        assert not bool(new_state.last_step_finite)
        assert int(new_state.skip_reason) == NON_FINITE_GRADIENTS  # past the bound: reported with non-finite ones
        assert leaf_bytes(new) == leaf_bytes(params)
        assert leaf_bytes(new_state.inner_state) == leaf_bytes(state.inner_state)  # master and moments untouched
        # The injection is real: without the check the master takes the inf.
        raw = jaxmp.loss_scaling(inner, "none", master_weights=True, check_updates=False)
        _, raw_state = jax.jit(lambda g, s, p: update_and_apply(raw, g, s, p))(grads, raw.init(params), params)
        assert not np.isfinite(np.asarray(raw_state.master_params["w"])).all()


def test_a_master_near_float32_max_is_never_stepped_past_it():
    # The largest finite bfloat16 as param (and master); a gradient that would push it past 3.4e38.
    top = float(jnp.finfo(jnp.bfloat16).max)
    params = {"w": jnp.array([top, 1.0], jnp.bfloat16)}
    tx = jaxmp.loss_scaling(optax.sgd(1.0), "none", master_weights=True)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))
    new, new_state = step({"w": jnp.array([-2e36, 0.0], jnp.float32)}, state, params)
    assert not bool(new_state.last_step_finite) and int(new_state.skip_reason) == NON_FINITE_GRADIENTS
    assert leaf_bytes(new) == leaf_bytes(params) and leaf_bytes(new_state.inner_state) == leaf_bytes(state.inner_state)
    raw = jaxmp.loss_scaling(optax.sgd(1.0), "none", master_weights=True, check_updates=False)
    raw_new, _ = jax.jit(lambda g, s, p: update_and_apply(raw, g, s, p))(
        {"w": jnp.array([-2e36, 0.0], jnp.float32)}, raw.init(params), params)
    assert np.isinf(np.asarray(raw_new["w"], np.float32)[0])  # what the bound kept out
    # Within the bound the same transform steps the master as usual.
    new, new_state = step({"w": jnp.array([GRADIENT_BOUND, 0.0], jnp.float32)}, state, params)
    assert bool(new_state.last_step_finite)
    assert float(new_state.master_params["w"][0]) == np.float32(top) - np.float32(GRADIENT_BOUND)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_non_finite_gradients_keep_their_reason_and_dynamic_scaling_backs_off():
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = jaxmp.loss_scaling(optax.adamw(1e-3), "dynamic", master_weights=True)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))
    for bad in (jnp.nan, jnp.inf):
        new, new_state = step({"w": jnp.array([1.0, bad, 1.0], jnp.float32)}, state, params)
        assert int(new_state.skip_reason) == NON_FINITE_GRADIENTS
        assert leaf_bytes(new_state.inner_state) == leaf_bytes(state.inner_state)
        assert float(new_state.loss_scale.loss_scale) < float(state.loss_scale.loss_scale)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_float16_params_keep_the_check_of_the_update(skip_with):
    # A master past float16's range gives an inf param: only the check of the update sees it
    # (made before the skip, on the update the step would apply). Nothing changes, moments included.
    params = {"w": jnp.array([60000.0, 1.0], jnp.float16)}
    for inner, g in ((optax.sgd(1.0), -1e4), (optax.adam(1e4), -1.0)):
        tx = jaxmp.loss_scaling(inner, "none", master_weights=True, skip_with=skip_with)
        state = tx.init(params)
        step = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))
        new, new_state = step({"w": jnp.array([g, 0.0], jnp.float32)}, state, params)
        assert int(new_state.skip_reason) == NON_FINITE_UPDATES and leaf_bytes(new) == leaf_bytes(params)
        assert leaf_bytes(new_state.inner_state) == leaf_bytes(state.inner_state)
        # The same step without the overflow is applied.
        new, new_state = step({"w": jnp.array([-g, 0.0], jnp.float32)}, state, params)
        assert int(new_state.skip_reason) == 0 and float(new["w"][0]) < 60000.0


def _hand_floor_and_jaxmp(dtype):
    """Bytes accessed, temp bytes of the hand-written AdamW on float32 masters + lax.cond skip, and jaxmp's."""
    shapes = {"a": (256, 256), "b": (256,), "c": (256, 64)}
    params = {k: jnp.zeros(s, dtype) for k, s in shapes.items()}
    grads = {k: np.full(s, 1e-3, np.float32) for k, s in shapes.items()}
    inner = optax.adamw(1e-3, weight_decay=1e-4)

    def hand(g, st, p):
        m, o = st
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)]))

        def apply(mo):
            u, no = inner.update(g, mo[1], mo[0])
            return optax.apply_updates(mo[0], u), no

        nm, no = jax.lax.cond(finite, apply, lambda mo: mo, (m, o))
        return jax.tree_util.tree_map(lambda a, b: a.astype(b.dtype), nm, p), (nm, no)

    def figures(f, state):
        c = jax.jit(f, donate_argnums=(1,)).lower(grads, state, params).compile()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cost["bytes accessed"], c.memory_analysis().temp_size_in_bytes

    masters = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    floor = figures(hand, (masters, inner.init(masters)))
    tx = jaxmp.loss_scaling(inner, "none" if dtype == jnp.bfloat16 else "dynamic", master_weights=True)
    ours = figures(lambda g, s, p: update_and_apply(tx, g, s, p), tx.init(params))
    return floor, ours


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.slow  # two AdamW compiles, ~3 s
def test_the_o2_bf16_optimizer_step_moves_the_bytes_of_the_hand_written_floor():
    # XLA's bytes accessed and temp sizes are deterministic for a given program.
    (floor_bytes, floor_temp), (bytes_, temp) = _hand_floor_and_jaxmp(jnp.bfloat16)
    assert bytes_ <= 1.05 * floor_bytes, (bytes_, floor_bytes)
    # No array-sized temporary (the old check kept a second optimizer state alive): a few scalars.
    smallest_leaf = 256 * 4
    assert temp <= floor_temp + smallest_leaf, (temp, floor_temp)

