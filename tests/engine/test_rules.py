"""jaxmp.autocast: the rules as data, regions, half-input kernels, caching, presets, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp.engine import _attention as routed
from tests._support._arrays import normal, on_device
from tests._support._op_dtypes import op_dtypes
from tests.engine.test_autocast import BF16, F32, check_ops


F16 = np.dtype(jnp.float16)


def dense(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


@pytest.fixture
def params():
    return {"w": on_device(np.eye(4) * 0.5), "b": on_device(np.zeros(4))}


def test_outputs_in_output_dtype_dicts_and_tuples(params):
    f = jaxmp.autocast(lambda p, x: {"y": dense(p, x), "pair": (x @ p["w"], jnp.int32(3))}, "O1-bf16")
    out = f(params, on_device(np.ones((2, 4))))
    assert out["y"].dtype == F32 and out["pair"][0].dtype == F32 and out["pair"][1].dtype == jnp.int32
    out3 = jaxmp.autocast(lambda p, x: {"y": dense(p, x)}, "O3-bf16")(params, on_device(np.ones((2, 4))))
    assert out3["y"].dtype == BF16


def test_presets_o0_identity_o2_casts_entry_o3_pure_half(params):
    fn = lambda p, x: jnp.exp(x @ p["w"] + p["b"]).sum()
    x = on_device(np.ones((2, 4)))
    ops0 = op_dtypes(jaxmp.autocast(fn, "O0"), params, x)
    assert ops0 and all(d == F32 for op in ops0 for d in op.in_dtypes)
    ops2 = op_dtypes(jaxmp.autocast(fn, "O2-bf16"), params, x)
    assert [op.out_dtypes for op in ops2 if op.primitive == "add"] == [(BF16,)]
    check_ops(ops2)
    ops3 = op_dtypes(jaxmp.autocast(fn, "O3-bf16"), params, x)
    assert all(op.out_dtypes == (BF16,) for op in ops3 if op.primitive in ("exp", "reduce_sum"))
    # the bare preset takes the platform's half dtype (float16 on CPU), as get_policy does
    ops1 = op_dtypes(jaxmp.autocast(fn, "O1"), params, x)
    assert jaxmp.get_policy("O1").compute_dtype == F16
    check_ops(ops1, matmul=F16)


def test_policy_objects_and_jmp_strings(params):
    x = on_device(np.ones((2, 4)))
    for policy in (jaxmp.get_policy("p=f32,c=bf16,o=f32"), "params=float32,compute=bfloat16,output=float32"):
        check_ops(op_dtypes(jaxmp.autocast(dense, policy), params, x))


def test_promotion_switch_and_matmul_output_switch(params):
    x = on_device(np.ones((2, 4)))
    wide = jaxmp.AutocastRules(promote="widest")
    ops = op_dtypes(jaxmp.autocast(dense, "O1-bf16", rules=wide), params, x)
    assert [op.out_dtypes for op in ops if op.primitive == "add"] == [(F32,)]
    f32_out = jaxmp.AutocastRules(matmul_output="float32")
    mm = [op for op in op_dtypes(jaxmp.autocast(dense, "O1-bf16", rules=f32_out), params, x) if op.primitive == "dot_general"]
    assert mm[0].in_dtypes == (BF16, BF16) and mm[0].out_dtypes == (F32,)


def test_user_choices_in_the_trace_are_kept():
    q = on_device(np.ones((2, 8)))

    def f(q):
        logits = jnp.einsum("ij,kj->ik", q.astype(jnp.float16), q.astype(jnp.float16), preferred_element_type=jnp.float32)
        return logits.sum()

    ops = op_dtypes(jaxmp.autocast(f, "O1-bf16"), q)
    mm = [op for op in ops if op.primitive == "dot_general"]
    assert mm[0].in_dtypes == (F16, F16) and mm[0].out_dtypes == (F32,)


def test_rules_are_editable_data_and_scope_rules(params):
    rules = jaxmp.AutocastRules().with_float32("tanh").with_half("exp").with_follow("reduce_max")
    assert "tanh" in rules.float32_ops and "exp" in rules.half_ops and "reduce_max" not in rules.float32_ops
    hash(rules)
    ops = op_dtypes(jaxmp.autocast(dense, "O1-bf16", rules=rules), params, on_device(np.ones((2, 4))))
    assert [op.in_dtypes for op in ops if op.primitive == "tanh"] == [(F32,)]

    def scoped(p, x):
        with jax.named_scope("head"):
            return (x @ p["w"]).sum()

    ops = op_dtypes(jaxmp.autocast(scoped, "O1-bf16", rules=jaxmp.AutocastRules().with_scope("hea*", "float32")),
                    params, on_device(np.ones((2, 4))))
    check_ops(ops, matmul=F32)


def test_region_decorators_and_nested_autocast(params):
    @jaxmp.float32_region
    def head(p, x):
        return x @ p["w"]

    f = jaxmp.autocast(lambda p, x: (head(p, x) + x @ p["w"]).sum(), "O1-bf16")
    mm = [op for op in op_dtypes(f, params, on_device(np.ones((2, 4)))) if op.primitive == "dot_general"]
    assert sorted(str(op.in_dtypes[0]) for op in mm) == ["bfloat16", "float32"]
    # an O0 autocast nested in an O1 one wins inside its region
    inner = jaxmp.autocast(lambda p, x: x @ p["w"], "O0")
    g = jaxmp.autocast(lambda p, x: (inner(p, x) + x @ p["w"]).sum(), "O1-bf16")
    mm = [op for op in op_dtypes(g, params, on_device(np.ones((2, 4)))) if op.primitive == "dot_general"]
    assert sorted(str(op.in_dtypes[0]) for op in mm) == ["bfloat16", "float32"]
    half = jaxmp.autocast(jaxmp.autocast_region("half")(lambda x: jnp.exp(x).sum()), "O1-bf16")
    assert [op.in_dtypes for op in op_dtypes(half, on_device(np.ones(3))) if op.primitive == "exp"] == [(BF16,)]


def test_half_only_kernel_runs_trains_and_jit_cache_is_keyed_on_context():
    traced_dtypes = []

    @jax.jit
    @jaxmp.half_inputs
    def kernel(x, w):
        traced_dtypes.append(x.dtype)
        if x.dtype == jnp.float32:
            if jaxmp.engine._config.current() is not None:
                raise NotImplementedError("kernel refuses float32 inside autocast")
        return x @ w

    def loss(w, x):
        return jnp.mean(kernel(x, w).astype(jnp.float32) ** 2)

    w, x = on_device(np.eye(4) * 2.0), on_device(np.ones((3, 4)))
    ac = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, "O1-bf16")))
    for _ in range(20):
        l, g = ac(w, x)
        assert g.dtype == F32
        w = w - 0.05 * g
    assert float(l) < 1.0
    assert BF16 in traced_dtypes
    # the same jitted kernel called outside autocast afterwards runs in float32
    assert kernel(on_device(np.ones((3, 4))), on_device(np.eye(4))).dtype == F32


def test_dot_product_attention_routed_with_half_inputs():
    q = normal(0, (2, 8, 2, 16))
    f = lambda q: jax.nn.dot_product_attention(q, q, q)
    ac = jaxmp.autocast(f, "O1-bf16")
    out = ac(q)
    assert routed.last_choice["implementation"] == "xla"  # CPU: the XLA fallback
    want = jax.jit(f)(q)   # float32, outside autocast: one program, not one per eager op
    np.testing.assert_allclose(out, want, atol=0.05)
    ops = op_dtypes(ac, q)
    mm = [op for op in ops if op.primitive == "dot_general"]
    assert all(op.in_dtypes == (BF16, BF16) for op in mm)
    assert mm[0].out_dtypes == (F32,)  # logits accumulate in float32 for the softmax
    assert all(op.in_dtypes == (F32,) for op in ops if op.primitive == "exp")
    # Installed once and left in place (swapping per trace is not thread-safe); outside autocast
    # it is JAX's own function: float32 in, float32 out, the same numbers.
    assert want.dtype == F32
    np.testing.assert_array_equal(want, jax.jit(routed._ORIGINAL)(q, q, q))


def test_prng_keys_ints_bools_and_static_leaves_pass_through():
    def f(x, old_key, new_key, n, flag, scale, act):
        noise = jax.random.normal(new_key, x.shape) + jax.random.normal(old_key, x.shape)
        return act(x @ x.T * scale + jnp.asarray(n, x.dtype)) + noise.sum() * jnp.asarray(flag, x.dtype)

    ac = jaxmp.autocast(f, "O1-bf16")
    x = on_device(np.ones((2, 2)))
    out = ac(x, jax.random.PRNGKey(0), jax.random.key(1), jnp.int32(2), jnp.bool_(True), 0.5, jnp.tanh)
    assert out.dtype == F32
    # the gradient's dtype only: traced (jax.eval_shape), not compiled and run
    g = jax.eval_shape(jax.grad(lambda x: ac(x, jax.random.PRNGKey(0), jax.random.key(1), 2, True, 0.5, jnp.tanh).sum()), x)
    assert g.dtype == F32


def test_no_floating_inputs_and_complex_values():
    def f(n):
        x = jnp.arange(4, dtype=jnp.float32).reshape(2, 2) * n.astype(jnp.float32)
        return jnp.exp(x @ x)

    ops = op_dtypes(jaxmp.autocast(f, "O1-bf16"), jnp.int32(2))
    check_ops(ops)
    c = jaxmp.autocast(lambda z, w: (z @ z) * w.sum().astype(z.dtype), "O1-bf16")
    z = on_device(np.ones((2, 2), jnp.complex64))
    ops = op_dtypes(c, z, on_device(np.ones(2)))
    assert [op.in_dtypes for op in ops if op.primitive == "dot_general"] == [(np.dtype(jnp.complex64),) * 2]


def test_each_value_cast_once_per_trace(params):
    def f(p, x):
        return (x @ p["w"]).sum() + jnp.dot(x, p["w"], precision="highest").max() + (x @ p["w"]).min()

    ops = op_dtypes(jaxmp.autocast(f, "O1-bf16"), params, on_device(np.ones((2, 4))))
    converts = [op for op in ops if op.primitive == "convert_element_type" and op.in_dtypes == (F32,)
                and op.out_dtypes == (BF16,)]
    # x and w are cast once each, however many matmuls read them
    assert len(converts) == 2


def test_eager_calls_reuse_the_traced_program(params):
    calls = []

    def f(p, x):
        calls.append(1)
        return dense(p, x)

    ac = jaxmp.autocast(f, "O1-bf16")
    for _ in range(3):
        ac(params, on_device(np.ones((2, 4))))
    assert len(calls) == 1
    ac(params, on_device(np.ones((3, 4))))
    assert len(calls) == 2


@pytest.mark.parametrize("bad, exc, match", [
    (dict(fn=3), TypeError, "callable"),
    (dict(policy="O7"), ValueError, "O7"),
    (dict(rules="fast"), TypeError, "AutocastRules"),
])
def test_bad_arguments(bad, exc, match):
    kwargs = dict(fn=jnp.sin, policy="O1-bf16")
    kwargs.update(bad)
    fn = kwargs.pop("fn")
    with pytest.raises(exc, match=match):
        jaxmp.autocast(fn, **kwargs)


def test_bad_rules():
    with pytest.raises(ValueError, match="not_an_op"):
        jaxmp.AutocastRules().with_float32("not_an_op")
    with pytest.raises(TypeError, match="floating"):
        jaxmp.AutocastRules().with_scope("x", jnp.int32)
    with pytest.raises(TypeError, match="floating"):
        jaxmp.autocast_region("int8")
    with pytest.raises(ValueError, match="promote"):
        jaxmp.AutocastRules(promote="random")
    with pytest.raises(TypeError, match="module class"):
        jaxmp.AutocastRules().with_class("LayerNorm", "float32")


def test_no_printing_at_trace_time(capsys, params):
    jax.jit(jaxmp.autocast(dense, "O1-bf16"))(params, on_device(np.ones((2, 4))))
    assert capsys.readouterr().out == ""


def test_precision_report_explains_each_rule(params):
    f = jax.jit(jaxmp.autocast(lambda p, x: jax.nn.log_softmax(dense(p, x)).sum(), "O1-bf16"))
    rep = jaxmp.precision_report(f, params, on_device(np.ones((8, 4))), policy="O1-bf16")
    by_prim = {}
    for op in rep.decisions:
        by_prim.setdefault(op.primitive, set()).add((op.rule, op.out_dtypes))
    assert by_prim["dot_general"] == {("half list", ("bf16",))}
    assert by_prim["exp"] == {("float32 list", ("f32",))}
    assert ("follow", ("f32",)) in by_prim["add"]  # the bias add feeds the softmax: float32 at O1
    text = rep.table()
    assert "Autocast decisions" in text and "half list" in text
    assert "jaxmp[keep]:autocast(" not in text  # autocast's own wrapper scope is not a place in the model
    assert rep.to_dict()["autocast_decisions"][0]["rule"]
    # the explain scopes exist only while the report traces: a normal trace has none
    assert not jaxmp.diagnostics._autocast_ops.autocast_ops(jax.make_jaxpr(f)(params, on_device(np.ones((8, 4)))))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("preset, param_dtype, masters", [("O1-fp16", F32, False), ("O2-fp16", F16, True)])
def test_loss_scaling_fp16_dynamic_around_an_autocast_loss(preset, param_dtype, masters):
    x = normal(0, (64, 4))
    y = on_device(np.asarray(x) @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32))   # numpy: no eager op compiled
    params = {"w": on_device(np.zeros((4, 1), param_dtype)), "b": on_device(np.zeros(1, param_dtype))}  # O2: half params
    tx = jaxmp.loss_scaling(optax.adam(0.05), loss_scale=jaxmp.DynamicLossScale(2.0 ** 15), master_weights=masters)
    opt_state = tx.init(params)
    loss = jaxmp.autocast(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2), preset)

    @jax.jit
    def step(params, opt_state):
        l, g = jaxmp.value_and_grad(loss, opt_state)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return jaxmp.apply_updates(params, u, opt_state), opt_state, l

    for _ in range(300):
        params, opt_state, l = step(params, opt_state)
    assert float(l) < 0.05 and params["w"].dtype == param_dtype
    if masters:
        assert jaxmp.master_params(opt_state)["w"].dtype == F32


# -- issue 37 -------------------------------------------------------------------------------------

@pytest.mark.standard_promotion(reason="the user code of the issue: a float32 array times 1j, complex @ float32")
def test_a_complex_matmul_keeps_its_real_operand_float32():
    """Item 2: there is no half complex type, so an op with a complex operand runs as traced; at
    0a46f1b the real ``x`` of ``B @ x`` was read in bf16 (``('complex64', 'bf16')``), off by 2e-3."""
    def f(w, x):
        b = w[..., 0] + 1j * w[..., 1]
        return (b @ x).real.sum()

    w = normal(0, (8, 16, 2))
    x = normal(1, (16, 4))
    ac = jaxmp.autocast(f, "O1-bf16")
    mm = [op for op in op_dtypes(ac, w, x) if op.primitive == "dot_general"]
    assert mm and all(BF16 not in op.in_dtypes for op in mm), mm
    np.testing.assert_allclose(ac(w, x), jax.jit(f)(w, x), rtol=1e-5)   # reference: one program


def test_a_preferred_element_type_that_jax_promotion_wrote_is_not_a_choice():
    """Item 21: ``preferred_element_type`` equal to the promoted operand type (float32 for a bf16
    weight meeting a float32 scan state, as ``jnp.einsum`` writes it) is JAX's promotion: the op
    returns the compute dtype. One other than the promoted type (float32 from two half operands,
    or narrower than the operands) is the program's choice and is kept."""
    dims = (((1,), (0,)), ((), ()))
    h, w = on_device(np.ones((2, 4))), on_device(np.ones((4, 4), jnp.bfloat16))

    def out_dtypes(fn, *args):
        return [op.out_dtypes for op in op_dtypes(jaxmp.autocast(fn, "O1-bf16"), *args) if op.primitive == "dot_general"]

    # float32 state x bf16 weight, pet float32 = the promoted type: a half-list op like any other
    promoted = lambda h, w: jax.lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)
    assert out_dtypes(promoted, h, w) == [(BF16,)]          # 0a46f1b: float32 (kept as a "choice")
    # bf16 x bf16 asking for float32: wider than every operand, a choice
    wider = lambda h, w: jax.lax.dot_general(h.astype(jnp.bfloat16), w, dims, preferred_element_type=jnp.float32)
    assert out_dtypes(wider, h, w) == [(F32,)]
    # float32 x float32 asking for bf16: narrower than the promoted type, a choice
    narrower = lambda h, w: jax.lax.dot_general(h, w.astype(jnp.float32), dims, preferred_element_type=jnp.bfloat16)
    assert out_dtypes(narrower, h, w) == [(BF16,)]
    # and the backward pass of the promoted case is all bf16 matmuls, as for a float32 trace
    grads = op_dtypes(jax.grad(lambda h: jaxmp.autocast(promoted, "O1-bf16")(h, w).sum()), h)
    mm = [op for op in grads if op.primitive == "dot_general"]
    assert mm and all(set(op.in_dtypes) == {BF16} for op in mm), mm


