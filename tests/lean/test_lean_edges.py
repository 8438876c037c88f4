"""The edges of jaxmp.lean's quantized moments (issue 59): an older checkpoint is refused by name at
restore rather than decoded with other maps; a NaN gradient leaves a NaN absmax; float16 moments
quantize and fp8 ones are refused by name; an unused key is said; a state that lost its grid or
its map revision is named with the restore target to use.
"""

import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import _formats, _tree, lean
from jaxmp._misuse import MixedPrecisionWarning
from tests._support._arrays import leaf_bytes

pytestmark = pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(64, 128)), dtype), "b": jnp.asarray(rng.normal(size=128), dtype)}


def _grads(params, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


# ----------------------------------------------------------------------------------- item 1: restore


class _Revision1State(NamedTuple):
    """QuantizedMomentsState's fields before ``map_revision``: the tree an older checkpoint holds
    (orbax records a NamedTuple by its field names; the static grid as an empty node)."""

    inner_state: Any
    absmax: Any
    key: Any
    count: Any
    grid: Any


def _as_revision_1(opt_state):
    is_q = lambda x: isinstance(x, lean.QuantizedMomentsState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: _Revision1State(*x[:5]) if is_q(x) else x, opt_state, is_leaf=is_q)


@pytest.mark.slow  # orbax's first save and restore: seconds
def test_a_checkpoint_written_before_the_map_revision_is_refused_by_name_not_decoded_with_other_maps(tmp_path):
    """An 8-bit state saved by jaxmp before its maps became the peers' (no map_revision leaf)
    restored into the targets the docs use: docs/guides/checkpointing.md's
    `jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, "zero")`, a plain
    `jax.eval_shape(tx.init, params)`, and the experiments' checkpointer. Each refuses it,
    naming map_revision; the target's static grid would otherwise have decoded its codes with
    the new maps (one ulp off at 22 signed and 26 unsigned entries), silently. A checkpoint of
    today's state restores into the same targets bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from experiments import checkpoint as ckpt_lib

    params = _params()
    tx = jaxmp.loss_scaling(lean.quantized_moments(optax.adamw(1e-2)), "none")
    mesh = jaxmp.parallel.make_data_mesh()
    state = tx.init(params)
    for seed in (1, 2):
        updates, state = tx.update(_grads(params, seed), state, params)
        params = jaxmp.apply_updates(params, updates, state)
    q = _tree.find_states(state, lean.QuantizedMomentsState)[0]
    assert q.inner_state[0].mu["w"].dtype == jnp.uint8 and int(q.map_revision) == _formats.MAP_REVISION
    old, new = {"params": params, "opt_state": _as_revision_1(state)}, {"params": params, "opt_state": state}
    target_p, target_s = jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, "zero")
    targets = [{"params": target_p, "opt_state": target_s},
               jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})]
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "old", old)
        ckptr.save(tmp_path / "new", new)
        ckptr.wait_until_finished()
        for target in targets:
            with pytest.raises(ValueError, match=r"map_revision"):
                ckptr.restore(tmp_path / "old", target)
            assert leaf_bytes(ckptr.restore(tmp_path / "new", target)) == leaf_bytes(new)

    expected = {"policy": "O2-bf16", "loss_scale": "none", "master_weights": False, "engine": "jaxmp", "seed": 0,
                "model": "mlp", "dataset": "digits", "global_batch_size": 32, "num_train_steps": 10}
    for name, saved in (("old", old), ("new", new)):
        ckpt = ckpt_lib.Checkpointer(str(tmp_path / f"experiments_{name}"))
        ckpt.save(1, saved, {**expected, "data_position": 1, "history": []})
        template = {"params": params, "opt_state": tx.init(params)}
        if name == "old":
            with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"map_revision"):
                ckpt.restore_latest(template, expected)
        else:
            assert leaf_bytes(ckpt.restore_latest(template, expected).state) == leaf_bytes(new)
        ckpt.close()


REVISION_1 = Path(__file__).parent / "data" / "revision1_checkpoint"


@pytest.mark.slow  # orbax restores and a jitted step: ~10 s on 2 busy cores
def test_a_checkpoint_written_by_jaxmp_of_map_revision_1_is_refused_and_its_params_start_afresh():
    """The checkpoint in tests/lean/data/revision1_checkpoint was written by jaxmp of commit
    3c6e54e^ itself (tests/lean/data/write_revision1_checkpoint.py), not by a stand-in for its
    state: an 8-bit Adam state after two steps, whose codes index NumPy's maps. Restored into
    today's target it is refused naming map_revision; decoded with today's maps, 438 first- and
    382 second-moment values would have moved by an ulp, silently. What docs/lean-recipes.md
    says to do instead runs: the params restored without a target, the moments started afresh."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from tests.lean.test_lean_quantized import _np_dynamic_map

    tx = lean.quantized_moments(optax.adam(1e-2))
    params = {"w": jnp.zeros((64, 64), jnp.float32)}
    mesh = jaxmp.parallel.make_data_mesh()
    target_p, target_s = jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, "zero")
    with ocp.StandardCheckpointer() as ckptr:
        for target in (jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)}),
                       {"params": target_p, "opt_state": target_s}):
            with pytest.raises(ValueError, match=r"map_revision"):
                ckptr.restore(REVISION_1, target)
        raw = ckptr.restore(REVISION_1)     # no target: plain arrays, as written
    old = raw["opt_state"]
    assert "map_revision" not in old and old["inner_state"][0]["mu"]["w"].dtype == np.uint8
    moved = []
    for field, signed in (("mu", True), ("nu", False)):
        codes = np.asarray(old["inner_state"][0][field]["w"]).reshape(-1)
        revision_1, today = _np_dynamic_map(signed, 7, 8), _formats.code_map(8, signed)
        moved.append(int((revision_1 != today)[codes].sum()))
    assert moved == [438, 382]
    restored = {"w": jnp.asarray(raw["params"]["w"])}
    state = tx.init(restored)                # the moments afresh, the params kept
    updates, state = jax.jit(tx.update)(_grads(restored), state)
    assert bool(jnp.isfinite(updates["w"]).all()) and int(state.map_revision) == _formats.MAP_REVISION


