"""A GPT-2-small-shaped Transformer in plain JAX, and hand-written ZeRO / FSDP steps to compare against.

Only shapes matter here (the memory benchmark compiles, it never runs): 12 layers, width 768,
12 heads, vocabulary 50257, 1024 positions, tied embedding: 124.4M parameters, stored in
bfloat16 (O2-bf16). Two forms of the same model: ``unrolled`` (one params entry per layer, a
Python loop) and ``scanned`` (every layer's params stacked on a leading axis, ``lax.scan`` over
layers), the form in which per-layer FSDP gathers and remat apply
(:func:`jaxmp.parallel.gather_params`, ``make_sharded_train_step(remat=...)``).

The hand-written baselines are what a user would write with optax, ``NamedSharding`` and
``with_sharding_constraint`` (and ``shard_map`` for a float32 reduce-scatter): float32 masters
and AdamW moments sharded over the data axis, ``optax.apply_if_finite`` as the skip rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    positions: int = 1024
    seq: int = 128


GPT2_SMALL = Shape()
TINY = Shape(layers=2, width=128, heads=4, vocab=512, positions=64, seq=32)


def _layer_shapes(s: Shape) -> dict:
    d = s.width
    return {"ln1_g": (d,), "ln1_b": (d,), "qkv_w": (d, 3 * d), "qkv_b": (3 * d,), "proj_w": (d, d), "proj_b": (d,),
            "ln2_g": (d,), "ln2_b": (d,), "fc_w": (d, 4 * d), "fc_b": (4 * d,), "out_w": (4 * d, d), "out_b": (d,)}


def abstract_params(s: Shape, scanned: bool, dtype: Any = BF16) -> dict:
    """The params as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    sds = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    top = {"wte": sds((s.vocab, s.width)), "wpe": sds((s.positions, s.width)),
           "lnf_g": sds((s.width,)), "lnf_b": sds((s.width,))}
    layer = _layer_shapes(s)
    if scanned:
        top["layers"] = {k: sds((s.layers,) + v) for k, v in layer.items()}
    else:
        top.update({f"h{i}": {k: sds(v) for k, v in layer.items()} for i in range(s.layers)})
    return top


def param_count(s: Shape) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(abstract_params(s, True)))


def _ln(x, g, b):
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g + b