def test_a_non_array_output_names_the_users_function():
    """Item 17: 0a46f1b named jaxmp's internal ``flat_fn at jaxmp/engine/_build.py:167``."""
    def my_loss(x):
        return {"loss": x.sum(), "tag": "hello"}

    with pytest.raises(TypeError, match=r"my_loss \(at .*test_rules.py:\d+\) returned a str at \['tag'\]"):
        jaxmp.autocast(my_loss, "O1-bf16")(on_device(np.ones(3)))
    # every array-like leaf still passes: numbers, bools, numpy arrays, PRNG keys
    out = jaxmp.autocast(lambda x: (x, 1, 2.0, True, np.zeros(2, np.int32), jax.random.key(0)), "O1-bf16")(on_device(np.ones(2)))
    assert out[4].dtype == np.int32


def _loss(w, x):
    return jnp.mean((x @ w) ** 2)


@pytest.mark.parametrize("how", ["grad", "jit(grad)", "grad(jit)", "closure", "two regions"])
def test_an_fp16_region_differentiated_without_a_loss_scale_warns(how):
    """Item 8: ``jax.grad(jaxmp.autocast(loss, "O1-fp16"))`` trains on flushed-to-zero gradients;
    the differentiation warns when it is traced (once per trace, however many fp16 regions)."""
    w, x = on_device(np.ones((4, 4))), on_device(np.ones((2, 4)))
    ac = jaxmp.autocast(_loss, "O1-fp16")
    run = {
        "grad": lambda: jax.grad(ac)(w, x),
        "jit(grad)": lambda: jax.jit(jax.grad(ac))(w, x),
        "grad(jit)": lambda: jax.grad(jax.jit(ac))(w, x),
        "closure": lambda: jax.grad(lambda w: jaxmp.autocast(lambda x: _loss(w, x), "O1-fp16")(x))(w),
        "two regions": lambda: jax.jit(jax.grad(lambda w: ac(w, x) + jaxmp.autocast(_loss, "O2-fp16")(w, x)))(w),
    }[how]
    with pytest.warns(jaxmp.MixedPrecisionWarning, match=r"float16 .* no loss scale.*jaxmp.loss_scaling\(tx, \"dynamic\"\)") as record:
        run()
    assert len([r for r in record if issubclass(r.category, jaxmp.MixedPrecisionWarning)]) == 1


