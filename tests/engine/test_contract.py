"""jaxmp.autocast's contract (docs/autocast.md, "What you can rely on"), checked as properties.

Each test here failed at commit f3b5f5b: padded attention masks gave NaN, regions and scope
rules vanished under an inner grad/vjp/vmap, float32 accumulators were added in half, O2
rounded running statistics to half every step, ``x * x`` and ``linalg.norm`` overflowed in
fp16, and Pallas kernels were refused.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import _jaxpr
from jaxmp.engine import _contract as contract, _internals as internals, _tested as tested
from tests._support._arrays import normal, on_device
from tests._support._op_dtypes import op_dtypes


BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


# -- the composition table -------------------------------------------------------------------

def test_composition_table_holds_in_both_orders_and_is_the_one_in_the_docs():
    table = contract.composition_table("O1-bf16")
    failed = [c for c in table if not c.holds]
    assert not failed, "\n".join(f"{c.name}: {c.detail}" for c in failed)
    assert len(table) == len(contract.OP_CLASSES) * len(contract.TRANSFORMS) * 2
    rendered = contract.render_table(table)
    assert rendered in (DOCS / "autocast.md").read_text(), (
        "docs/autocast.md's composition table is out of date; regenerate it with "
        "`python -m jaxmp.selfcheck --markdown`:\n" + rendered)


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap", "linearize"])
def test_fp16_region_and_scope_rules_hold_under_inner_transformations(transform):
    for op_class in ("region", "scope rule", "half list", "accumulator"):
        for order in contract.ORDERS:
            check = contract.check_cell(op_class, transform, order, "O1-fp16")
            assert check.holds, check


def test_class_rule_holds_under_an_inner_grad():
    class Head:
        def __init__(self, w):
            self.w = w

        def __call__(self, x):
            return x @ self.w

    rules = jaxmp.AutocastRules().with_class(Head, "float32")
    loss = lambda w, x: jnp.sum(Head(w)(x) ** 2)
    w, x = on_device(np.full((4, 4), 0.1)), on_device(np.ones((3, 4)))
    for fn in (jax.grad(jaxmp.autocast(loss, "O1-bf16", rules=rules)),
               jaxmp.autocast(jax.grad(loss), "O1-bf16", rules=rules)):
        dots = [op for op in op_dtypes(fn, w, x) if op.primitive == "dot_general"]
        assert len(dots) == 2 and all(set(op.in_dtypes) == {F32} for op in dots), dots


# -- constants saturate, data does not -------------------------------------------------------

def masked_softmax(w, x, mask):
    logits = jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


@pytest.mark.parametrize("policy", ["O1-bf16", "O2-bf16", "O1-fp16", "O2-fp16", "O3-fp16"])
def test_padding_row_of_a_finfo_min_mask_gives_float32s_answer(policy):
    w, x = on_device(np.full((4, 4), 0.1)), on_device(np.ones((3, 4)))
    mask = on_device(np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool))
    got = jaxmp.autocast(masked_softmax, policy)(w, x, mask)
    want = jax.jit(masked_softmax)(w, x, mask)  # the float32 reference: one program, not one per op
    assert np.all(np.isfinite(np.asarray(got, np.float32))), got
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got[2], np.float32), 0.25)


def test_user_inf_and_nan_stay_and_a_fully_computed_additive_mask_saturates():
    def f(x):
        bias = jnp.where(jnp.array([True, False, False]), 0.0, jnp.finfo(jnp.float32).min)
        return x * 2.0 + bias, x + jnp.array([jnp.inf, -jnp.inf, jnp.nan])

    a, b = jaxmp.autocast(f, "O3-fp16")(on_device(np.ones(3)))
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == F16 and bool(np.all(np.isfinite(a))) and float(a[1]) == -65504.0
    assert np.isposinf(float(b[0])) and np.isneginf(float(b[1])) and np.isnan(float(b[2]))


def _bert_loss(w, x, mask, big):
    s = jnp.einsum("btd,bsd->bts", x @ w, x) * 0.125
    p = jax.nn.softmax(s + (1.0 - mask[:, None, :].astype(jnp.float32)) * big, axis=-1)
    return jnp.mean(jnp.einsum("bts,bsd->btd", p, x) ** 2)


#: The float32 reference of the test below, ``big`` an argument: one program for every case.
_bert_loss_f32 = jax.jit(_bert_loss)


@pytest.mark.parametrize("policy", ["O1-bf16", "O1-fp16"])
@pytest.mark.parametrize("neg", ["finfo", "1e9"])
def test_an_additive_mask_built_from_integer_data_keeps_a_padding_row_finite(policy, neg):
    # The BERT convention: (1 - mask.astype(float32)) * big_negative added to half scores. The
    # mask is data the program made float32 itself; narrowed, it became -inf and the padding-only
    # row's softmax (and every gradient) NaN.
    big = float(jnp.finfo(jnp.float32).min) if neg == "finfo" else -1e9

    def loss(w, x, mask):   # big a constant of the program, as a model writes it
        return _bert_loss(w, x, mask, big)

    w = normal(0, (8, 8), 0.3)
    x = normal(1, (2, 4, 8))
    mask = on_device(np.array([[1, 1, 1, 0], [0, 0, 0, 0]]))
    want = _bert_loss_f32(w, x, mask, np.float32(big))
    got, g = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, policy)))(w, x, mask)
    assert np.all(np.isfinite(np.asarray(g))), g
    np.testing.assert_allclose(float(got), float(want), rtol=2e-2)


def test_a_saturated_mask_added_to_negative_fp16_scores_keeps_the_row_uniform():
    # finfo(float32).min is beyond float16's range: the add runs in float32 instead of adding
    # -65504 (the saturated constant) to scores below -16, which rounds to -inf.
    def attn(q, k, mask):
        return jax.nn.softmax(q @ k.T + jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[None, :], axis=-1)

    q, k = on_device(np.ones((2, 8))), on_device(-3.0 * np.arange(1.0, 5.0)[:, None] * np.ones((4, 8)))
    got = jaxmp.autocast(attn, "O1-fp16")(q, k, on_device(np.zeros((4,), bool)))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.full((2, 4), 0.25, np.float32))


@pytest.mark.parametrize("policy", ["O1-fp16", "O1-bf16"])
def test_constants_the_half_type_cannot_hold_run_their_ops_in_float32(policy):
    # 1e5 overflows float16 (saturated it was 65504: 31% off); 1e-8 is zero in float16 (log(0)).
    def f(w, x):
        h = x @ w
        return h * 1e5, jnp.log(jnp.maximum(jax.nn.relu(h - 1.0), 1e-8)), h / (h + 1e-8)

    w, x = on_device(np.eye(4)), on_device(np.full((2, 4), 0.5))
    for got, want in zip(jaxmp.autocast(f, policy)(w, x), jax.jit(f)(w, x)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2)


def test_a_float32_result_keeps_float32_through_cond_scan_and_while():
    # A batch mean passed through control flow is centred in float32, as without it: in fp16
    # the mean 100.03125 rounds to 100.0 and the variance doubles.
    x = on_device(np.where(np.arange(8)[:, None] % 2 == 0, 100.0, 100.0625) * np.ones((8, 4)))

    def via(kind):
        def var(w, x):
            h = x @ w
            if kind == "cond":
                mu = jax.lax.cond(True, lambda h: h.mean(0), lambda h: jnp.zeros(h.shape[1:]), h)
            elif kind == "scan":
                mu = jax.lax.scan(lambda c, _: (h.mean(0), None), jnp.zeros(4), None, length=2)[0]
            else:
                mu = jax.lax.while_loop(lambda c: c[1] < 1, lambda c: (h.mean(0), c[1] + 1), (jnp.zeros(4), 0))[0]
            return jnp.mean((h - mu) ** 2)
        return var

    for kind in ("cond", "scan", "while"):
        got = jaxmp.autocast(via(kind), "O1-fp16")(on_device(np.eye(4)), x)
        assert float(got) == 0.0009765625, (kind, float(got))


@pytest.mark.parametrize("policy", ["O1-bf16", "O1-fp16"])
def test_a_masked_float32_accumulator_in_a_scan_adds_in_float32(policy):
    # jnp.where(valid, acc + y, acc): the padded-steps form of a running sum.
    def masked_sum(w, xs, valid):
        return jax.lax.scan(lambda acc, inp: (jnp.where(inp[1], acc + inp[0] @ w, acc), None),
                            jnp.zeros((1, 4)), (xs, valid))[0]

    xs, valid = on_device(np.full((3000, 1, 4), 0.25)), on_device(np.arange(3000) % 3 != 0)
    got = jaxmp.autocast(masked_sum, policy)(on_device(np.eye(4)), xs, valid)
    np.testing.assert_allclose(np.asarray(got), 500.0)


def test_a_closed_over_jax_array_constant_the_half_type_cannot_hold_promotes_like_a_literal():
    eps, scale = jnp.float32(1e-8), jnp.array(1e5, jnp.float32)  # jax.Arrays, not numpy or literals

    def f(w, x):
        h = x @ w
        return h / jnp.maximum(jnp.abs(h), eps), h * scale

    w, x = on_device(np.eye(4)), on_device(np.array([[0.0, 1.0, 2.0, 3.0]]))
    for got, want in zip(jaxmp.autocast(f, "O1-fp16")(w, x), jax.jit(f)(w, x)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2)


def test_a_float32_list_result_written_into_a_half_buffer_promotes_it():
    # The buffer is a matmul's (bf16) result; the softmax row written into it is float32-list.
    def f(w, x):
        return jax.lax.dynamic_update_slice(x @ w, jax.nn.softmax(x[:1], axis=-1), (0, 0))

    x = on_device(np.array([[0.0, 0.0, 0.0, 1e-3], [0.0, 0.0, 0.0, 0.0]]))
    got = np.asarray(jaxmp.autocast(f, "O1-bf16")(on_device(np.eye(4)), x), np.float32)
    row = jax.jit(lambda x: jax.nn.softmax(x[0]))(x)   # the float32 reference: one program
    np.testing.assert_allclose(got[0], row, rtol=1e-6)


def test_a_float32_buffer_written_with_a_half_value_keeps_its_untouched_rows():
    # dynamic_update_slice keeps the buffer's dtype and concatenate the widest, as .at[].set and
    # torch's cat do: a float32 KV cache or history is not rounded as a whole to bfloat16.
    x, w, buf = on_device(np.ones((8, 8))), on_device(np.eye(8)), on_device(np.full((16, 8), 1.001))
    dus = jaxmp.autocast(lambda buf, w, x: jax.lax.dynamic_update_slice(buf, x @ w, (0, 0)), "O1-bf16")(buf, w, x)
    cat = jaxmp.autocast(lambda buf, w, x: jnp.concatenate([buf[8:], x @ w]), "O1-bf16")(buf, w, x)
    assert dus.dtype == cat.dtype == F32
    np.testing.assert_array_equal(np.asarray(dus)[8:], np.asarray(buf)[8:])
    np.testing.assert_array_equal(np.asarray(cat)[:8], np.asarray(buf)[8:])


def test_o2_leaves_a_weight_whose_matmul_is_in_a_float32_region_unrounded():
    # O2 casts weights to half on entry; one used only inside a float32 region (the marker, a
    # scope rule, a nested O0 autocast) must reach that region as passed, not bf16-rounded.
    w, x = on_device(1.0 + 1e-3 * np.arange(16.0)[:, None] * np.ones((16, 16))), on_device(np.ones((2, 16)))
    want = np.asarray(x) @ np.asarray(w)   # float32 in numpy

    def scoped(w, x):
        with jax.named_scope("head"):
            return x @ w

    inner = jaxmp.autocast(lambda w, x: x @ w, "O0")
    for got in (jaxmp.autocast(jaxmp.float32_region(lambda w, x: x @ w), "O2-bf16")(w, x),
                jaxmp.autocast(scoped, "O2-bf16", rules=jaxmp.AutocastRules().with_scope("head", "float32"))(w, x),
                jaxmp.autocast(lambda w, x: inner(w, x), "O2-bf16")(w, x)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_an_update_inside_autocast_under_a_float32_region_is_applied_in_float32():
    # docs/autocast.md: the update belongs outside autocast, or under jaxmp.float32_region; there
    # p - lr * g runs in float32 and 20 updates of 1e-4 * g move p as float32 does.
    def step(p, x):
        g = jax.grad(lambda p, x: jnp.mean((x @ p) ** 2))(p, x)
        return jaxmp.float32_region(lambda p, g: p - 1e-4 * g)(p, g)

    f = jax.jit(jaxmp.autocast(step, "O1-bf16"))
    p = q = on_device(np.eye(4))
    ones, ref = on_device(np.ones((8, 4))), jax.jit(step)   # the float32 reference, jitted: one program
    for _ in range(20):
        p, q = f(p, ones), ref(q, ones)
    assert p.dtype == F32 and float(p[0, 0]) < 0.9991
    np.testing.assert_allclose(np.asarray(p), np.asarray(q), atol=1e-5)  # bf16 gradients: 0.4% of 1e-3


@pytest.mark.parametrize("policy", ["O1-bf16", "O1-fp16", "O3-fp16"])
def test_a_mask_value_passed_as_a_python_number_saturates_eager_or_jitted(policy):
    # Eagerly the number is a static argument (a literal of the program); the caller's jit
    # traces it as a weak scalar. Both must saturate, or jit alone turns the padding row to NaN.
    def f(w, x, mask, neg):
        return jax.nn.softmax(jnp.where(mask, x @ w, neg), axis=-1)

    w, x = on_device(np.full((4, 4), 0.1)), on_device(np.ones((3, 4)))
    mask = on_device(np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool))
    neg = float(jnp.finfo(jnp.float32).min)
    ac = jaxmp.autocast(f, policy)
    eager, jitted = ac(w, x, mask, neg), jax.jit(ac)(w, x, mask, neg)
    assert np.all(np.isfinite(np.asarray(jitted, np.float32))), jitted
    np.testing.assert_array_equal(eager, jitted)
    np.testing.assert_allclose(np.asarray(jitted[2], np.float32), 0.25)
    # A float32 array is data, not a number: O1 keeps it float32 where the softmax needs it
    # (finite); O2 narrows it and its overflow is not hidden.
    negs = on_device(np.full((3, 4), neg, np.float32))
    big = jax.jit(ac)(w, x, mask, negs)
    assert np.all(np.isfinite(np.asarray(big, np.float32))) or not policy.startswith("O1")
    o2 = jax.jit(jaxmp.autocast(f, policy.replace("O1", "O2")))(w, x, mask, negs)
    assert policy.endswith("bf16") or not np.all(np.isfinite(np.asarray(o2, np.float32)))


def test_an_activation_overflow_is_not_saturated_and_the_step_is_skipped():
    def loss(w, x):
        return jnp.sum((x @ w).astype(jnp.float32)) * 0.0 + jnp.sum(x @ w)

    w, x = on_device(np.full((4, 4), 300.0)), on_device(np.full((2, 4), 100.0))   # x @ w = 120,000 > fp16's 65,504
    assert not np.isfinite(np.asarray(jaxmp.autocast(loss, "O1-fp16")(w, x)))
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    state = tx.init(w)

    @jax.jit
    def step(w, state):
        _, g = jaxmp.value_and_grad(jaxmp.autocast(loss, "O1-fp16"), state)(w, x)
        updates, state = tx.update(g, state, w)
        return jaxmp.apply_updates(w, updates, state), state

    new_w, state = step(w, state)
    assert int(jaxmp.scaling_stats(state)["total_skips"]) == 1
    np.testing.assert_array_equal(new_w, w)


# -- O2 keeps state float32 --------------------------------------------------------------------

def test_o2_running_statistics_track_float32_within_1_percent_after_1000_steps():
    def step(params, stats, x):
        h = x @ params["w"]
        return jnp.sum(h), 0.99 * stats + 0.01 * jnp.mean(h, axis=0)

    f = jax.jit(jaxmp.autocast(step, "O2-bf16"))
    ref = jax.jit(step)
    params, x = {"w": on_device(np.eye(4))}, on_device(np.ones((8, 4)))
    stats = stats32 = on_device(np.zeros(4))
    for _ in range(1000):
        stats, stats32 = f(params, stats, x)[1], ref(params, stats32, x)[1]
    assert stats.dtype == F32
    np.testing.assert_allclose(stats, stats32, rtol=0.01)   # f3b5f5b: 0.689 vs 1.000


def test_o2_casts_weights_on_entry_and_passes_other_state_as_given():
    def f(params, stats, x):
        return jnp.sum(x @ params["w"] + params["b"]) + jnp.sum(stats)

    program = jaxmp.autocast(f, "O2-bf16")
    args = ({"w": on_device(np.ones((4, 4))), "b": on_device(np.zeros(4))}, on_device(np.zeros(4)), on_device(np.ones((2, 4))))
    program(*args)
    (prog,) = program._programs.values()
    # leaves: b, w, stats, x; x feeds only the matmul, so it is cast on entry too
    assert prog.weights() == [False, True, False, True]


# -- accumulators ------------------------------------------------------------------------------

def accumulate(x, w):
    return jax.lax.fori_loop(0, 2000, lambda i, a: a + jnp.tanh(x @ w) * 1e-3, jnp.zeros((8, 4)))


def accumulate_while(x, w):
    def body(c):
        i, a = c
        return i + 1, a + jnp.tanh(x @ w) * 1e-3

    return jax.lax.while_loop(lambda c: c[0] < 2000, body, (0, jnp.zeros((8, 4))))[1]


@pytest.mark.parametrize("fn", [accumulate, accumulate_while], ids=["fori_loop", "while_loop"])
@pytest.mark.parametrize("policy", ["O1-bf16", "O1-fp16"])
def test_a_float32_accumulator_is_added_in_float32(fn, policy):
    x = normal(0, (8, 16))
    w = normal(1, (16, 4), 0.3)
    half = BF16 if policy.endswith("bf16") else F16
    # Eager, op by op: each op rounds to half as the engine's does (a jitted term lets XLA keep
    # the wider value between tanh and its cast, and differs by 0.3% in bf16).
    term = jnp.tanh((x.astype(half) @ w.astype(half))).astype(F32) * np.float32(np.asarray(1e-3, half))
    got = jaxmp.autocast(fn, policy)(x, w)
    # 2000 float32 additions of the half-precision term: the error of one term, not 2000 roundings
    np.testing.assert_allclose(got, 2000 * term, rtol=2e-3, atol=1e-4)   # f3b5f5b: 87% off in bf16


def test_ema_and_gradient_accumulation_carries_run_in_float32():
    def ema(xs, w):
        return jax.lax.scan(lambda m, x: (0.999 * m + 0.001 * jnp.tanh(x @ w), None), jnp.zeros((2, 4)), xs)[0]

    def grad_accum(w, xs):
        g = jax.lax.scan(lambda acc, x: (acc + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), None),
                         jnp.zeros_like(w), xs)[0]
        return g

    xs = normal(0, (500, 2, 8))
    w = normal(1, (8, 4)) * 0.3
    for fn, args in ((ema, (xs, w)), (grad_accum, (w, xs))):
        updates = contract.carry_updates(jaxmp.autocast(fn, "O1-bf16"), args)
        assert updates and all(ins == {F32} for _, _, ins in updates), updates
    got, want = jaxmp.autocast(ema, "O1-bf16")(xs, w), ema(xs, w)
    np.testing.assert_allclose(got, want, rtol=0.02, atol=2e-3)


def test_a_float32_scanned_hidden_state_stays_float32_at_o1_and_is_narrowed_at_o2():
    # A float32 carry meeting a half matmul: O1 keeps it float32 (a loop carry is needed in
    # float32, as torch's float32 + half is float32); O2 narrows it, Apex's speed trade.
    def rnn(w, xs):
        h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((2, 8)), xs)
        return h

    def residual(w, xs):
        return jax.lax.scan(lambda h, x: (h + jnp.tanh(h @ w) + x, None), jnp.zeros((2, 8)), xs)[0]

    w, xs = on_device(np.eye(8) * 0.5), on_device(np.ones((5, 2, 8)))
    for fn in (rnn, residual):
        for policy, dtype in (("O1-bf16", F32), ("O2-bf16", BF16)):
            ops = op_dtypes(jaxmp.autocast(fn, policy), w, xs)
            body = [op for op in ops if op.primitive == "add"]  # (a tanh of a half matmul alone stays half)
            assert body and all(set(op.out_dtypes) == {dtype} for op in body), (policy, body)
            assert [op.in_dtypes for op in ops if op.primitive == "dot_general"] == [(BF16, BF16)]


# -- norms -------------------------------------------------------------------------------------

def test_linalg_norm_and_a_hand_written_rms_norm_square_in_float32():
    h, eye = on_device(np.full((1, 64), 300.0)), on_device(np.eye(64))
    norm = jaxmp.autocast(lambda h, w: jnp.linalg.norm(h @ w), "O1-fp16")(h, eye)
    np.testing.assert_allclose(norm, 2400.0, rtol=1e-3)   # f3b5f5b: inf

    def rms_norm(h, w):
        y = h @ w
        return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)

    out = jaxmp.autocast(rms_norm, "O1-fp16")(h, eye)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, rtol=1e-2)
    squares = [op for op in op_dtypes(jaxmp.autocast(rms_norm, "O1-fp16"), h, eye)
               if op.primitive == "mul" and op.in_dtypes[0] == op.in_dtypes[-1] == F32]
    assert squares


def test_a_product_of_two_equal_matmuls_is_a_square():
    """Issue 37 item 3: ``(x @ w) * (x @ w)`` traces two matmuls that the engine merges, so the
    ``mul`` reads one value twice: a square, in float32 like ``(x @ w) ** 2`` (0a46f1b: fp16, inf)."""
    h, w = on_device(np.full((4, 64), 300.0 / 64)), on_device(np.ones((64, 8)))
    f = lambda h, w: jnp.mean((h @ w) * (h @ w))
    ac = jaxmp.autocast(f, "O1-fp16")
    np.testing.assert_allclose(ac(h, w), 90000.0, rtol=1e-3)
    ops = op_dtypes(ac, h, w)
    muls = [op for op in ops if op.primitive == "mul"]
    assert [op.in_dtypes for op in muls] == [(F32, F32)]
    # the merged product is cast up once, not once per variable that holds it
    ups = [op for op in ops if op.primitive == "convert_element_type" and op.out_dtypes == (F32,)]
    assert len(ups) == 1, ups


def test_mixed_half_operands_are_never_narrowed_to_float16():
    big_bf16 = on_device(np.full((2,), 1e6, jnp.bfloat16))
    # The functions mix bfloat16 and float16 on purpose (what does autocast make of that?), which
    # only standard promotion lets them trace at all.
    with jax.numpy_dtype_promotion("standard"):
        out = jaxmp.autocast(lambda a, b: a + b, "O1-fp16")(big_bf16, on_device(np.ones(2, np.float16)))
        y = jaxmp.autocast(lambda a, b: a @ b, "O1-fp16")(on_device(np.full((2, 2), 1e5, jnp.bfloat16)),
                                                           on_device(np.ones((2, 2), np.float16)))
    assert np.all(np.isfinite(np.asarray(out, np.float32))), out
    assert np.all(np.isfinite(np.asarray(y, np.float32))), y


# -- opaque kernels ----------------------------------------------------------------------------

def _pallas_kernel():
    pl = pytest.importorskip("jax.experimental.pallas")

    def body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + y_ref[...]

    def kernel(x, y):
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    return kernel


def test_pallas_kernels_run_bare_and_under_half_inputs():
    kernel = _pallas_kernel()
    w, x = on_device(np.eye(128)), on_device(np.ones((8, 128)))
    bare = jaxmp.autocast(lambda w, x: jnp.sum(kernel(x @ w, x)), "O1-bf16")(w, x)
    cast = jaxmp.autocast(lambda w, x: jnp.sum(jaxmp.half_inputs(kernel)(x @ w, x)), "O1-bf16")(w, x)
    assert float(bare) == float(cast) == 3.0 * 8 * 128
    calls = [op for op in op_dtypes(jaxmp.autocast(lambda w, x: jaxmp.half_inputs(kernel)(x @ w, x), "O1-bf16"), w, x)
             if op.primitive == "pallas_call"]
    assert calls and set(calls[0].in_dtypes) == {BF16}


# -- one seam, every JAX ------------------------------------------------------------------------

def test_a_missing_jax_parameter_is_a_clear_error_naming_it_and_the_version():
    eqn = _jaxpr.equations(jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2))(1.0))[0]
    fake = eqn.replace(params={k: v for k, v in eqn.params.items() if k not in ("num_consts", "ft_in")})
    with pytest.raises(internals.JaxInternalsError, match=rf"num_consts.*jax {jax.__version__}"):
        internals.scan_counts(fake)


def test_tested_versions_come_from_the_ci_matrix_and_pay_no_canary(monkeypatch):
    import subprocess
    import sys

    rows = subprocess.run([sys.executable, str(DOCS.parent / ".ci" / "matrix.py")], capture_output=True, text=True,
                          check=True).stdout.split("\n")
    assert [tuple(r.split()) for r in rows if r] == list(tested.MATRIX)   # .ci/run builds what the engine names
    assert (0, 10) in tested.TESTED_JAX and len(tested.TESTED_JAX) == len({j for _, j in tested.MATRIX})
    assert not tested.is_newer_than_tested(internals.JAX_VERSION)
    calls = []
    monkeypatch.setattr(contract, "canary", lambda: calls.append(1) or [])
    contract.run_canary_once.cache_clear()
    contract.run_canary_once()
    assert calls == []


def test_the_canary_warns_naming_the_jax_version_on_a_newer_jax(monkeypatch):
    monkeypatch.setattr(tested, "is_newer_than_tested", lambda version: True)
    monkeypatch.setattr(contract, "canary", lambda: [contract.Check("region | grad | autocast(T(f))", False, "bf16")])
    contract.run_canary_once.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=rf"jax {jax.__version__} is newer.*region \| grad"):
            contract.run_canary_once()
    finally:
        contract.run_canary_once.cache_clear()


def test_building_autocast_functions_starts_the_canary_once(monkeypatch):
    from jaxmp.engine._config import resolve_config
    from jaxmp.engine._autocast_fn import engine_function

    calls = []
    monkeypatch.setattr(tested, "is_newer_than_tested", lambda version: True)
    monkeypatch.setattr(contract, "canary", lambda: calls.append(1) or [])
    contract.run_canary_once.cache_clear()
    try:
        f = jaxmp.autocast(lambda w, x: x @ w, "O1-bf16")
        assert calls == [1]  # at build time, before any call
        jaxmp.autocast(lambda x: x, "O1-fp16")
        engine_function(lambda x: x, resolve_config("O1-bf16", None))
        f(jnp.ones((2, 2)), jnp.ones((1, 2)))
        assert calls == [1]
    finally:
        contract.run_canary_once.cache_clear()


def test_the_real_canary_on_a_newer_jax_builds_its_checks_without_restarting_itself(monkeypatch):
    """The checks are built one layer below the public entry points (api.build), so running the
    canary never re-enters it, and a JAX that honours every rule gets no warning."""
    import warnings

    monkeypatch.setattr(tested, "is_newer_than_tested", lambda version: True)
    # The real canary, run once and its result kept: it passes on this JAX (every check holds),
    # which test_the_real_canary_passes_on_this_jax asserted with a second run of its own.
    real, failed = contract.canary, []
    monkeypatch.setattr(contract, "canary", lambda: failed.append(real()) or failed[-1])
    contract.run_canary_once.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            contract.run_canary_once()
    finally:
        contract.run_canary_once.cache_clear()
    assert failed == [[]]   # ran once, and on this JAX nothing failed


@pytest.mark.slow
def test_selfcheck_prints_what_holds(capsys):
    from jaxmp import selfcheck

    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out and "checks hold" in out and "FAILS" not in out


@pytest.mark.parametrize("policy", ["O1", "mixed_float16"])
def test_the_contract_reads_the_half_dtype_of_presets_that_name_it_implicitly(policy):
    # "O1" takes the platform's half type and "mixed_float16" float16: both once read as bf16.
    assert contract.check_cell("half list", "jit", "T(autocast(f))", policy).holds


@pytest.mark.parametrize("policy", ["O0", "O9", "O2-fp8"])
def test_selfcheck_refuses_a_policy_it_cannot_check_with_a_usage_error(policy, capsys):
    from jaxmp import selfcheck

    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--policy", policy])
    assert e.value.code == 2 and policy in capsys.readouterr().err


def test_a_nested_jit_keeps_its_shardings_donation_and_name():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = NamedSharding(mesh, P("x"))

    def layer(w, x):
        return jnp.tanh(x @ w)

    inner = jax.jit(layer, out_shardings=sharding, donate_argnums=(1,))
    f = jaxmp.autocast(lambda w, x: jnp.sum(inner(w, x)), "O1-bf16")
    w, x = on_device(np.ones((4, 4))), on_device(np.ones((8, 4)))
    # Under a trace the engine's ops are bound into the caller's jaxpr: the nested jit is there.
    jits = [op for op in _jaxpr.equations(jax.make_jaxpr(f)(w, x)) if op.primitive.name in ("jit", "pjit")]
    (nested,) = [e for e in jits if e.params["name"] == "layer"]
    assert nested.params["out_shardings"] == (sharding,)
    assert nested.params["donated_invars"] == (False, True)
    dots = [e for e in _jaxpr.equations(nested.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert {v.aval.dtype for v in dots[0].invars} == {BF16}
    np.testing.assert_allclose(float(f(w, x)), float(np.sum(np.tanh(np.asarray(x) @ np.asarray(w)))), rtol=1e-2)


def test_two_threads_tracing_at_once_keep_their_own_rules():
    import threading

    import flax.linen as nn
    from jaxmp.flax import mixed_precision

    class Head:
        def __init__(self, w):
            self.w = w

        def __call__(self, x):
            return x @ self.w

    barrier = threading.Barrier(2)
    results, errors = {}, []

    def traced(name, rules, policy):
        try:
            def loss(w, x):
                barrier.wait(timeout=30)   # both threads inside their traces together
                y = jax.nn.dot_product_attention(x[None, :, None, :], x[None, :, None, :], x[None, :, None, :])
                return jnp.sum(Head(w)(x)) + jnp.sum(y)

            f = jaxmp.autocast(loss, policy, rules=rules)
            dots = [op for op in op_dtypes(f, jax.ShapeDtypeStruct((4, 4), F32), jax.ShapeDtypeStruct((3, 4), F32))
                    if op.primitive == "dot_general"]
            results[name] = set(dots[-1].in_dtypes)   # the Head's matmul (after the attention's)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def linen(name, policy):
        try:
            model = mixed_precision(nn.Dense(4), policy)
            x = jax.ShapeDtypeStruct((2, 4), F32)
            params = jax.eval_shape(model.init, jax.random.key(0), x)  # abstract: only a trace is read
            barrier.wait(timeout=30)
            dots = [op for op in op_dtypes(model.apply, params, x) if op.primitive == "dot_general"]
            results[name] = set(dots[0].in_dtypes)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    for targets in ([(traced, ("f32 rule", jaxmp.AutocastRules().with_class(Head, "float32"), "O1-bf16")),
                     (traced, ("no rule", None, "O1-fp16"))],
                    [(linen, ("linen bf16", "O1-bf16")), (linen, ("linen fp16", "O1-fp16"))]):
        barrier.reset()
        threads = [threading.Thread(target=t, args=a) for t, a in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert results == {"f32 rule": {F32}, "no rule": {F16}, "linen bf16": {BF16}, "linen fp16": {F16}}
    assert not hasattr(nn.Module.param, "__wrapped__")   # Flax's own param: params are cast by path


def test_two_policies_and_a_plain_linen_model_trace_at_once_in_three_threads():
    """Two wrapped Linen models under different policies and a plain one, all three inside their
    traces at the same time (a barrier inside the model): each sees its own params and dots."""
    import threading

    import flax.linen as nn
    from jaxmp.flax import mixed_precision

    sync = {"barrier": None}
    param_dtypes, results, errors = {}, {}, []

    class Synced(nn.Module):
        tag: str

        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 4))
            if sync["barrier"] is not None:
                param_dtypes[self.tag] = w.dtype
                sync["barrier"].wait(timeout=60)   # the three threads are all tracing here
            return nn.LayerNorm()(x @ w)

    class Net(nn.Module):
        tag: str

        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(Synced(self.tag)(x))

    x = on_device(np.ones((2, 4)))
    # O2: every param goes to half before the model runs (O1 casts only the weights, in the engine).
    models = {"bf16": mixed_precision(Net("bf16"), "O2-bf16"), "fp16": mixed_precision(Net("fp16"), "O2-fp16"),
              "plain": Net("plain")}
    # Only traces are read: abstract variables (no initialiser compiled and run); no barrier yet.
    variables = {tag: jax.eval_shape(m.init, jax.random.key(0), x) for tag, m in models.items()}

    def trace(tag):
        try:
            ops = op_dtypes(lambda v: models[tag].apply(v, x), variables[tag])
            results[tag] = ({op.in_dtypes for op in ops if op.primitive == "dot_general"},
                            {op.in_dtypes for op in ops if op.primitive == "rsqrt"})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    sync["barrier"] = threading.Barrier(3)
    threads = [threading.Thread(target=trace, args=(tag,)) for tag in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert param_dtypes == {"bf16": BF16, "fp16": F16, "plain": F32}
    assert results["plain"] == ({(F32, F32)}, {(F32,)})
    assert results["bf16"] == ({(BF16, BF16)}, {(F32,)})   # LayerNorm still float32 under O2
    assert results["fp16"] == ({(F16, F16)}, {(F32,)})


def test_an_rnn_weight_gradient_is_as_accurate_in_both_orders():
    def loss(w, xs):
        h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((4, 16)), xs)
        return jnp.sum(h ** 2)

    w = normal(0, (16, 16), 0.25)
    xs = normal(1, (64, 4, 16))
    g32 = np.asarray(jax.jit(jax.grad(loss))(w, xs))  # the float32 reference: one program
    errors = []
    for fn in (jax.grad(jaxmp.autocast(loss, "O1-bf16")), jaxmp.autocast(jax.grad(loss), "O1-bf16")):
        g = fn(w, xs)
        assert g.dtype == F32
        errors.append(float(np.linalg.norm(np.asarray(g) - g32) / np.linalg.norm(g32)))
    # bf16 matmuls cost ~1% here; the transposed scan accumulates the weight cotangent in
    # float32 in both orders. jax 0.10.2: 0.0128 in both orders (f3b5f5b: 0.0128 vs 0.0137, and
    # 6x apart on longer sequences); jax 0.11.2 transposes the scan differently: 0.0106 for
    # grad(autocast(f)) and 0.0068 for autocast(grad(f)), which sees the backward ops itself.
    assert max(errors) < 0.03, errors
    assert errors[1] <= 1.1 * errors[0], errors


def test_precision_report_flags_a_half_backward_reduction_of_grad_autocast():
    def loss(w, b, x):
        return jnp.sum(jnp.tanh(x @ w + b))

    w, b, x = on_device(np.full((16, 16), 0.1)), on_device(np.zeros(16)), on_device(np.ones((4096, 16)))
    outer = jaxmp.precision_report(jax.grad(jaxmp.autocast(loss, "O2-bf16"), argnums=1), w, b, x)
    inner = jaxmp.precision_report(jaxmp.autocast(jax.grad(loss, argnums=1), "O2-bf16"), w, b, x)
    # grad(autocast(f)) at O2 (the bias narrowed to bf16): the bias gradient is the transpose of
    # a bf16 broadcast, a bf16 sum over 4096 rows, flagged; autocast(grad(f)) puts that sum on
    # the float32 list: nothing to flag. (O1 keeps this bias add float32: no half sum at all.)
    assert "reduction" in [r.category for r in outer.risky]
    assert "reduction" not in [r.category for r in inner.risky]


def test_the_explicit_accumulate_helper_covers_an_ode_step_the_rule_cannot_see():
    def euler(w, y, helper):
        def step(i, y):
            delta = 1e-3 * jnp.tanh(y @ w)
            return jaxmp.accumulate(y, delta) if helper else y + delta   # y also feeds the matmul

        return jax.lax.fori_loop(0, 2000, step, y)

    w, y0 = on_device(np.eye(8) * 0.5), on_device(np.ones((2, 8)) * 0.1)
    ref = np.asarray(euler(w, y0, False))
    err = lambda y: float(np.max(np.abs(np.asarray(y) - ref) / np.abs(ref)))
    # O1: the float32 carry is needed in float32, so the add runs in float32 unaided.
    o1 = jaxmp.autocast(lambda w, y: euler(w, y, False), "O1-bf16")(w, y0)
    assert err(o1) < 0.01, err(o1)
    # O2 narrows the carry's add to bf16 and the 1e-3 steps round away; the helper keeps them.
    plain = jaxmp.autocast(lambda w, y: euler(w, y, False), "O2-bf16")(w, y0)
    helped = jaxmp.autocast(lambda w, y: euler(w, y, True), "O2-bf16")(w, y0)
    assert err(plain) > 0.05 and err(helped) < 0.01, (err(plain), err(helped))


def test_accumulate_refuses_a_delta_the_total_cannot_hold():
    """Issue 37 item 9: 0.7 added into an int32 total in the total's dtype added 0, silently."""
    with pytest.raises(TypeError, match=r"float32 delta cannot be added into a total of dtype int32.*make the total"):
        jaxmp.accumulate(on_device(np.zeros(3, np.int32)), on_device(np.full(3, 0.7)))
    with pytest.raises(TypeError, match=r"imaginary part"):
        jaxmp.accumulate(on_device(np.zeros(3)), on_device(np.ones(3, np.complex64)))
    # what fits is added: integers into integers or floats, a Python float into a float32 total
    zeros_i, zeros_f, twos = on_device(np.zeros(3, np.int32)), on_device(np.zeros(3)), on_device(np.full(3, 2, np.int32))
    assert jaxmp.accumulate(zeros_i, twos).tolist() == [2, 2, 2]
    assert jaxmp.accumulate(zeros_f, twos).dtype == F32
    assert jaxmp.accumulate(zeros_f, 0.5).tolist() == [0.5, 0.5, 0.5]


