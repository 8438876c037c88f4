"""jaxmp/fp8/_state.py: a layer's delayed-scaling variables and the step update of every layer in a tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling
from jaxmp.fp8._state import FP8_COLLECTION, LAYER_TENSORS, Fp8Scales, init_layer_state, layer_scales, update_state

RECIPE = DelayedScaling(history_length=4)


def _observed(layer, input, kernel, grad):
    seen = jax.tree_util.tree_map(jnp.zeros_like, layer)
    return {**seen, "input_scale": jnp.float32(input), "kernel_scale": jnp.float32(kernel),
            "output_grad_scale": jnp.float32(grad)}


def test_init_layer_state_has_flax_fp8_ops_keys_scales_one_histories_zero():
    s = init_layer_state(RECIPE)
    assert sorted(s) == sorted(f"{n}_{k}" for n in LAYER_TENSORS for k in ("scale", "amax_history"))
    assert all(float(s[f"{n}_scale"]) == 1.0 for n in LAYER_TENSORS)
    assert all(s[f"{n}_amax_history"].shape == (4,) for n in LAYER_TENSORS)
    scales = layer_scales(s)
    assert isinstance(scales, Fp8Scales) and scales._fields == LAYER_TENSORS
    assert FP8_COLLECTION == "fp8_meta"
    with pytest.raises(TypeError, match="init_layer_state needs a DelayedScaling recipe, got CurrentScaling"):
        init_layer_state(CurrentScaling())


def test_update_state_updates_every_layer_at_any_depth_and_leaves_the_rest():
    layer = init_layer_state(RECIPE)
    state = {"encoder": {"dense": layer, "count": jnp.int32(3)}, "head": layer}
    observed = {"encoder": {"dense": _observed(layer, 2.0, 4.0, 8.0), "count": jnp.int32(0)},
                "head": _observed(layer, 1.0, 1.0, 1.0)}
    new = jax.jit(update_state, static_argnums=2)(state, observed, RECIPE)
    dense = new["encoder"]["dense"]
    assert float(dense["input_scale"]) == 448.0 / 2.0 and float(dense["kernel_scale"]) == 448.0 / 4.0
    assert float(dense["output_grad_scale"]) == 57344.0 / 8.0  # the gradient's format
    assert dense["input_amax_history"].tolist() == [2.0, 0.0, 0.0, 0.0]
    assert float(new["head"]["input_scale"]) == 448.0 and int(new["encoder"]["count"]) == 3
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)


def test_update_state_keeps_the_containers_it_was_given():
    # Flax Linen hands variables over as FrozenDicts and layers may sit in lists: a rebuilt plain
    # dict would change the train state's pytree structure and retrace (or break) the step.
    from flax.core import FrozenDict

    layer = init_layer_state(RECIPE)
    state = FrozenDict({"blocks": [FrozenDict(layer), layer], "head": FrozenDict({"dense": layer})})
    observed = jax.tree.map(lambda a: jnp.full_like(a, 2.0), state)
    new = update_state(state, observed, RECIPE)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
    assert isinstance(new, FrozenDict) and isinstance(new["blocks"][0], FrozenDict)
    assert float(new["blocks"][0]["input_scale"]) == float(new["head"]["dense"]["input_scale"]) == 224.0


def test_a_non_finite_observed_amax_leaves_that_tensor_unchanged():
    layer = init_layer_state(RECIPE)
    new = update_state({"l": layer}, {"l": _observed(layer, jnp.inf, 2.0, jnp.nan)}, RECIPE)["l"]
    assert float(new["input_scale"]) == 1.0 and not np.any(np.asarray(new["input_amax_history"]))
    assert float(new["output_grad_scale"]) == 1.0
    assert float(new["kernel_scale"]) == 224.0


def test_update_state_over_a_pmap_axis_takes_the_max_amax_so_every_replica_agrees():
    n = jax.local_device_count()
    layer = init_layer_state(RECIPE)
    rep = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), layer)
    seen = jax.tree_util.tree_map(jnp.zeros_like, rep)
    seen["input_scale"] = jnp.arange(1, n + 1, dtype=jnp.float32)
    out = jax.pmap(lambda s, o: update_state(s, o, RECIPE, axis_name="b"), axis_name="b")(rep, seen)
    np.testing.assert_array_equal(out["input_scale"], np.full(n, 448.0 / n, np.float32))


def test_update_state_refuses_a_current_recipe():
    with pytest.raises(TypeError, match="update_state needs a DelayedScaling recipe"):
        update_state({}, {}, CurrentScaling())