def _fresh_fp16_loss():
    # A new function object each time: autocast shares traced programs per function, and JAX
    # caches a program's transpose, so the warning is decided once per program.
    def loss(w, x):
        return jnp.mean((x @ w).astype(jnp.float32) ** 2)

    return jaxmp.autocast(loss, "O1-fp16")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_loss_scaled_by_hand_under_plain_grad_does_not_warn(jit):
    """The false positive: ``jax.grad(lambda p: scale.scale(loss(p)))`` is loss-scaled although
    ``jaxmp.value_and_grad`` is not differentiating; the scale runs after the fp16 region."""
    import warnings

    w, x = on_device(np.ones((4, 4))), on_device(np.ones((2, 4)))
    scale = jaxmp.StaticLossScale(2.0**10)
    wrap = jax.jit if jit else (lambda f: f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        ac = _fresh_fp16_loss()
        g = wrap(jax.grad(lambda w: scale.scale(ac(w, x))))(w)
        ac = _fresh_fp16_loss()  # a dynamic scale from an optimizer state, as a training loop has it
        state = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic").init(w)
        wrap(jax.grad(lambda w, s: jaxmp.get_loss_scale(s).scale(ac(w, x))))(w, state)
    assert np.allclose(np.asarray(g), 2.0**10 * np.asarray(jax.jit(jax.grad(_loss))(w, x)))  # scaled, not flushed


@pytest.mark.parametrize("how", ["a bare constant", "a scale applied before the region", "scale unused"])
def test_a_loss_not_scaled_by_a_loss_scale_still_warns(how):
    """The true positives beside the hand-scaled one: a bare ``* 1024.0`` (a constant factor may
    be a mean-to-sum or a loss weight: not taken for a loss scale), a scale applied to another
    term before the fp16 region ran, and a loss scale fetched but not applied."""
    w, x = on_device(np.ones((4, 4))), on_device(np.ones((2, 4)))
    ac, scale = _fresh_fp16_loss(), jaxmp.StaticLossScale(2.0**10)
    loss = {
        "a bare constant": lambda w: ac(w, x) * 1024.0,
        "a scale applied before the region": lambda w: scale.scale(jnp.sum(w)) + ac(w, x),
        "scale unused": lambda w: ac(w, x) + 0 * scale.loss_scale,
    }[how]
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="no loss scale"):
        jax.grad(loss)(w)


