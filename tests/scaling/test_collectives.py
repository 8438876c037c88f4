"""jaxmp/_scaling/_collectives.py: axis-name and reduce-dtype checks, the float32 all-reduce and the model-state mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._scaling._collectives import (all_reduce_gradients, check_axis_name, check_reduce_dtype, mean_model_state,
                               optional_axis_name)

N = jax.local_device_count()


def test_check_axis_name_turns_a_list_into_a_tuple_and_keeps_the_rest():
    assert check_axis_name("batch") == "batch"
    assert check_axis_name(["data", "model"]) == ("data", "model")
    assert check_axis_name(("data",)) == ("data",)
    assert optional_axis_name(None) is None and optional_axis_name(["a"]) == ("a",)


def test_check_axis_name_refuses_none_empty_and_unhashable_names():
    with pytest.raises(ValueError, match="got None"):
        check_axis_name(None)
    with pytest.raises(ValueError, match="empty"):
        check_axis_name([])
    with pytest.raises(ValueError, match="empty"):
        check_axis_name(())
    with pytest.raises(TypeError, match="dict in it is not hashable"):
        check_axis_name({"a": 1})
    with pytest.raises(TypeError, match="list in it is not hashable"):
        check_axis_name(("data", ["model"]))


def test_check_reduce_dtype_accepts_16_bit_and_wider_floats_only():
    assert check_reduce_dtype(None) is None
    assert check_reduce_dtype("bf16") == jnp.bfloat16 and check_reduce_dtype(jnp.float16) == jnp.float16
    assert check_reduce_dtype(np.float32) == np.float32
    with pytest.raises(ValueError, match="reduce_dtype=float8_e4m3fn cannot hold gradients.*448"):
        check_reduce_dtype(jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="reduce_dtype"):
        check_reduce_dtype(jnp.int32)
    with pytest.raises(TypeError):
        check_reduce_dtype(jnp.bool_)


def _pmapped(fn):
    return jax.pmap(fn, axis_name="b")


def test_all_reduce_is_the_mean_in_each_leafs_own_dtype_with_int_leaves_untouched():
    grads = {"f32": jnp.arange(N, dtype=jnp.float32), "bf16": jnp.arange(N, dtype=jnp.bfloat16) * 2,
             "i": jnp.arange(N, dtype=jnp.int32)}
    out = _pmapped(lambda g: all_reduce_gradients(g, "b"))(grads)
    assert out["f32"].dtype == jnp.float32 and out["bf16"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
    np.testing.assert_array_equal(out["f32"], np.full(N, (N - 1) / 2, np.float32))
    np.testing.assert_array_equal(np.asarray(out["bf16"], np.float32), np.full(N, N - 1, np.float32))
    np.testing.assert_array_equal(out["i"], np.arange(N))  # per replica, not averaged


def test_a_float32_reduce_does_not_overflow_where_a_float16_one_does():
    # Each replica's float16 gradient fits (60000 < 65504); their sum does not.
    g = jnp.full((N,), 60000.0, jnp.float16)
    f32 = _pmapped(lambda g: all_reduce_gradients(g, "b"))(g)
    f16 = _pmapped(lambda g: all_reduce_gradients(g, "b", jnp.float16))(g)
    assert f32.dtype == f16.dtype == jnp.float16
    assert np.all(np.asarray(f32, np.float32) == 60000.0)
    assert np.all(np.isinf(np.asarray(f16, np.float32)))  # the loss scale's check then skips the step


def test_all_reduce_gradients_outside_its_axis_says_where_to_call_it():
    with pytest.raises(ValueError, match="axis_name='nope' is not bound"):
        all_reduce_gradients({"w": jnp.ones(2)}, "nope")
    with pytest.raises(ValueError, match="cannot hold gradients"):
        _pmapped(lambda g: all_reduce_gradients(g, "b", jnp.float8_e5m2))(jnp.ones(N))


def test_mean_model_state_keeps_replica_equal_leaves_bitwise_and_averages_the_others():
    # 0.1 is not representable: a float32 mean of N copies of it need not round back to it.
    same = jnp.full((N, 3), 0.1, jnp.float32)
    differ = jnp.arange(N * 2, dtype=jnp.float32).reshape(N, 2)
    count = jnp.arange(N, dtype=jnp.int32)
    out = _pmapped(lambda s: mean_model_state(s, "b"))({"same": same, "differ": differ, "count": count})
    assert np.asarray(out["same"]).tobytes() == np.asarray(same).tobytes()
    np.testing.assert_allclose(out["differ"], np.broadcast_to(np.asarray(differ).mean(0), (N, 2)))
    np.testing.assert_array_equal(out["count"], np.arange(N))
    # A leaf equal on some replicas only is averaged everywhere.
    partly = jnp.zeros((N,), jnp.float32).at[0].set(1.0)
    m = _pmapped(lambda s: mean_model_state(s, "b"))(partly)
    np.testing.assert_allclose(m, np.full(N, 1.0 / N, np.float32))