def _block(s: Shape, x, p):
    b, t, d = x.shape
    h = _ln(x, p["ln1_g"], p["ln1_b"])
    q, k, v = jnp.split(h @ p["qkv_w"] + p["qkv_b"], 3, axis=-1)
    heads = lambda a: a.reshape(b, t, s.heads, d // s.heads)  # noqa: E731
    att = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)).astype(jnp.float32) / np.sqrt(d // s.heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    att = jax.nn.softmax(att, axis=-1).astype(x.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, heads(v)).reshape(b, t, d)
    x = x + y @ p["proj_w"] + p["proj_b"]
    h = _ln(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(h @ p["fc_w"] + p["fc_b"]) @ p["out_w"] + p["out_b"]


def loss_fn(s: Shape, scanned: bool, layer_params: Callable | None = None, remat: Any = None,
            per_layer: bool = False) -> Callable:
    """``loss(params, batch)``: next-token cross-entropy (float32) of the model.

    ``layer_params`` maps one layer's params before use (the per-layer FSDP gather,
    :func:`jaxmp.parallel.gather_params`); ``remat`` a ``jax.checkpoint`` policy for the
    scanned body (the hand-written baseline's remat; jaxmp's step takes ``remat=`` itself).
    ``per_layer``: scan with :func:`jaxmp.parallel.scan_layers` (each layer gathered in the body).
    """
    use = layer_params or (lambda p: p)

    def loss(params, batch):
        tokens = batch["tokens"]
        x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
        if scanned and per_layer:
            from jaxmp.parallel import scan_layers
            x, _ = scan_layers(lambda h, p: (_block(s, h, p), None), x, params["layers"])
        elif scanned:
            def body(h, p):
                return _block(s, h, use(p)), None
            if remat is not None:
                body = jax.checkpoint(body, policy=remat)
            x, _ = jax.lax.scan(body, x, params["layers"])
        else:
            for i in range(s.layers):
                x = _block(s, x, use(params[f"h{i}"]))
        x = _ln(x, params["lnf_g"], params["lnf_b"])
        logits = (x @ params["wte"].T).astype(jnp.float32)
        targets = jnp.roll(tokens, -1, axis=1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


def layer_gather(mesh: Any) -> Callable:
    """The hand-written per-layer FSDP gather: one layer's params constrained to replicated.

    Used as ``loss_fn(..., layer_params=layer_gather(mesh))`` inside the scan body, the
    constraint makes XLA all-gather each layer's slices where that layer runs (what MaxText
    does), instead of gathering the activations or every layer at the loss's start.
    """
    replicated = NamedSharding(mesh, P())
    return lambda p: jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, replicated), p)


def abstract_batch(s: Shape, global_batch: int) -> dict:
    return {"tokens": jax.ShapeDtypeStruct((global_batch, s.seq), jnp.int32)}


# --------------------------------------------------------------------------- hand-written steps


def hand_written_step(loss: Callable, params: Any, mesh: Any, layout: str, reduce_dtype: Any = None,
                      gathered_loss: Callable | None = None) -> tuple[Callable, tuple]:
    """A jitted hand-written ZeRO (``layout="zero"``) or FSDP (``"fsdp"``) step and its abstract inputs.

    ``reduce_dtype=None``: plain ``jit`` differentiates the loss on the global batch and the
    gradients are constrained to the masters' slices (XLA reduce-scatters in the matmul's dtype,
    bfloat16). ``"float32"`` (ZeRO only): a ``shard_map`` over the data axis computes each
    shard's gradient, casts it to float32 and ``psum_scatter``-s it onto the slices.
    ``gathered_loss`` (FSDP): the loss that gathers each layer's params where they are used.
    """
    import optax
    from jaxmp.parallel._layouts import leaf_spec

    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    tx = optax.apply_if_finite(optax.adamw(1e-3), 10)
    specs = jax.tree_util.tree_map(lambda x: leaf_spec(x.shape, mesh, axis), params)
    sharded = jax.tree_util.tree_map(lambda sp: NamedSharding(mesh, sp), specs,
                                     is_leaf=lambda x: isinstance(x, P))
    rep = NamedSharding(mesh, P())
    p_sh = sharded if layout == "fsdp" else jax.tree_util.tree_map(lambda _: rep, params)
    masters = jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sh),
                                     params, sharded)
    opt = jax.eval_shape(tx.init, masters)
    # The optimizer state's leaves take their master's sharding; scalars are replicated.
    m_leaves = jax.tree_util.tree_leaves(masters)

    def opt_sharding(x):
        for m in m_leaves:
            if m.shape == x.shape and len(x.shape):
                return m.sharding
        return rep

    o_sh = jax.tree_util.tree_map(opt_sharding, opt)
    m_sh = jax.tree_util.tree_map(lambda x: x.sharding, masters)
    fwd = gathered_loss or loss

    def grads_of(params, batch):
        if reduce_dtype is None:
            return jax.value_and_grad(fwd)(params, batch)

        def local(p, b):
            value, g = jax.value_and_grad(fwd)(p, b)
            g = jax.tree_util.tree_map(
                lambda x, sp: (jax.lax.psum_scatter(x.astype(jnp.float32), axis, scatter_dimension=list(sp).index(axis),
                                                    tiled=True) if axis in tuple(sp) else
                               jax.lax.psum(x.astype(jnp.float32), axis)) / n, g, specs)
            return jax.lax.pmean(value, axis), g

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), specs),
                             check_vma=False)(params, batch)

    def step(params, masters, opt_state, batch):
        value, grads = grads_of(params, batch)
        grads = jax.lax.with_sharding_constraint(grads, m_sh)
        g32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = tx.update(g32, opt_state, masters)
        masters = optax.apply_updates(masters, updates)
        new = jax.tree_util.tree_map(lambda m: m.astype(BF16), masters)
        return jax.lax.with_sharding_constraint(new, p_sh), masters, opt_state, value

    data = NamedSharding(mesh, P(axis))
    jitted = jax.jit(step, in_shardings=(p_sh, m_sh, o_sh, data), out_shardings=(p_sh, m_sh, o_sh, rep),
                     donate_argnums=(0, 1, 2))
    abstract_p = jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, p_sh)
    abstract_o = jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), opt, o_sh)
    return jitted, (abstract_p, masters, abstract_o)