def test_no_unscaled_fp16_warning_for_bf16_forward_only_or_the_loss_scaled_path():
    import warnings

    w, x = on_device(np.ones((4, 4))), on_device(np.ones((2, 4)))
    state = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic").init(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        jax.grad(jaxmp.autocast(_loss, "O1-bf16"))(w, x)
        jax.jit(jaxmp.autocast(_loss, "O1-fp16"))(w, x)
        jaxmp.value_and_grad(jaxmp.autocast(_loss, "O1-fp16"), state)(w, x)
        jax.jit(lambda w, s: jaxmp.value_and_grad(jaxmp.autocast(_loss, "O1-fp16"), s)(w, x))(w, state)


# -- the limits torch.autocast shares (docs/autocast.md), each fixed by a float32 region ------------

def _matmul(a, b):
    return a @ b


def test_a_large_float32_value_fed_to_a_matmul_is_kept_finite_by_a_float32_region():
    x, w = on_device(np.full((2, 4), 20.0)), on_device(np.full((4, 3), 1e-4))
    ref = jnp.exp(x) @ w                                                      # 194066
    plain = jaxmp.autocast(lambda x, w: jnp.exp(x) @ w, "O1-fp16")(x, w)
    fixed = jaxmp.autocast(lambda x, w: jaxmp.float32_region(_matmul)(jnp.exp(x), w), "O1-fp16")(x, w)
    assert not np.any(np.isfinite(plain))                                     # exp(20) is inf in fp16
    np.testing.assert_allclose(fixed, ref, rtol=1e-6)


