"""jaxmp/_cpu_layout.py: the skip's cond operands are the gradients, matrices flattened on CPU, restored exactly."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _cpu_layout


def _leaves():
    return [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.ones(4, jnp.bfloat16),
            jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4), jnp.float32(5.0)]


def test_on_cpu_only_matrices_are_flattened_and_restore_gives_back_the_gradients():
    assert jax.default_backend() == "cpu"
    leaves = _leaves()
    ops = _cpu_layout.cond_operands(leaves)
    assert [o.shape for o in ops] == [(6,), (4,), (2, 3, 4), ()]
    back = _cpu_layout.restore(ops, leaves)
    for b, g in zip(back, leaves):
        assert b.shape == g.shape and b.dtype == g.dtype and np.array_equal(np.asarray(b), np.asarray(g))


def test_inside_a_cond_under_jit_the_branch_sees_the_gradients_unchanged():
    leaves = _leaves()

    def f(pred, leaves):
        ops = _cpu_layout.cond_operands(leaves)
        return jax.lax.cond(pred, lambda o: [x * 2 for x in _cpu_layout.restore(o, leaves)],
                            lambda o: _cpu_layout.restore(o, leaves), ops)

    out = jax.jit(f)(jnp.array(True), leaves)
    assert [o.shape for o in out] == [g.shape for g in leaves]
    np.testing.assert_array_equal(out[0], np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
    # The flattening sits behind an optimization barrier, so XLA cannot move the reshape into the branch.
    text = jax.make_jaxpr(f)(jnp.array(True), leaves).pretty_print()
    assert "optimization_barrier" in text


def test_no_matrices_no_barrier_operands():
    vec = [jnp.ones(3)]
    assert [o.shape for o in _cpu_layout.cond_operands(vec)] == [(3,)]
    assert _cpu_layout.cond_operands([]) == []