def test_an_nn_scan_transformer_body_gains_no_float32_ops_from_the_carry():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            n = nn.LayerNorm()(h)
            a = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(n, n)
            h = h + a
            h = h + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))
            return h, None

    Stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    # Only op dtypes are read (a trace): the parameters are abstract, so neither Flax's
    # initialisers nor the scanned init are compiled and run.
    x = jax.ShapeDtypeStruct((2, 5, 16), F32)
    stacked = Stack()
    params = jax.eval_shape(stacked.init, jax.random.key(0), x, None)
    single = Block()
    p1 = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)

    def f32_elementwise(fn, *args):
        return sorted(op.primitive for op in op_dtypes(jaxmp.autocast(fn, "O1-bf16"), *args)
                      if op.primitive in ("add", "sub", "mul", "div", "tanh", "max") and F32 in op.in_dtypes)

    scanned = f32_elementwise(lambda p, x: stacked.apply(p, x, None)[0], params, x)
    one = f32_elementwise(lambda p, x: single.apply(p, x, None)[0], p1, x)
    # the loop body does exactly the float32 work of one block (norm statistics, softmax): the
    # residual-stream carry is not an accumulator, so no add runs in float32 because of it
    assert one and scanned == one, (len(scanned), len(one))


def test_masked_attention_under_jit_of_grad_leaks_no_tracer_and_matches_float32():
    """The attention routing's float32 backward takes the mask (and any array argument) as an
    input, not a closure: closing over it handed the backward pass a finished trace's tracer."""
    q = normal(0, (2, 4, 2, 8))
    mask = on_device(np.tril(np.ones((4, 4), bool))[None, None])
    lengths = on_device(np.array([4, 2], np.int32))

    def f(q):
        return jax.nn.dot_product_attention(q, q, q, mask=mask, key_value_seq_lengths=lengths).sum()

    got = jax.jit(jax.grad(jaxmp.autocast(f, "O1-bf16")))(q)
    want = jax.jit(jax.grad(f))(q)
    assert got.dtype == F32 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=0.05 * float(np.abs(np.asarray(want)).max()))
