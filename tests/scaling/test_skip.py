"""jaxmp/_scaling/_skip.py: the finite check and the keep-new-or-old selection, unit by unit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._scaling._skip import all_finite, check_flag, keep_if_finite, select_tree


def test_check_flag_accepts_a_boolean_scalar_and_refuses_anything_else():
    assert check_flag(True).dtype == jnp.bool_ and check_flag(np.bool_(False)).shape == ()
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        check_flag(jnp.array([True, False]))
    with pytest.raises(TypeError, match="dtype int32"):
        check_flag(jnp.int32(1))
    with pytest.raises(TypeError, match="dtype float32"):
        check_flag(jnp.float32(1.0))


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64])
def test_all_finite_sees_every_non_finite_value_in_every_inexact_dtype(bad, dtype):
    x = jnp.ones((3, 2), dtype).at[2, 1].set(jnp.asarray(bad).astype(dtype))
    assert not bool(all_finite({"ok": jnp.ones(4), "bad": x}))
    assert bool(all_finite({"ok": jnp.ones(4), "fine": jnp.ones((3, 2), dtype)}))


def test_all_finite_sees_an_imaginary_nan():
    assert not bool(all_finite(jnp.array([1 + 1j, complex(0, float("nan"))], jnp.complex64)))


def test_all_finite_ignores_non_inexact_leaves_and_is_true_on_an_empty_tree():
    tree = {"i": jnp.array([2 ** 31 - 1], jnp.int32), "b": jnp.array([False]), "k": jax.random.key(0),
            "f0": np.zeros((2,), jax.dtypes.float0)}
    out = all_finite(tree)
    assert out.dtype == jnp.bool_ and out.shape == () and bool(out)
    assert bool(all_finite({})) and bool(all_finite(None))


def test_all_finite_works_under_jit_and_vmap():
    f = jax.jit(all_finite)
    assert bool(f([jnp.ones(3)])) and not bool(f([jnp.array([0.0, jnp.nan])]))
    per_row = jax.vmap(all_finite)(jnp.array([[1.0, 2.0], [jnp.inf, 0.0]]))
    assert per_row.tolist() == [True, False]


def test_select_tree_picks_leaf_by_leaf_without_python_branching():
    a = {"s": jnp.float32(1.0), "m": jnp.ones((2, 3), jnp.bfloat16)}
    b = {"s": jnp.float32(2.0), "m": jnp.zeros((2, 3), jnp.bfloat16)}
    f = jax.jit(select_tree)
    out_t, out_f = f(jnp.array(True), a, b), f(jnp.array(False), a, b)
    assert float(out_t["s"]) == 1.0 and float(out_f["s"]) == 2.0
    assert out_t["m"].dtype == jnp.bfloat16 and bool(jnp.all(out_t["m"] == 1)) and bool(jnp.all(out_f["m"] == 0))


def test_select_tree_refuses_mismatched_trees_and_leaves():
    t = jnp.array(True)
    with pytest.raises(ValueError, match="same structure"):
        select_tree(t, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"float32\[2\] vs float32\[3\]"):
        select_tree(t, jnp.ones(2), jnp.ones(3))
    with pytest.raises(ValueError, match=r"float32\[2\] vs bfloat16\[2\]"):
        select_tree(t, jnp.ones(2), jnp.ones(2, jnp.bfloat16))
    with pytest.raises(ValueError, match="boolean scalar"):
        select_tree(jnp.array([True, True]), jnp.ones(2), jnp.ones(2))


def test_keep_if_finite_keeps_the_old_state_bit_for_bit():
    old = {"w": jnp.array([1.0, -0.0, jnp.nan], jnp.float32), "n": jnp.int32(3)}
    new = {"w": jnp.array([5.0, 5.0, 5.0], jnp.float32), "n": jnp.int32(4)}
    kept = keep_if_finite(jnp.array(False), new, old)
    assert np.asarray(kept["w"]).tobytes() == np.asarray(old["w"]).tobytes()  # -0.0 and the NaN payload too
    assert int(kept["n"]) == 3
    assert keep_if_finite(jnp.array(True), new, old)["w"].tolist() == [5.0, 5.0, 5.0]
