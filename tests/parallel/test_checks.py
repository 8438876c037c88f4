"""Unit tests of jaxmp.parallel._checks: the input checks and helpers the pmap and sharded steps share."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.parallel import _checks


def test_log_once_logs_each_distinct_text_once(caplog, monkeypatch):
    monkeypatch.setattr(_checks, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="jaxmp.parallel"):
        for _ in range(3):
            _checks.log_once("per-device batch %d", 4)
        _checks.log_once("per-device batch %d", 8)
        _checks.log_once("no args %s")  # no args: the text as given, not %-formatted
    assert [r.getMessage() for r in caplog.records] == ["per-device batch 4", "per-device batch 8", "no args %s"]


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2)])
def test_check_positive_int_returns_a_python_int(value):
    out = _checks.check_positive_int(value, "steps")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value, error, match", [
    (True, TypeError, r"steps must be an int, got bool"),
    (2.0, TypeError, r"steps must be an int, got float: 2.0"),
    ("4", TypeError, r"got str"),
    (0, ValueError, r"steps must be >= 1, got 0"),
    (-3, ValueError, r"got -3"),
])
def test_check_positive_int_rejects_non_ints_and_non_positive(value, error, match):
    with pytest.raises(error, match=match):
        _checks.check_positive_int(value, "steps")


def test_leading_size_is_the_common_batch_size():
    assert _checks.leading_size({"x": jnp.ones((6, 2)), "y": [np.zeros(6), np.zeros((6, 1, 1))]}) == 6
    assert _checks.leading_size(jnp.ones((3,))) == 3  # a bare array is a one-leaf batch


def test_leading_size_names_every_differing_leaf():
    with pytest.raises(ValueError, match=r"batch leaves have different leading \(batch\) sizes: "
                                         r"\['a'\]: 4, \['b'\]: 5"):
        _checks.leading_size({"a": np.zeros((4, 2)), "b": np.zeros(5)})
    # a bare scalar batch: its path is empty
    with pytest.raises(ValueError, match=r"x leaf at  is a scalar"):
        _checks.leading_size(np.float32(1.0), what="x")
    with pytest.raises(ValueError, match=r"the batch has no array leaves"):
        _checks.leading_size({})


@pytest.mark.parametrize("batch, devices, per", [(8, 8, 1), (64, 8, 8), (3, 1, 3)])
def test_check_divisible_gives_the_per_device_size(batch, devices, per):
    assert _checks.check_divisible(batch, devices) == per


def test_check_divisible_suggests_the_nearest_sizes():
    with pytest.raises(ValueError, match=r"global batch size 30 is not divisible by the device count 8: .* use 24 or 32"):
        _checks.check_divisible(30, 8)
    # below one per device there is no smaller valid size to suggest
    with pytest.raises(ValueError, match=r"eval batch size 5 is not divisible .* use 8 \(or a multiple of it\)"):
        _checks.check_divisible(5, 8, what="eval batch")
    with pytest.raises(ValueError, match=r"need at least one device, got 0"):
        _checks.check_divisible(8, 0)


def test_check_not_donated_names_the_deleted_leaf():
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    opt_state = (jnp.zeros(3), {"mu": jnp.zeros(3)}, None, 1.0)
    _checks.check_not_donated(params, opt_state)  # nothing deleted: no error
    opt_state[1]["mu"].delete()
    with pytest.raises(ValueError, match=r"opt_state leaf at \[1\]\['mu'\] was donated .* donate=False"):
        _checks.check_not_donated(params, opt_state)
    params["b"].delete()  # params are checked first
    with pytest.raises(ValueError, match=r"params leaf at \['b'\] was donated"):
        _checks.check_not_donated(params, opt_state)


def test_with_model_state_splits_and_joins_the_params_state_pair():
    seen = []

    def run(params, opt_state, batch, rng):
        seen.append((params, opt_state, batch, rng))
        return (params[0] + 1, params[1] * 2), opt_state, {"loss": 0}

    assert _checks.with_model_state(run, False) is run
    step = _checks.with_model_state(run, True)
    out = step(1, 10, "opt", "batch")
    assert out == (2, 20, "opt", {"loss": 0})
    assert seen == [((1, 10), "opt", "batch", None)]  # rng defaults to None
    step(1, 10, "opt", "batch", "key")
    assert seen[-1][3] == "key"


@pytest.mark.standard_promotion(reason="optax's Adam")
def test_an_abstract_state_handed_to_a_step_is_refused_naming_what_to_pass():
    """Issue 60 item 8: abstract_state's ShapeDtypeStructs into a step, instead of JAX's "not a valid JAX type"."""
    import jax
    import optax

    import jaxmp

    tx = jaxmp.loss_scaling(optax.adam(1e-3), "dynamic", axis_name=None)
    loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    params, batch = {"w": jnp.ones((4, 2))}, np.ones((8, 4), np.float32)
    mesh = jaxmp.parallel.make_data_mesh()
    step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout="zero")
    target = jaxmp.parallel.abstract_state((params, tx.init(params)), step.layout)
    message = (r"params leaf at \['w'\] is a jax.ShapeDtypeStruct.*restored = ckptr.restore\(path.*"
               r"jaxmp.parallel.shard_state\(\(params, tx.init\(params\)\), step.layout\)")
    with pytest.raises(TypeError, match=message):
        step(*target, batch)
    # The way out the message names runs, and a step that ran once still refuses the abstract state.
    p, s, _ = step(*jaxmp.parallel.shard_state((params, tx.init(params)), step.layout), batch)
    with pytest.raises(TypeError, match="jax.ShapeDtypeStruct"):
        step(p, target[1], batch)
    pmapped = jaxmp.parallel.make_pmap_train_step(loss, tx)
    rep = jaxmp.parallel.replicate((params, tx.init(params)))
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rep)
    with pytest.raises(TypeError, match=r"opt_state leaf at .* is a jax.ShapeDtypeStruct"):
        pmapped(rep[0], abstract[1], jaxmp.parallel.shard_batch(batch, jax.local_device_count()))


def _specs(tree):
    import jax

    return [{"path": jax.tree_util.keystr(k), "shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)}
            for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_a_restore_target_of_another_state_is_named_array_by_array():
    """Issue 60 item 8: what a restore raises for a wrong target, in place of orbax's tree diff."""
    import optax

    import jaxmp

    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    tx = jaxmp.loss_scaling(optax.adam(1e-3), "dynamic", master_weights=True)
    saved = _specs({"params": params, "opt_state": tx.init(params)})
    assert _checks.target_mismatch_error(saved, saved) is None
    # The target of another optimizer (no masters, no moments): the saved arrays it lacks, named.
    other = jaxmp.loss_scaling(optax.sgd(1e-3), "dynamic")
    err = _checks.target_mismatch_error(saved, _specs({"params": params, "opt_state": other.init(params)}),
                                        where="/ckpt/step_3")
    assert isinstance(err, ValueError)
    text = str(err)
    assert "does not match /ckpt/step_3" in text and "saved arrays the target lacks" in text
    assert "['opt_state'].inner_state" in text and "and " in text  # the first three, then a count
    assert "jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, layout)" in text
    # Params cast to bfloat16 for the target: each differing array with both specs.
    half = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
    err = _checks.target_mismatch_error(saved, _specs({"params": half, "opt_state": tx.init(params)}))
    assert "['params']['w'] saved float32[4, 2], the target's bfloat16[4, 2]" in str(err)
    # Orbax's spelling of a path differs from keystr's: a shared "key" is matched when given.
    keyed = [dict(s, key=s["path"].replace("'", ""), path="orbax" + s["path"]) for s in saved]
    assert _checks.target_mismatch_error(keyed, [dict(s, key=s["path"].replace("'", "")) for s in saved]) is None
