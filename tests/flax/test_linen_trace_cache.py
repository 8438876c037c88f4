"""The Linen door traces a module once per input signature, as ``jaxmp.autocast`` does.

A second ``apply`` with the same shapes and dtypes (eager or inside ``jit``) reuses the trace;
a new shape, another ``mutable`` or a Flax method interceptor around the call traces again.
Traces are counted by the module's own ``__call__``, which runs only when the module is traced.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tests._support._op_dtypes import assert_matmuls_in, op_dtypes

import jaxmp
import jaxmp.flax


CALLS: list = []  # the input shape of each trace of Counted


class Counted(nn.Module):
    """Dense + LayerNorm whose ``__call__`` counts how often it is traced."""

    tag: str  # equal wrappers share traces: each test builds its own module

    @nn.compact
    def __call__(self, x):
        CALLS.append(x.shape)
        return nn.LayerNorm()(nn.Dense(4)(x))


def _setup(tag: str):
    calls = CALLS
    model = jaxmp.flax.mixed_precision(Counted(tag), "O1-bf16")
    x = np.ones((2, 3), np.float32)
    variables = model.init(jax.random.key(0), x)
    calls.clear()
    return model, variables, x, calls


def test_a_second_apply_with_the_same_shapes_does_not_trace_again():
    model, variables, x, calls = _setup("second apply")
    first = model.apply(variables, x)
    assert len(calls) == 1
    second = model.apply(variables, x)
    assert len(calls) == 1  # the cached trace ran
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert first.dtype == jnp.float32
    model.apply(variables, np.ones((5, 3), np.float32))  # a new input signature: traced
    assert calls[-1] == (5, 3) and len(calls) == 2


def test_jit_traces_reuse_the_door_trace_and_keep_its_dtypes():
    model, variables, x, calls = _setup("jit")
    eager = model.apply(variables, x)
    loss = lambda p: model.apply({"params": p}, x).sum()  # noqa: E731
    ops = op_dtypes(jax.grad(loss), variables["params"])
    grads = jax.jit(jax.grad(loss))(variables["params"])
    assert len(calls) == 1  # eager apply traced; make_jaxpr and jit reused its trace
    assert_matmuls_in(ops, jnp.bfloat16)  # the reused trace keeps the door's dtype plan
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda v: model.apply(v, x))(variables)), np.asarray(eager),
                               rtol=1e-6)


def test_a_method_interceptor_around_apply_sees_every_call():
    model, variables, x, calls = _setup("interceptor")
    model.apply(variables, x)
    seen = []

    def interceptor(next_fun, args, kwargs, context):
        seen.append(type(context.module).__name__)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        model.apply(variables, x)
        model.apply(variables, x)
    assert len(calls) == 3 and seen.count("Counted") == 2  # traced each time, as module.apply is