# ----------------------------------------------------------------------------------- item 8: NaN blocks


@pytest.mark.parametrize("slice_size", [None, 4096])   # whole leaves; a slice at a time (_chunked)
def test_a_nan_gradient_leaves_its_blocks_absmax_nan_so_a_state_check_sees_it(slice_size):
    params = _params()
    tx = lean.quantized_moments(optax.adam(1e-3), slice_size=slice_size)
    state = tx.init(params)
    grads = _grads(params)
    bad = {**grads, "w": grads["w"].at[3, 5].set(jnp.nan).at[40, 0].set(jnp.inf)}
    update = jax.jit(tx.update)
    updates, poisoned = update(bad, state)
    _, clean = update(grads, state)
    assert bool(jnp.isnan(updates["w"]).any())
    adam, absmax, clean_absmax = poisoned.inner_state[0], poisoned.absmax[0], clean.absmax[0]
    # (64, 128) at block 256: flattened blocks of two rows; [3, 5] is in block 1, [40, 0] in block 20.
    for field in ("mu", "nu"):
        a = np.asarray(getattr(absmax, field)["w"])
        assert np.isnan(a[[1, 20]]).all() and np.isfinite(np.delete(a, [1, 20])).all()
        np.testing.assert_array_equal(np.delete(a, [1, 20]), np.delete(np.asarray(getattr(clean_absmax, field)["w"]),
                                                                       [1, 20]))
        decoded = _formats.Grid(8, 256).dequantize(getattr(adam, field)["w"], getattr(absmax, field)["w"],
                                                     field == "mu", (64, 128)).reshape(32, 256)
        assert np.isnan(np.asarray(decoded)[[1, 20]]).all()
    # What a state check reads: not every leaf of the stored state is finite.
    assert not all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(poisoned.absmax))


# ----------------------------------------------------------------------------------- item 9: dtypes


