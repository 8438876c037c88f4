"""The public surface: __all__, no moved-name shims, jmp interop, dataclass pytrees,
composable transforms."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.parallel


def test_all_lists_only_existing_core_names_and_no_parallel_plumbing():
    for name in jaxmp.__all__:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert getattr(jaxmp, name) is not None, name
    assert not set(jaxmp.parallel.__all__) & set(jaxmp.__all__)
    assert len(jaxmp.parallel.__all__) == 31  # 22 before the state layouts (+6), per-layer FSDP gathers (+3)


# Names that moved before any release; no release had them at their old place, so they are gone
# there (no shim, no DeprecationWarning): each old location raises AttributeError.
OLD_LOCATIONS = (
    [("jaxmp", name) for name in ("make_pmap_train_step", "make_sharded_train_step", "replicate", "shard_batch")]
    + [("jaxmp.policy", name) for name in ("parse_dtype", "cast_floating", "get_policy", "Recipe",
                                           "recommended_policy", "preset_half_dtype")]
    + [("jaxmp.transform", name) for name in ("apply_updates", "check_health", "get_loss_scale", "master_params",
                                              "TrainingDivergedError")])


@pytest.mark.parametrize("module,name", OLD_LOCATIONS)
def test_names_are_only_at_their_current_location(module, name):
    import importlib

    mod = importlib.import_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeprecationWarning on the way to the AttributeError either
        with pytest.raises(AttributeError, match=name):
            getattr(mod, name)
    assert not hasattr(mod, "_MOVED")


def test_old_parallel_names_live_in_jaxmp_parallel():
    for name in ("make_pmap_train_step", "make_sharded_train_step", "replicate", "shard_batch"):
        assert name in jaxmp.parallel.__all__ and callable(getattr(jaxmp.parallel, name))


def test_test_helper_is_out_of_the_package():
    with pytest.raises(ImportError):
        import jaxmp.parallel._multiprocess_demo  # noqa: F401


def test_policy_is_a_jmp_policy_and_haiku_uses_it():
    hk = pytest.importorskip("haiku", reason="needs the haiku extra")
    policy = jaxmp.get_policy("O1-bf16")
    assert isinstance(policy, jmp.Policy)

    class MLP(hk.nets.MLP):  # a subclass, so the policy does not leak into other tests
        pass

    hk.mixed_precision.set_policy(MLP, policy)
    try:
        def forward(x):
            return MLP([4, 2])(x)

        f = hk.transform(forward)
        x = jnp.ones((3, 5), jnp.float32)
        params = f.init(jax.random.key(0), x)
        out = f.apply(params, None, x)
        # jmp's contract, executed by Haiku: params stored in the param dtype, output in the output dtype,
        # and the computation inside in bfloat16.
        assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
        assert out.dtype == jnp.float32
        jaxpr = str(jax.make_jaxpr(lambda p: f.apply(p, None, x))(params))
        assert "bf16" in jaxpr
        assert hk.mixed_precision.get_policy(MLP) is policy
    finally:
        hk.mixed_precision.clear_policy(MLP)


def test_jmp_policy_and_jaxmp_policy_agree_on_casts():
    for text in ("p=f32,c=bf16,o=f32", "half", "c=f16"):
        ours, theirs = jaxmp.get_policy(text), jmp.get_policy(text)
        assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
            theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
        # Each library reads the other's printed form back to the same dtypes.
        assert jmp.get_policy(str(ours)) == theirs and jaxmp.get_policy(str(theirs)) == ours


def test_resolve_policy_parses_once_into_typed_objects():
    policy, recipe = jaxmp.resolve_policy("O2-fp16")
    assert isinstance(policy, jaxmp.Policy) and recipe.master_weights and recipe.loss_scale == "dynamic"
    policy, recipe = jaxmp.resolve_policy("p=f32,c=bf16")
    assert recipe is None and policy.compute_dtype == jnp.bfloat16
    policy, recipe = jaxmp.resolve_policy(jmp.get_policy("c=f16"))
    assert type(policy) is jaxmp.Policy and recipe is None
    with pytest.raises(ValueError, match="Unknown policy 'O9'"):
        jaxmp.resolve_policy("O9")


def test_loss_scales_are_registered_dataclasses_with_static_config():
    ls = jaxmp.DynamicLossScale(8.0, period=3, min_loss_scale=0.5)
    assert dataclasses.is_dataclass(ls)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2  # the scale and the counter; the configuration is static
    doubled = jax.tree_util.tree_map(lambda x: x * 2, ls)
    assert float(doubled.loss_scale) == 16.0 and doubled.period == 3 and doubled.min_loss_scale == 0.5
    assert jax.tree_util.tree_structure(jax.jit(lambda s: s)(ls)) == treedef
    assert len(jax.tree_util.tree_leaves(jaxmp.StaticLossScale(4.0))) == 1
    assert jax.tree_util.tree_leaves(jaxmp.NoOpLossScale()) == []


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_master_weights_and_unscale_and_skip_compose_into_loss_scaling():
    params = {"w": jnp.linspace(-1, 1, 8).astype(jnp.float16)}
    grads = [{"w": jnp.full(8, g, jnp.float16)} for g in (0.5, np.inf, 0.25, 1e-4)]
    composed = jaxmp.unscale_and_skip(jaxmp.master_weights(optax.adam(1e-2)), "static:8")
    convenience = jaxmp.loss_scaling(optax.adam(1e-2), "static:8", master_weights=True)
    out = []
    for tx in (composed, convenience):
        p, s = params, tx.init(params)
        for g in grads:
            u, s = tx.update(jax.tree_util.tree_map(lambda x: x * 8, g), s, p)
            p = jaxmp.apply_updates(p, u, s)
        out.append((p, s))
    (p1, s1), (p2, s2) = out
    assert np.array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))
    assert jax.tree_util.tree_structure(s1) == jax.tree_util.tree_structure(s2)
    assert isinstance(s1.inner_state, jaxmp.MasterWeightsState)
    assert int(jaxmp.skipped_steps(s1)) == 1
    assert jaxmp.master_params(s1)["w"].dtype == jnp.float32


def test_master_dtype_accepts_jmp_names():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True, master_dtype="f32")
    assert jaxmp.master_params(tx.init({"w": jnp.ones(2, jnp.bfloat16)}))["w"].dtype == jnp.float32
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True, master_dtype="bf16")
    assert jaxmp.master_params(tx.init({"w": jnp.ones(2, jnp.float16)}))["w"].dtype == jnp.bfloat16


def test_the_skip_decision_has_one_owner():
    import pathlib

    root = pathlib.Path(jaxmp.__file__).parent
    users = ["transform.py", "flax/train_state.py", "flax/nnx.py"]
    for rel in users:
        text = (root / rel).read_text()
        assert "keep_if_finite" in text, rel
        assert "select_tree(finite" not in text, rel
    assert "apply_if_finite" in (root / "skip.py").read_text()  # says why optax's does not fit


def test_layout_helpers_were_never_top_level():
    with pytest.raises(AttributeError):
        jaxmp.shard_state  # noqa: B018
