"""jaxmp.autocast on every kind of JAX model: Equinox, Haiku, Flax Linen (the experiments'
ResNet with BatchNorm and Transformer with dropout) and Flax NNX; class rules for each. The
Equinox and Haiku tests skip without their extras; the Flax ones always run."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests._support._op_dtypes import op_dtypes
from tests.engine.test_autocast import F32, check_ops

import flax.linen as nn
from flax import nnx

from experiments.models.resnet import ResNet9
from experiments.models.transformer import TransformerEncoder


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# -- Equinox ----------------------------------------------------------------------------------

@pytest.mark.slow  # default-tier time: the slow tier runs it
def test_equinox_filter_grad_and_class_rule():
    eqx = pytest.importorskip("equinox")  # here, not at import: the Flax tests below need no extra

    class EqxNet(eqx.Module):
        mlp: eqx.nn.MLP
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            self.mlp = eqx.nn.MLP(8, 4, 16, 2, key=key)
            self.norm = eqx.nn.LayerNorm(8)

        def __call__(self, x):
            return self.mlp(self.norm(x))

    model = EqxNet(jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (16, 8)), jnp.arange(16) % 4

    def loss(model, x, y):
        return _ce(jax.vmap(model)(x), y)

    ac = jaxmp.autocast(loss, "O1-bf16")
    check_ops(op_dtypes(lambda x, y: ac(model, x, y), x, y), min_matmuls=3)
    grads = eqx.filter_jit(eqx.filter_grad(ac))(model, x, y)
    ref = eqx.filter_grad(loss)(model, x, y)
    for g, r in zip(jax.tree.leaves(eqx.filter(grads, eqx.is_array)), jax.tree.leaves(eqx.filter(ref, eqx.is_array))):
        assert g.dtype == F32 and np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, atol=0.05 * float(np.abs(r).max()) + 1e-6)
    # class rule: every eqx.nn.Linear in float32, whatever the field is called
    rules = jaxmp.AutocastRules().with_class(eqx.nn.Linear, "float32")
    check_ops(op_dtypes(lambda x, y: jaxmp.autocast(loss, "O1-bf16", rules=rules)(model, x, y), x, y), matmul=F32, min_matmuls=3)
    # and the class was restored after tracing
    check_ops(op_dtypes(lambda x, y: ac(model, x, y), x, y), min_matmuls=3)


# -- Haiku ------------------------------------------------------------------------------------

@pytest.mark.slow  # default-tier time: the slow tier runs it
def test_haiku_transformed_apply_and_class_rule():
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.nets.MLP([16, 4])(hk.LayerNorm(-1, True, True)(x))

    net = hk.without_apply_rng(hk.transform(forward))
    x, y = jax.random.normal(jax.random.key(1), (16, 8)), jnp.arange(16) % 4
    params = net.init(jax.random.key(0), x)
    loss = lambda p, x, y: _ce(net.apply(p, x), y)
    ac = jaxmp.autocast(loss, "O1-bf16")
    check_ops(op_dtypes(ac, params, x, y), min_matmuls=2)
    g = jax.jit(jax.grad(ac))(params, x, y)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(g))
    rules = jaxmp.AutocastRules().with_class(hk.Linear, "float32")
    check_ops(op_dtypes(jaxmp.autocast(loss, "O1-bf16", rules=rules), params, x, y), matmul=F32, min_matmuls=2)


# -- Flax Linen: the experiments' models -------------------------------------------------------

@pytest.mark.slow
def test_linen_resnet_with_batchnorm():
    model = ResNet9(num_classes=4)
    x, y = jax.random.normal(jax.random.key(1), (4, 16, 16, 3)), jnp.arange(4) % 4
    variables = model.init(jax.random.key(0), x, train=False)

    def loss(params, batch_stats, x, y):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                                      mutable=["batch_stats"])
        return _ce(logits, y), updates

    ac = jaxmp.autocast(loss, "O1-bf16")
    ops = op_dtypes(ac, variables["params"], variables["batch_stats"], x, y)
    check_ops(ops, min_matmuls=5)
    (l, updates), g = jax.value_and_grad(ac, has_aux=True)(variables["params"], variables["batch_stats"], x, y)
    assert l.dtype == F32 and np.isfinite(float(l))
    assert all(s.dtype == F32 for s in jax.tree.leaves(updates))  # running statistics stay float32
    assert all(leaf.dtype == F32 and np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(g))


@pytest.mark.slow
def test_linen_transformer_with_dropout_rng_and_class_rule():
    model = TransformerEncoder(num_classes=4, num_layers=2, model_dim=16, num_heads=2, mlp_dim=32, dropout_rate=0.1)
    x, y = jax.random.normal(jax.random.key(1), (4, 8)), jnp.arange(4) % 4
    params = model.init(jax.random.key(0), x, train=False)["params"]

    def loss(params, x, y, key):
        return _ce(model.apply({"params": params}, x, train=True, rngs={"dropout": key}), y)

    ac = jaxmp.autocast(loss, "O1-bf16")
    key = jax.random.key(3)
    check_ops(op_dtypes(ac, params, x, y, key), min_matmuls=8)
    g = jax.jit(jax.grad(ac))(params, x, y, key)
    assert all(leaf.dtype == F32 and np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(g))
    rules = jaxmp.AutocastRules().with_class(nn.Dense, "float32")
    ops = op_dtypes(jaxmp.autocast(loss, "O1-bf16", rules=rules), params, x, y, key)
    dense = [op for op in ops if op.primitive == "dot_general" and "jaxmp[float32]:Dense" in op.scope]
    assert dense and all(set(op.in_dtypes) == {F32} for op in dense)


# -- Flax NNX ---------------------------------------------------------------------------------

class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.norm, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.norm(self.l1(x))))


@pytest.fixture(scope="module")
def nnx_net():
    """Builds fresh NNXNets holding one set of initial parameters (immutable arrays, shared safely).

    Initialised once per module, in one compiled program (eagerly, each initialiser draw compiles
    its own): the same parameters as ``NNXNet(nnx.Rngs(0))``."""
    parts = nnx.split(nnx.jit(lambda: NNXNet(nnx.Rngs(0)))())
    return lambda: nnx.merge(*parts)


def _data(n):
    """Inputs and labels from numpy: an eager ``jax.random`` draw compiles threefry per shape."""
    x = np.random.default_rng(1).standard_normal((n, 8), dtype=np.float32)
    return jax.device_put(x), jax.device_put(np.arange(n, dtype=np.int32) % 4)


def test_nnx_value_and_grad(nnx_net):
    model = nnx_net()
    x, y = _data(16)
    ac_loss = jaxmp.autocast(lambda m, x, y: _ce(m(x), y), "O1-bf16")
    check_ops(op_dtypes(lambda m, x, y: ac_loss(m, x, y), model, x, y), min_matmuls=2)
    loss, grads = nnx.value_and_grad(ac_loss)(model, x, y)
    assert loss.dtype == F32
    assert all(g.dtype == F32 and np.all(np.isfinite(g)) for g in jax.tree.leaves(nnx.state(grads)))
    rules = jaxmp.AutocastRules().with_class(nnx.Linear, "float32")
    check_ops(op_dtypes(jaxmp.autocast(lambda m, x, y: _ce(m(x), y), "O1-bf16", rules=rules), model, x, y),
              matmul=F32, min_matmuls=2)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_nnx_split_merge_training(nnx_net):
    model = nnx_net()
    graphdef, state = nnx.split(model)
    x, y = _data(64)

    def loss(state, x, y):
        return _ce(nnx.merge(graphdef, state)(x), y)

    ac = jaxmp.autocast(loss, "O1-bf16")
    tx = optax.adam(1e-2)
    opt = tx.init(state)

    @jax.jit
    def step(state, opt):
        l, g = jax.value_and_grad(ac)(state, x, y)
        u, opt = tx.update(g, opt)
        return optax.apply_updates(state, u), opt, l

    first = None
    for _ in range(30):
        state, opt, l = step(state, opt)
        first = l if first is None else first
    assert float(l) < 0.8 * float(first)
