"""O1's promotion rule (``promote="demand"``): a float32 value meeting a half one keeps float32
where float32 is needed, so model code trains as it does in float32 (issue: accuracy by default).

The mechanism, in 30 lines: a float32 bias near -13.3 added after a half matmul. Read as bf16 its
ulp is 1/16, so Adam's 2e-3 steps do not move it until the rounding flips (``promote="narrow"``,
O2's speed trade); O1 adds it in float32, as torch.autocast promotes ``half + float``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from jaxmp import _jaxpr

pytestmark = pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")


def _schedule_loss(p, t):
    gamma = (t[:, None] @ jnp.abs(p["w"]))[:, 0] + p["b"]
    return jnp.mean((gamma - (-13.29)) ** 2)


#: The float32 loss at the end of a run: one program (eagerly, one per op).
_final_loss = jax.jit(_schedule_loss)


def _schedule_params():
    """w = 18.3, b = -13.3 from numpy (``jnp.full`` compiles a program per shape)."""
    return ({"w": jax.device_put(np.full((1, 1), 18.3, np.float32)), "b": jax.device_put(np.full((1,), -13.3, np.float32))},
            jax.device_put(np.zeros((4,), np.float32)))


def _adam(loss, params, batch, lr, steps):
    tx = optax.adam(lr)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        grads = jax.grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(steps):
        params, state = step(params, state)
    return params


def test_a_float32_bias_after_a_half_matmul_trains_as_in_float32_at_o1():
    params, t = _schedule_params()
    final = {}
    for name, loss in (("float32", _schedule_loss), ("O1", jaxmp.autocast(_schedule_loss, "O1-bf16")),
                       ("O2", jaxmp.autocast(_schedule_loss, "O2-bf16"))):
        final[name] = float(_final_loss(_adam(lambda p, b: loss(p, b), params, t, 2e-3, 40), t))
    assert final["float32"] < 1e-6, final
    assert final["O1"] <= 10 * final["float32"], final   # 0a46f1b: 3,200x
    assert final["O2"] > 100 * final["float32"], final   # O2 narrows: the documented trade


def test_o1_keeps_float32_only_where_it_is_needed():
    # A bias add feeding a matmul is narrowed (it is cast to half there anyway); one feeding a
    # softmax (a float32-list op) or the output is float32.
    def f(p, x):
        h = x @ p["w1"] + p["b1"]                      # feeds the next matmul only: half
        logits = h @ p["w2"] + p["b2"]                 # feeds the softmax: float32
        return jax.nn.log_softmax(logits).sum()

    p = {"w1": np.ones((4, 4), np.float32), "b1": np.ones(4, np.float32), "w2": np.ones((4, 4), np.float32),
         "b2": np.ones(4, np.float32)}
    jaxpr = jax.make_jaxpr(jaxmp.autocast(f, "O1-bf16"))(p, np.ones((2, 4), np.float32)).jaxpr   # traced only
    adds = [e.outvars[0].aval.dtype for e in _jaxpr.equations(jaxpr) if e.primitive.name == "add"]
    assert adds[:2] == [jnp.bfloat16, jnp.float32], adds


def test_python_scalars_and_float32_scalars_never_decide():
    # (x @ w) * 0.5 stays half under every rule (torch: a 0-dim tensor never decides).
    for promote in ("narrow", "widest", "demand"):
        rules = jaxmp.AutocastRules(promote=promote)
        jaxpr = jax.make_jaxpr(jaxmp.autocast(lambda x, w: ((x @ w) * 0.5) @ w, "O1-bf16", rules=rules))(
            np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)).jaxpr
        muls = [e for e in _jaxpr.equations(jaxpr) if e.primitive.name == "mul"]
        assert [m.outvars[0].aval.dtype for m in muls] == [jnp.bfloat16], (promote, muls)


# -- model code: a learned noise schedule (VDM-style) and a BERT-style encoder, both doors -------

class DenseMonotone(nn.Module):
    features: int
    kernel_init: object = nn.initializers.normal(1.0)
    bias_init: object = nn.initializers.zeros
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        y = jnp.dot(x, jnp.abs(self.param("kernel", self.kernel_init, (x.shape[-1], self.features))))
        return y + self.param("bias", self.bias_init, (self.features,)) if self.use_bias else y


class NoiseSchedule(nn.Module):
    """google-research/vdm's monotone schedule net, small: gamma(t) from -13.3 to 5."""

    @nn.compact
    def __call__(self, t):
        t = t[:, None]
        h = DenseMonotone(1, nn.initializers.constant(18.3), nn.initializers.constant(-13.3))(t)
        g = DenseMonotone(16)(2.0 * (t - 0.5))
        g = DenseMonotone(1, nn.initializers.normal(0.01), use_bias=False)(2.0 * (jax.nn.sigmoid(g) - 0.5)) / 16
        return jnp.squeeze(h + g, -1)


class VDM(nn.Module):
    @nn.compact
    def __call__(self, x, t, eps):
        sched = NoiseSchedule()
        g_t, dg = jax.jvp(sched, (t,), (jnp.ones_like(t),))
        g0 = sched(jnp.zeros_like(t[:1]))
        z = jnp.sqrt(jax.nn.sigmoid(-g_t))[:, None] * x + jnp.sqrt(jax.nn.sigmoid(g_t))[:, None] * eps
        h = nn.swish(nn.Dense(32)(jnp.concatenate([z, g_t[:, None] / 10.0], -1)))
        eps_hat = nn.Dense(x.shape[-1])(h)
        diffusion = 0.5 * dg * jnp.mean((eps - eps_hat) ** 2, -1) / 18.3
        return 1e-6 * jnp.mean(diffusion) + jnp.sum((g0 + 13.29) ** 2)  # gamma(0) fitted to the data


class EncoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(2)(y, y)
        return x + nn.Dense(x.shape[-1])(jax.nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x))))


class Encoder(nn.Module):
    """BERT-style: embeddings, two blocks, a tanh pooler and a two-class head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 32)(tokens) + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], 32))
        for _ in range(2):
            x = EncoderBlock()(x)
        return nn.Dense(2)(jnp.tanh(nn.Dense(32)(nn.LayerNorm()(x)[:, 0])))


def _vdm():
    x = jax.random.normal(jax.random.key(0), (32, 4))
    batch = (x, jax.random.uniform(jax.random.key(1), (32,)), jax.random.normal(jax.random.key(2), (32, 4)))
    return VDM(), batch, (lambda apply: lambda p, b: apply({"params": p}, *b)), 2e-3


def _encoder():
    tokens = jax.random.randint(jax.random.key(0), (16, 8), 0, 32)
    labels = (tokens[:, 1] > 15).astype(jnp.int32)

    def loss(apply):
        return lambda p, b: optax.softmax_cross_entropy_with_integer_labels(apply({"params": p}, b[0]), b[1]).mean()

    return Encoder(), (tokens, labels), loss, 3e-3


@pytest.mark.slow  # ~20 s: three 50-step trainings per model
@pytest.mark.parametrize("case", ["noise schedule", "encoder"])
def test_model_code_trains_within_5_percent_of_float32_through_both_doors_at_o1(case):
    model, batch, make_loss, lr = (_vdm if case == "noise schedule" else _encoder)()
    params = model.init(jax.random.key(0), *(batch if case == "noise schedule" else batch[:1]))["params"]
    reference = make_loss(model.apply)
    losses = {"autocast": jaxmp.autocast(reference, "O1-bf16"),
              "flax": make_loss(jaxmp.flax.mixed_precision(model, "O1-bf16").apply)}
    final = {"float32": float(reference(_adam(reference, params, batch, lr, 50), batch))}
    for door, loss in losses.items():
        final[door] = float(reference(_adam(loss, params, batch, lr, 50), batch))
    # 0a46f1b: noise schedule +16,800% (both doors), encoder +28.6% (autocast)
    for door in losses:
        assert final[door] <= 1.05 * final["float32"], (case, final)


def test_the_nnx_door_keeps_a_float32_bias_float32_at_o1():
    # The NNX door casts only the weights at O1, as the Linen door and autocast's O2 entry do: a
    # bias near -13.3 after a half matmul moves with Adam's 2e-3 steps (the narrowed one does not).
    from flax import nnx

    final_loss = nnx.jit(lambda layer, t: jnp.mean((layer(t) + 13.29) ** 2))   # one program, not one per op

    def fit(policy):
        layer = nnx.Linear(1, 1, rngs=nnx.Rngs(0), kernel_init=nnx.initializers.constant(18.3),
                           bias_init=nnx.initializers.constant(-13.3))
        model = jaxmp.flax.mixed_precision(layer, policy) if policy else layer
        optimizer = nnx.Optimizer(model, optax.adam(2e-3), wrt=nnx.Param)
        t = jax.device_put(np.zeros((4, 1), np.float32))

        @nnx.jit
        def step(model, optimizer):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(t) + 13.29) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        for _ in range(40):
            step(model, optimizer)
        return float(final_loss(layer, t))

    ref, o1, o2 = fit(None), fit("O1-bf16"), fit("O2-bf16")
    assert ref < 1e-6 and o1 <= 10 * ref, (ref, o1)
    assert o2 > 100 * ref, (ref, o2)   # O2 narrows (its params are stored in half too)


def test_precision_report_names_a_float32_value_narrowed_to_half_with_its_ulp():
    # Under O2 the schedule's float32 bias is rounded to bf16 before its add: reported, with
    # |b| = 13.3 and the bf16 ulp there (1/16). O1 adds it in float32: nothing to report.
    params, t = _schedule_params()
    o2 = jaxmp.precision_report(jaxmp.autocast(_schedule_loss, "O2-bf16"), params, t)
    narrowed = [r for r in o2.risky if r.category == "narrowed"]
    assert len(narrowed) == 1 and narrowed[0].primitive == "add", o2.risky
    assert "13.3" in narrowed[0].detail and "ulp is 0.0625" in narrowed[0].detail, narrowed[0].detail
    o1 = jaxmp.precision_report(jaxmp.autocast(_schedule_loss, "O1-bf16"), params, t)
    assert not [r for r in o1.risky if r.category == "narrowed"], o1.risky
    # A hand cast (jmp-style) narrows it too; shapes only (no values): reported without |x|.
    hand = lambda p, t: _schedule_loss(jaxmp.cast_floating(p, jnp.bfloat16), t.astype(jnp.bfloat16))
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, t))
    rep = jaxmp.precision_report(hand, *shapes)
    assert [r.category for r in rep.risky].count("narrowed") >= 1, rep.risky