def test_a_sum_written_as_a_dot_is_kept_finite_by_a_float32_region():
    x = on_device(np.ones(100_000))
    plain = jaxmp.autocast(lambda x: jnp.dot(x, jnp.ones(x.shape[-1])), "O1-fp16")(x)
    fixed = jaxmp.autocast(lambda x: jaxmp.float32_region(jnp.dot)(x, jnp.ones(x.shape[-1])), "O1-fp16")(x)
    written_as_sum = jaxmp.autocast(jnp.sum, "O1-fp16")(x)
    assert not np.isfinite(plain)
    assert float(fixed) == float(written_as_sum) == 100_000.0
    # the same for an explicit preferred_element_type=float32 on float32 operands, which the
    # float32 trace cannot show: the region keeps it
    pet = lambda x: jnp.dot(x, jnp.ones(x.shape[-1]), preferred_element_type=jnp.float32)
    assert not np.isfinite(jaxmp.autocast(pet, "O1-fp16")(x))
    assert float(jaxmp.autocast(jaxmp.float32_region(pet), "O1-fp16")(x)) == 100_000.0


@pytest.mark.parametrize("preset", ["O1-bf16", "O1-fp16"])
def test_cholesky_of_a_gram_matrix_computed_in_a_float32_region_is_not_nan(preset):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 1))
    x = on_device(np.hstack([a + 0.01 * rng.normal(size=(64, 1)) for _ in range(4)]))
    ref = jax.jit(lambda x: jnp.linalg.cholesky(x.T @ x))(x)   # float32: one program
    plain = jaxmp.autocast(lambda x: jnp.linalg.cholesky(x.T @ x), preset)(x)
    fixed = jaxmp.autocast(lambda x: jnp.linalg.cholesky(jaxmp.float32_region(_matmul)(x.T, x)), preset)(x)
    assert np.all(np.isfinite(ref)) and not np.all(np.isfinite(plain))       # the half Gram matrix is indefinite
    # float32's own answer up to summation order, which this ill-conditioned matrix amplifies (~1e-4)
    np.testing.assert_allclose(fixed, ref, atol=1e-3)


