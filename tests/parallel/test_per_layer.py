"""Unit tests of jaxmp.parallel._per_layer: the remat setting, the context stack and what
gather_params / scan_layers do in each of their modes (outside a step, record, manual, global).

Whole FSDP steps with scan_layers are in tests/parallel/test_layouts.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmp import _jaxpr
from jaxmp.parallel import _per_layer

N = 8
BF16 = jnp.bfloat16


@pytest.mark.parametrize("name", _per_layer.REMAT_POLICIES)
def test_remat_policy_names_are_jax_checkpoint_policies(name):
    assert _per_layer.remat_policy(name) is getattr(jax.checkpoint_policies, name)


def test_remat_policy_passes_none_and_callables_through_and_refuses_the_rest():
    policy = lambda prim, *a, **k: False  # noqa: E731
    assert _per_layer.remat_policy(None) is None and _per_layer.remat_policy(policy) is policy
    for bad in ("offload_dot_with_no_batch_dims", True, 1):  # a real jax policy name that is not listed, non-strings
        with pytest.raises(ValueError, match=r"remat must be None, a policy callable or one of .*got " + repr(bad)):
            _per_layer.remat_policy(bad)


def test_contexts_nest_and_unwind_on_errors():
    outer, inner = _per_layer.LayerContext("record"), _per_layer.LayerContext("record")
    assert _per_layer._current() is None
    with _per_layer.context(outer):
        with pytest.raises(RuntimeError):
            with _per_layer.context(inner):
                assert _per_layer._current() is inner
                raise RuntimeError
        assert _per_layer._current() is outer
    assert _per_layer._current() is None


def test_outside_a_step_gather_params_only_casts_floating_leaves():
    tree = {"w": jnp.ones((2, 2)), "n": jnp.arange(3), "k": jax.random.key(0)}
    out = _per_layer.gather_params(tree, BF16)
    assert out["w"].dtype == BF16 and out["n"].dtype == jnp.int32 and out["k"] is tree["k"]
    assert _per_layer.gather_params(tree)["w"] is tree["w"]  # dtype=None: untouched


def test_record_mode_notes_the_leaves_that_reach_the_helpers():
    params = {"emb": jnp.ones((4, 4)), "block": {"w": jnp.ones((4, 4))}, "layers": {"w": jnp.ones((3, 4, 4))}}
    ctx = _per_layer.LayerContext("record")
    with _per_layer.context(ctx):
        got = _per_layer.gather_params(params["block"], BF16)
        carry, _ = _per_layer.scan_layers(lambda h, p: (h @ p["w"], None), jnp.ones(4), params["layers"])
    assert ctx.recorded == {id(params["block"]["w"]), id(params["layers"]["w"])}  # not the embedding
    assert got["w"].dtype == BF16
    np.testing.assert_array_equal(carry, np.full(4, 64.0))  # three layers of ones(4, 4)


def test_outside_a_step_scan_layers_is_lax_scan():
    layers = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(3, 4, 4)), jnp.float32),  # numpy: no eager draw compile
              "b": jnp.arange(12.0).reshape(3, 4)}

    def body(h, p):
        h = jnp.tanh(h @ p["w"] + p["b"])
        return h, h.sum()

    got = _per_layer.scan_layers(body, jnp.ones(4), layers)
    want = jax.lax.scan(body, jnp.ones(4), layers)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    # dtype casts each layer's float params in the body; the stacked params stay as stored
    h, ys = _per_layer.scan_layers(lambda h, p: (h, p["w"].dtype == BF16), jnp.ones(4), layers, dtype=BF16)
    assert bool(ys.all())


def test_the_step_remat_policy_wraps_the_scan_body_only_inside_a_context():
    layers = {"w": jnp.ones((3, 4, 4))}

    def prims(ctx):
        def f(layers):
            return _per_layer.scan_layers(lambda h, p: (jnp.sin(h @ p["w"]), None), jnp.ones(4), layers)[0]
        if ctx is None:
            return {e.primitive for e in _jaxpr.walk(jax.make_jaxpr(f)(layers))}
        with _per_layer.context(ctx):
            return {e.primitive for e in _jaxpr.walk(jax.make_jaxpr(f)(layers))}

    remat = {"checkpoint", "remat", "remat2"}
    assert not prims(None) & remat
    assert not prims(_per_layer.LayerContext("global")) & remat
    assert prims(_per_layer.LayerContext("global", remat=jax.checkpoint_policies.nothing_saveable)) & remat


def test_slice_info_drops_the_layer_axis():
    ctx = _per_layer.LayerContext("manual", axis="d")
    assert _per_layer._slice_info(ctx, None, "['w']") is None
    assert _per_layer._slice_info(ctx, 2, "['w']") == 1
    with pytest.raises(ValueError, match=r"stacked params leaf \['w'\] is sharded along its layer axis \(0\).*"
                                         r"min_shard_size"):
        _per_layer._slice_info(ctx, 0, "['w']")
    mesh = Mesh(np.array(jax.devices()[:N]).reshape(4, 2), ("data", "model"))
    glob = _per_layer.LayerContext("global", mesh=mesh)
    got = _per_layer._slice_info(glob, NamedSharding(mesh, P(None, "data", "model")), "['w']")
    # the layer axis (replicated) is dropped; a trailing None (replicated) pads the shorter spec
    assert got.spec == P("data", "model", None) and got.mesh is mesh
    assert _per_layer._slice_info(glob, NamedSharding(mesh, P()), "['w']").spec == P()


def test_manual_mode_gathers_the_registered_leaves_in_the_compute_dtype():
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))
    w = jnp.arange(N * 2 * 3, dtype=jnp.float32).reshape(N * 2, 3)
    b = jnp.ones((3,))

    def per_shard(w_piece, b):
        ctx = _per_layer.LayerContext("manual", axis="d", reduce_dtype=jnp.float32, leaves={id(w_piece): 0})
        with _per_layer.context(ctx):
            got = _per_layer.gather_params({"w": w_piece, "b": b}, BF16)
        return got["w"], got["b"]

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d"))))
    w_whole, b_out = fn(w, b)
    # every device holds the whole w, cast to bf16 before the gather; b (not registered) is only cast
    assert w_whole.dtype == BF16 and w_whole.shape == (N * N * 2, 3)
    np.testing.assert_array_equal(np.asarray(w_whole, np.float32), np.tile(np.asarray(w), (N, 1)))
    assert b_out.dtype == BF16 and b_out.shape == (N * 3,)
    assert ("all_gather", "bfloat16") in [(e.primitive, np.dtype(e.in_avals[0].dtype).name)
                                          for e in _jaxpr.walk(jax.make_jaxpr(fn)(w, b))]


def test_global_mode_constrains_a_registered_leaf_to_its_sharding():
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))
    w = jax.device_put(jnp.ones((N, 4)), NamedSharding(mesh, P("d")))
    whole = NamedSharding(mesh, P())

    def f(w):
        ctx = _per_layer.LayerContext("global", leaves={id(w): whole}, mesh=mesh)
        with _per_layer.context(ctx):
            return _per_layer.gather_params({"w": w}, BF16)["w"]

    eqns = [e for e in _jaxpr.walk(jax.make_jaxpr(f)(w)) if e.primitive == "sharding_constraint"]
    assert len(eqns) == 1 and eqns[0].params["sharding"].spec == P()
    assert np.dtype(eqns[0].in_avals[0].dtype) == BF16  # cast first, then gathered
    assert jax.jit(f)(w).sharding.is_fully_replicated


def test_release_policy_never_saves_a_gathered_param_and_defers_the_rest():
    # The policy JAX asks per equation: "may this output be saved for the backward?"
    from jax.ad_checkpoint import checkpoint_name

    jaxpr = jax.make_jaxpr(lambda w, h: jnp.sin(h @ checkpoint_name(w, _per_layer.GATHERED)))(
        jnp.ones((4, 4)), jnp.ones(4))
    eqns = {e.eqn.primitive.name: e.eqn for e in _jaxpr.walk(jaxpr)}
    kept = lambda policy, name: policy(eqns[name].primitive, **eqns[name].params)  # noqa: E731
    keep_all, dots = _per_layer.release_policy(None), _per_layer.release_policy(jax.checkpoint_policies.dots_saveable)
    assert not kept(keep_all, "name") and not kept(dots, "name")  # the gathered weight: re-gathered
    assert kept(keep_all, "sin") and kept(keep_all, "dot_general")  # no remat: every activation
    assert not kept(dots, "sin") and kept(dots, "dot_general")  # the user's policy for the rest
