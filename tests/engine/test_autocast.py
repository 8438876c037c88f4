"""jaxmp.autocast on the 17 constructs: the dtype of every matmul, transcendental and reduction,
read from the jaxpr of the autocast function including every sub-jaxpr."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
from tests._support._arrays import normal, on_device
from tests._support._op_dtypes import op_dtypes


def _eye(n, scale=1.0):
    return on_device(np.eye(n, dtype=np.float32) * np.float32(scale))


BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
TRANSCENDENTAL = ("exp", "log", "log1p", "expm1", "logistic", "pow", "erf", "rsqrt", "sqrt", "tanh_never")
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "cumsum")


def check_ops(ops, *, matmul=BF16, min_matmuls=1):
    """Every matmul takes ``matmul`` operands; every transcendental and reduction runs in float32."""
    mm = [op for op in ops if op.primitive in ("dot_general", "conv_general_dilated")]
    assert len(mm) >= min_matmuls, [op.primitive for op in ops]
    for op in mm:
        assert set(op.in_dtypes) == {matmul}, op
    for op in ops:
        if op.primitive in TRANSCENDENTAL or op.primitive in REDUCTIONS:
            floats = [d for d in op.in_dtypes + op.out_dtypes if jnp.issubdtype(d, jnp.floating)]
            assert all(d == F32 for d in floats), op
    return mm


def layernorm(x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def mlp_loss(params, x, y):
    h = x
    for w, b in params:
        h = jax.nn.gelu(layernorm(h @ w + b))
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def make_params(seed, sizes=(8, 16, 4)):
    return [(normal(seed + i, (a, b), 1 / np.sqrt(a)), on_device(np.zeros(b, np.float32)))
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


@pytest.fixture(scope="module")
def data():
    # Module-scoped: the arrays are immutable and every test reads the same ones, so the
    # engine's programs and the float32 reference below are traced and compiled once.
    x = normal(1, (16, 8))
    y = on_device(np.random.default_rng(2).integers(0, 4, (16,), dtype=np.int32))
    return make_params(100), x, y


@pytest.fixture(scope="module")
def mlp_ref(data):
    """The float32 loss and gradients of ``mlp_loss`` on ``data``: one compiled program."""
    return jax.jit(jax.value_and_grad(mlp_loss))(*data)


def assert_grads_close(f32_fn, ac_fn, args, rtol=0.05, *, want=None, got=None):
    """The autocast gradients (eager ``jax.grad``, the engine's compiled program) against the
    float32 ones; the float32 reference is jitted (one program, not one per eager op).
    ``want``/``got``: gradients a test already computed, reused rather than computed again."""
    g32 = jax.jit(jax.grad(f32_fn))(*args) if want is None else want
    gac = jax.grad(ac_fn)(*args) if got is None else got
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(gac)):
        assert b.dtype == a.dtype == F32
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * float(np.abs(a).max()) + 1e-6)


# -- 1. plain -------------------------------------------------------------------------------

def test_plain_function_lists_and_promotion(data, mlp_ref, strict_promotion):
    params, x, y = data
    f = jaxmp.autocast(mlp_loss, "O1-bf16")
    ops = op_dtypes(f, params, x, y)
    check_ops(ops, min_matmuls=2)
    # the bias add after the bf16 matmul feeds a layer norm's mean: O1 keeps it float32 (the
    # float32 bias meets a half value where float32 is needed, as torch.autocast promotes)...
    first_add = next(op for op in ops if op.primitive == "add")
    assert first_add.out_dtypes == (F32,)
    # ...and O2, Apex's almost-pure-half trade, narrows the float32 bias to bf16.
    o2 = op_dtypes(jaxmp.autocast(mlp_loss, "O2-bf16"), params, x, y)
    assert next(op for op in o2 if op.primitive == "add").out_dtypes == (BF16,)
    # layer-norm centring x - mean(x) runs in float32 (a float32-list result promotes)
    subs = [op for op in ops if op.primitive == "sub"]
    assert subs and all(op.out_dtypes == (F32,) for op in subs[:1])
    assert f(params, x, y).dtype == F32
    assert_grads_close(mlp_loss, f, (params, x, y), want=mlp_ref[1])


def test_fp32_loss_error_close_to_float32(data, mlp_ref):
    params, x, y = data
    ref = mlp_ref[0]
    out = jaxmp.autocast(mlp_loss, "O1-bf16")(params, x, y)
    assert abs(float(out) - float(ref)) < 2e-2 * abs(float(ref))


# -- 2-8. control flow and transformations inside the function -------------------------------

def block(w, h):
    return jnp.tanh(layernorm(h @ w))


def test_scan_body(data):
    _, x, _ = data
    ws = normal(3, (3, 8, 8), 1 / 3)

    def f(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (block(w, h), None), x, ws)
        return jnp.sum(h ** 2)

    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, ws, x)
    assert "scan" in [op.primitive for op in ops]
    check_ops(ops)
    assert_grads_close(f, ac, (ws, x))


def test_remat_body(data):
    _, x, _ = data
    w = _eye(8)
    f = lambda w, x: jnp.sum(jax.checkpoint(block)(w, x))
    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, w, x)
    assert "remat2" in [op.primitive for op in ops]
    check_ops(ops)
    assert_grads_close(f, ac, (w, x))


def test_a_named_residual_is_saved_in_the_dtype_it_was_computed_in():
    # checkpoint_name is an identity: the bf16 matmul output it names is saved as bf16 under a
    # names policy, as dots_saveable saves it, not widened to float32 (twice the memory).
    import contextlib
    import io

    from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

    def block(w, x):
        return jnp.tanh(checkpoint_name(x @ w, "h"))

    w, x = _eye(8, 0.3), normal(3, (4, 8))
    for policy in (jax.checkpoint_policies.save_only_these_names("h"), jax.checkpoint_policies.dots_saveable):
        f = lambda w, x, policy=policy: jnp.sum(jax.checkpoint(block, policy=policy)(w, x))  # noqa: E731
        ac = jaxmp.autocast(f, "O1-bf16")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(ac, w, x)
        saved = [line.split()[0] for line in out.getvalue().splitlines() if "from the argument" not in line]
        assert saved == ["bf16[4,8]"], out.getvalue()
        assert_grads_close(f, ac, (w, x))


@jax.custom_vjp
def scaled_tanh(x, w):
    return jnp.tanh(x @ w)


def _st_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _st_bwd(res, g):
    x, w, y = res
    gz = g * (1 - y ** 2)
    return gz @ w.T, x.T @ gz


scaled_tanh.defvjp(_st_fwd, _st_bwd)


def test_custom_vjp_forward_and_backward_under_rules(data):
    _, x, _ = data
    w = normal(4, (8, 8), 1 / 3)
    f = lambda x, w: jnp.sum(jnp.exp(scaled_tanh(x, w)))
    ac = jaxmp.autocast(f, "O1-bf16")
    check_ops(op_dtypes(ac, x, w))
    # the backward rule's matmuls run in bf16 too, and its outputs come back in the inputs' dtypes
    grad_ops = op_dtypes(jax.grad(ac, argnums=(0, 1)), x, w)
    assert len(check_ops(grad_ops)) >= 3
    assert_grads_close(f, ac, (x, w))


@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


softplus.defjvp(lambda p, t: (softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


def test_custom_jvp(data):
    _, x, _ = data
    w = _eye(8)
    f = lambda w, x: jnp.sum(softplus(x @ w))
    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, w, x)
    assert "custom_jvp_call" in [op.primitive for op in ops]
    check_ops(ops)
    check_ops(op_dtypes(jax.grad(ac), w, x))
    assert_grads_close(f, ac, (w, x))


def test_while_loop(data):
    _, x, _ = data
    w = _eye(8, 0.5)

    def f(w, x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (block(w, c[0]), c[1] + 1), (x, 0))[0].sum()

    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, w, x)
    assert "while" in [op.primitive for op in ops]
    check_ops(ops)
    got = ac(w, x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, jax.jit(f)(w, x), rtol=0.05)


def test_cond_and_switch(data):
    _, x, _ = data
    w = _eye(8)
    f = lambda w, x, p: jax.lax.cond(p, lambda h: jnp.exp(h @ w).sum(), lambda h: jnp.log1p(jnp.abs(h @ w)).sum(), x)
    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, w, x, True)
    assert "cond" in [op.primitive for op in ops]
    check_ops(ops, min_matmuls=2)
    np.testing.assert_allclose(ac(w, x, False), jax.jit(f, static_argnums=2)(w, x, False), rtol=0.05)


def test_nested_jit(data, mlp_ref):
    params, x, y = data
    inner = jax.jit(mlp_loss)
    ac = jaxmp.autocast(lambda p, x, y: inner(p, x, y), "O1-bf16")
    check_ops(op_dtypes(ac, params, x, y), min_matmuls=2)
    assert_grads_close(mlp_loss, ac, (params, x, y), want=mlp_ref[1])


def test_vmap_around_and_grad_inside(data):
    params, x, y = data
    ac = jaxmp.autocast(mlp_loss, "O1-bf16")
    per_example = jax.vmap(ac, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    assert per_example.shape == (16,) and per_example.dtype == F32
    check_ops(op_dtypes(jax.vmap(ac, in_axes=(None, 0, 0)), params, x[:, None], y[:, None]), min_matmuls=2)
    grad_inside = jaxmp.autocast(jax.grad(mlp_loss), "O1-bf16")
    ops = op_dtypes(grad_inside, params, x, y)
    check_ops(ops, min_matmuls=4)  # forward and backward matmuls
    g = jax.eval_shape(grad_inside, params, x, y)  # dtypes only: traced, not run
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(g))


def test_jit_around_and_inside_agree(data):
    params, x, y = data
    ac = jaxmp.autocast(mlp_loss, "O1-bf16")
    a = jax.jit(ac)(params, x, y)
    b = jaxmp.autocast(jax.jit(mlp_loss), "O1-bf16")(params, x, y)
    c = ac(params, x, y)  # eager call: a cached compiled program
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6)


def test_scanned_remat_block_with_custom_vjp_activation():
    ws = normal(5, (4, 8, 8), 1 / 3)
    x = normal(6, (16, 8))

    def layer(h, w):
        return h + scaled_tanh(layernorm(h), w), None

    def f(ws, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
        return jnp.mean(h ** 2)

    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(jax.grad(ac), ws, x)
    assert {"scan", "remat2"} <= {op.primitive for op in ops}
    check_ops(ops, min_matmuls=3)
    g = jax.grad(ac)(ws, x)
    assert g.dtype == F32  # the float32 weights' gradient accumulates over the scan in float32
    assert_grads_close(f, ac, (ws, x), got=g)


# -- shard_map ---------------------------------------------------------------------------------

def _mesh():
    return jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])


def _sharded_loss(w, x):
    return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "d")


def test_shard_map_autocast_outside():
    mesh = _mesh()
    w, x = _eye(8, 0.3), normal(7, (16, 8))
    f = jax.shard_map(_sharded_loss, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    ac = jaxmp.autocast(f, "O1-bf16")
    ops = op_dtypes(ac, w, x)
    assert "shard_map" in [op.primitive for op in ops]
    check_ops(ops)
    grad_ops = op_dtypes(jax.grad(ac), w, x)
    # the cotangent all-reduce of the float32 replicated weight runs in float32
    psums = [op for op in grad_ops if op.primitive.startswith("psum")]
    assert psums and all(d == F32 for op in psums for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating))
    assert_grads_close(f, ac, (w, x))


def test_shard_map_autocast_inside():
    mesh = _mesh()
    w, x = _eye(8, 0.3), normal(7, (16, 8))
    f = jax.shard_map(jaxmp.autocast(_sharded_loss, "O1-bf16"), mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    ref = jax.shard_map(_sharded_loss, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    check_ops(op_dtypes(f, w, x))
    # f is a shard_map: the autocast body is traced inside it whether the grad runs eagerly or
    # jitted, so one jitted program checks the same engine path.
    assert_grads_close(ref, f, (w, x), got=jax.jit(jax.grad(f))(w, x))


def test_one_autocast_function_serves_eager_and_shard_map_calls_in_either_order():
    # A program traced inside shard_map varies over the mesh axis ({V:d} in its types), and one
    # traced for an explicitly sharded input bakes that sharding into its ops: the program cache
    # must tell them apart from a plain call of the same shapes.
    mesh = _mesh()
    w, x = _eye(8, 0.3), normal(7, (16, 8))
    f = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    for eager_first in (True, False):
        layer = jaxmp.autocast(f, "O1-bf16")
        step = jax.jit(jax.shard_map(lambda x, w: layer(x, w), mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
        calls = [lambda: layer(x[:4], w), lambda: jax.jit(layer)(x[:4], w), lambda: step(x, w)]
        outs = [c() for c in (calls if eager_first else calls[::-1])]
        np.testing.assert_array_equal(outs[0] if eager_first else outs[2], layer(x[:4], w))
        np.testing.assert_allclose(step(x, w), jnp.tanh(x @ w), atol=2e-2)
        assert len(layer._programs) == 2  # the per-shard program and the plain one, each traced once


def test_a_program_is_not_reused_for_an_input_of_another_sharding():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    f = lambda x: x * 2 + jnp.zeros_like(x)  # noqa: E731 - zeros_like's broadcast carries a sharding
    ac = jaxmp.autocast(f, "O1-bf16")
    with jax.set_mesh(mesh):
        x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
        layouts = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
                   for spec in (P("d", None), P(), P(None, "d"))]
        for v in layouts:
            want = jax.jit(f)(v)   # the plain function: one program per layout, not one per eager op
            for call in (ac, jax.jit(ac)):
                out = call(v)
                assert out.sharding.spec == want.sharding.spec
                np.testing.assert_array_equal(out, want)


def test_pmap_around_autocast():
    n = 4
    w = _eye(8, 0.3)
    x = normal(8, (n, 4, 8))
    step = jax.pmap(jax.grad(jaxmp.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), "O1-bf16")),
                    in_axes=(None, 0), devices=jax.devices()[:n])
    g = step(w, x)
    assert g.dtype == F32 and g.shape == (n, 8, 8)


def test_autocast_around_pmap():
    f = jax.pmap(lambda w, x: jnp.tanh(x @ w).sum(), in_axes=(None, 0), devices=jax.devices()[:2])
    ac = jaxmp.autocast(f, "O1-bf16")
    w, x = _eye(3), on_device(np.ones((2, 4, 3), np.float32))
    check_ops(op_dtypes(ac, w, x))
    np.testing.assert_allclose(ac(w, x), f(w, x), rtol=0.02)


def test_unknown_higher_order_primitive_is_named():
    from jaxmp._jaxpr import Primitive

    hop = Primitive("my_higher_order")
    hop.def_abstract_eval(lambda x, *, body: x)
    body = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(NotImplementedError, match="my_higher_order"):
        jaxmp.autocast(lambda x: hop.bind(x @ x, body=body), "O1-bf16")(jnp.ones((2, 2)))


def test_scan_and_remat_around_an_autocast_body():
    ws = normal(9, (3, 8, 8), 1 / 3)
    x = normal(10, (16, 8))
    body = jaxmp.autocast(lambda h, w: block(w, h), "O1-bf16")

    def f(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(body)(h, w), None), x, ws)
        return jnp.mean(h ** 2)

    ref = lambda ws, x: jnp.mean(jax.lax.scan(lambda h, w: (block(w, h), None), x, ws)[0] ** 2)
    check_ops(op_dtypes(jax.grad(f), ws, x), min_matmuls=3)
    # f is no autocast function: its body is traced inside the scan whether the grad runs eagerly
    # or jitted, so one jitted program checks the same engine path (not one compile per eager op).
    assert_grads_close(ref, f, (ws, x), got=jax.jit(jax.grad(f))(ws, x))


def test_float0_and_integer_inputs_pass_through_grad():
    f = jaxmp.autocast(lambda w, n: jnp.sum(jnp.tanh(w @ w) * n.astype(w.dtype)), "O1-bf16")
    gw, gn = jax.grad(f, argnums=(0, 1), allow_int=True)(_eye(3), on_device(np.int32(2)))
    assert gw.dtype == F32 and gn.dtype == jax.dtypes.float0


def _layer_norm_twice(w, x):
    """A layer norm written as most models write it: ``h - mu`` appears twice."""
    h = x @ w
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
    return jnp.sum(jnp.tanh((h - mu) * jax.lax.rsqrt(var + 1e-5)))


def _layer_norm_once(w, x):
    h = x @ w
    mu = jnp.mean(h, -1, keepdims=True)
    d = h - mu
    var = jnp.mean(jnp.square(d), -1, keepdims=True)
    return jnp.sum(jnp.tanh(d * jax.lax.rsqrt(var + 1e-5)))


def _count(closed, name):
    found = []
    _collect(closed.jaxpr, name, found)
    return len(found)


def test_a_repeated_computation_is_emitted_once_and_differentiated_once():
    w = normal(0, (8, 8))
    x = normal(1, (4, 8))
    twice, once = (jaxmp.autocast(f, "O1-bf16") for f in (_layer_norm_twice, _layer_norm_once))
    assert _count(jax.make_jaxpr(_layer_norm_twice)(w, x), "sub") == 2  # the model does write it twice
    assert _count(jax.make_jaxpr(twice)(w, x), "sub") == 1
    # The gradient program is the once-written model's, cast for cast and bit for bit.
    for fn in (jax.grad, jax.value_and_grad):
        j_twice, j_once = (jax.make_jaxpr(fn(f, argnums=(0, 1)))(w, x) for f in (twice, once))
        assert _count(j_twice, "convert_element_type") == _count(j_once, "convert_element_type")
    # Both gradients of each model from one compiled program (one compile per model, not two).
    both = lambda f: jax.jit(lambda w, x: (jax.grad(f, argnums=(0, 1))(w, x),  # noqa: E731
                                            jax.value_and_grad(f, argnums=(0, 1))(w, x)))
    for a, b in zip(jax.tree_util.tree_leaves(both(twice)(w, x)), jax.tree_util.tree_leaves(both(once)(w, x))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_equal_ops_under_different_rules_are_not_merged():
    w = _eye(4, 1.001)
    x = on_device(np.ones((2, 4), np.float32))

    def f(w, x):
        return x @ w, jaxmp.autocast_region("float32")(jnp.matmul)(x, w)

    closed = jax.make_jaxpr(jaxmp.autocast(f, "O1-bf16"))(w, x)
    dots = []
    _collect(closed.jaxpr, "dot_general", dots)
    assert sorted(str(e.invars[0].aval.dtype) for e in dots) == ["bfloat16", "float32"]


def _layers(ws, x):
    for w in ws:
        h = x @ w
        mu = jnp.mean(h, -1, keepdims=True)
        x = jnp.tanh((h - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(h - mu), -1, keepdims=True) + 1e-5))
    return jnp.sum(x)


def _staged_functions_made(fn, *args) -> int:
    from jaxmp.engine import _internals as internals

    before = internals._staged_primitive.cache_info().currsize
    jax.jit(fn).trace(*args)
    return internals._staged_primitive.cache_info().currsize - before


def test_under_jit_of_grad_a_layers_ops_are_staged_once_whatever_the_depth():
    # A width no other test uses: the staged functions are a per-process cache.
    x = normal(0, (3, 13))
    ws = [normal(i, (13, 13), 1 / 4) for i in range(8)]
    ac = jaxmp.autocast(_layers, "O1-bf16")
    made = _staged_functions_made(jax.grad(ac), ws[:2], x)
    assert made > 0  # the layer's repeated ops are bound through cached one-op jits
    assert _staged_functions_made(jax.grad(ac), ws, x) == 0  # eight layers: the same ops again
    assert _staged_functions_made(jax.vmap(jax.grad(ac), (None, 0)), ws, x[None]) == 0
    # A plain jit gains nothing from it and pays nothing for it: its ops are bound directly.
    x11 = on_device(np.ones((3, 11), np.float32))
    assert _staged_functions_made(ac, [_eye(11)] * 4, x11) == 0
    # Staging changes how the program is traced, not what it computes: the jitted gradient is
    # the eager one's (which differentiates the engine's program as one jitted call).
    for a, b in zip(jax.jit(jax.grad(ac))(ws, x), jax.grad(ac)(ws, x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16", "O1-fp16", "O3-bf16"])
def test_an_eager_call_and_a_jitted_one_agree_bit_for_bit(policy):
    # The policy's input casts (O2's weights) and output casts belong to the engine's one
    # compiled program: run apart from it, a cast is rounded where XLA, compiling the whole
    # program under the caller's jit, may keep the wider value (excess precision), and the two
    # calls differ by half-precision rounding.
    w = normal(0, (8, 8))
    x = normal(1, (4, 8))
    ac = jaxmp.autocast(lambda w, x: (x @ w) * 3.0 + 1.0, policy)
    np.testing.assert_array_equal(ac(w, x), jax.jit(ac)(w, x))
    loss = lambda w: jnp.sum(ac(w, x).astype(F32) ** 2)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(loss)(w), jax.jit(jax.grad(loss))(w))


def test_an_eager_grad_runs_the_engines_compiled_program_and_reuses_it(monkeypatch):
    from jaxmp.engine._interpreter import Interpreter

    runs = []
    run = Interpreter.run
    monkeypatch.setattr(Interpreter, "run", lambda self, *a, **k: runs.append(1) or run(self, *a, **k))
    ws = [_eye(6, 0.5)] * 3
    x = on_device(np.ones((2, 6), np.float32))
    g = jax.grad(jaxmp.autocast(_layers, "O1-bf16"))
    first = g(ws, x)
    traced = len(runs)
    assert traced >= 1
    again = g(ws, x)  # neither re-interpreted nor run op by op: the cached jitted program
    assert len(runs) == traced
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _collect(jaxpr, name, found):
    from jaxmp import _jaxpr

    found.extend(e.eqn for e in _jaxpr.walk(jaxpr) if e.primitive == name)