def test_a_preset_carries_its_level_as_data_not_in_its_name():
    """resolve_config reads Recipe.level: a renamed O3 recipe is still O3 (the name is not sliced)."""
    from jaxmp.engine._config import resolve_config

    recipe = jaxmp.get_recipe("O3-bf16")._replace(name="my pure half")
    assert recipe.level == "O3" and jaxmp.get_recipe("mixed_float16").level == "O1"
    config = resolve_config(recipe, None)
    assert config.cast_inputs == "all" and config.rules.float32_ops == frozenset()
    assert recipe.keep_float32 == ()


# ---- issue 48, defect 4: a rules object keeps the preset's promotion ----

def _preset_promote(name):
    """The documented promotion of a preset: O2 and O3 narrow, everything else demand."""
    from jaxmp._precision._presets import parse_preset

    return "narrow" if parse_preset(name).level in ("O2", "O3") else "demand"


@pytest.mark.parametrize("name", __import__("jaxmp._precision._presets", fromlist=["_"]).PRESET_NAMES)
def test_a_rules_object_keeps_the_presets_promotion(name):
    from jaxmp.engine._config import resolve_config

    edited = jaxmp.AutocastRules().with_float32("tanh")
    try:
        plain = resolve_config(name, None).rules
    except ValueError as e:  # O2-fp8: delayed scaling is the Flax door's only
        assert "delayed" in str(e)
        return
    given = resolve_config(name, edited).rules
    assert plain.promote == given.promote == _preset_promote(name), (name, plain.promote, given.promote)
    assert "tanh" in given.float32_ops
    # an explicit promote still wins
    assert resolve_config(name, jaxmp.AutocastRules(promote="widest")).rules.promote == "widest"