def test_float16_moments_quantize_and_fp8_moments_are_refused_by_name_with_a_way_out_that_runs():
    params = _params(jnp.float16)
    tx = lean.quantized_moments(optax.adam(1e-3))
    state = tx.init(params)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.uint8 and adam.nu["w"].dtype == jnp.uint8      # were float16
    assert adam.mu["b"].dtype == jnp.float16 and state.absmax[0].mu["w"].shape == (32,)
    updates, state = jax.jit(tx.update)(_grads(params), state)
    assert bool(jnp.isfinite(updates["w"]).all()) and state.inner_state[0].mu["w"].dtype == jnp.uint8

    fp8 = {"w": params["w"].astype(jnp.float8_e4m3fn), "b": params["b"]}
    with pytest.raises(ValueError, match=r"fp8 moments \(\[0\]\.mu\['w'\] \(float8_e4m3fn\), \[0\]\.nu\['w'\].*"
                                         r"master_weights=True"):
        tx.init(fp8)
    # The message's way out: float32 masters, whose moments quantize.
    inner = optax.adam(1e-3)
    tx = jaxmp.loss_scaling(jaxmp.lean.quantized_moments(inner), 'none', master_weights=True)
    state = tx.init(fp8)
    updates, state = jax.jit(tx.update)(jax.tree_util.tree_map(jnp.ones_like, fp8), state, fp8)
    assert _tree.find_states(state, lean.QuantizedMomentsState)[0].inner_state[0].mu["w"].dtype == jnp.uint8
    assert jaxmp.apply_updates(fp8, updates, state)["w"].dtype == jnp.float8_e4m3fn


# ----------------------------------------------------------------------------------- item 10: unused key


def test_a_key_that_draws_nothing_is_said_to_be_unused():
    inner = optax.adam(1e-3)
    cases = [(lambda: lean.quantized_moments(inner, key=7), r"quantized_moments: key=7 is unused"),
             (lambda: lean.preset("remainders-8bit", inner, key=0),
              r"preset\('remainders-8bit'\): key=0 is unused.*Drop key=; the presets that round stochastically: "
              r"masters-bf16-moments, sr-params"),
             (lambda: lean.preset("remainders", inner, key=0), r"preset\('remainders'\): key=0 is unused"),
             (lambda: lean.bf16_moments(inner, key=0, rounding="nearest"), r"bf16_moments: key=0 is unused"),
             (lambda: lean.bf16_params(inner, key=0, rounding="nearest"), r"bf16_params: key=0 is unused")]
    for make, pattern in cases:
        with pytest.warns(MixedPrecisionWarning, match=pattern) as caught:
            tx = make()
        assert caught[0].filename == __file__ and tx is not None    # points at the call
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a key that is used, or none: nothing said
        lean.quantized_moments(inner, key=7, rounding="stochastic")
        lean.quantized_moments(inner)
        lean.preset("bf16-sr-8bit", inner, key=0)
        lean.preset("remainders-8bit", inner)
    with pytest.warns(MixedPrecisionWarning):
        state = lean.quantized_moments(inner, key=7).init(_params())
    assert leaf_bytes(state.key) == leaf_bytes(jnp.zeros(2, jnp.uint32))   # nearest keeps no key


# ----------------------------------------------------------------------------------- item 11: lost grid


def test_a_state_that_lost_its_grid_or_map_revision_is_named_with_the_restore_target():
    params = _params()
    tx = lean.quantized_moments(optax.adam(1e-3))
    state = tx.init(params)
    grads = _grads(params)
    target = r"restore into the structure of the optimizer's own init.*jax\.eval_shape\(tx\.init, params\).*" \
             r"jaxmp\.parallel\.abstract_state\(\(params, tx\.init\(params\)\), mesh, layout\)"
    lost_grid = state._replace(grid=None)
    for run in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError, match=r"QuantizedMomentsState\.grid is None.*" + target):
            run(grads, lost_grid)
    with pytest.raises(ValueError, match=r"grid is None"):
        jaxmp.parallel.shard_state((params, lost_grid), jaxmp.parallel.make_data_mesh(), "zero")
    # A hand-written rebuild that leaves map_revision out (its default), or gives another revision.
    rebuilt = lean.QuantizedMomentsState(state.inner_state, state.absmax, state.key, state.count, state.grid)
    with pytest.raises(ValueError, match=r"map_revision is None.*cannot be resumed by this jaxmp"):
        jax.jit(tx.update)(grads, rebuilt)
    with pytest.raises(ValueError, match=r"map_revision is 1: its codes index code maps of another revision"):
        tx.update(grads, state._replace(map_revision=jnp.int32(1)))
    # The target the message names restores what the state holds, grid and revision included.
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax.eval_shape(tx.init, params)),
                                            jax.tree_util.tree_leaves(state))
    assert restored.grid == state.grid and leaf_bytes(tx.update(grads, restored)) == leaf_bytes(tx.update(grads, state))