def test_o2_with_a_float32_op_edit_runs_o2s_program_with_that_op_in_float32():
    # The noise schedule of docs/autocast.md: a float32 bias near -13.3 after a bf16 matmul. O2
    # narrows the bias add to bf16; a rules object that moves tanh to the float32 list must change
    # tanh and only what tanh's float32 result meets, not the promotion of the rest.
    def f(p, t):
        gamma = (t[:, None] @ jnp.abs(p["w"]))[:, 0] + p["b"]
        return jnp.mean(jnp.tanh(gamma * 0.1) + gamma)

    p = {"w": np.full((1, 1), 18.3, np.float32), "b": np.full((1,), -13.3, np.float32)}
    t = np.linspace(0, 1, 4, dtype=np.float32)

    def dtypes(rules):
        return [(op.primitive, op.out_dtypes[0]) for op in op_dtypes(jaxmp.autocast(f, "O2-bf16", rules=rules), p, t)
                if op.primitive in ("dot_general", "add", "mul", "tanh")]

    o2, edited = dtypes(None), dtypes(jaxmp.AutocastRules().with_float32("tanh"))
    assert o2 == [("dot_general", BF16), ("add", BF16), ("mul", BF16), ("tanh", BF16), ("add", BF16)], o2
    # the bias add and the scaling stay narrowed as O2 does (0a46f1b's default made them float32)
    assert edited[:3] == o2[:3], edited
    assert edited[3] == ("tanh", F32), edited
    # an explicit promote="demand" still wins: the bias add feeding the mean is float32
    demand = dtypes(jaxmp.AutocastRules(promote="demand").with_float32("tanh"))
    assert demand[1] == ("add", F32), demand
