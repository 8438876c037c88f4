"""jaxmp/_scaling/_opt_state.py: finding the loss-scaling state, reading it, applying updates, check_health's verdicts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._scaling._opt_state import (TrainingDivergedError, apply_updates, check_health, find_loss_scaling_state,
                             first_non_finite, get_loss_scale, master_params, scaling_stats)
from jaxmp._scaling._transform import NON_FINITE_GRADIENTS, NON_FINITE_LOSS, NON_FINITE_UPDATES

PARAMS = {"w": jnp.ones(2)}


def _state(loss_scale="dynamic", **kw):
    return jaxmp.loss_scaling(optax.sgd(0.1), loss_scale, **kw).init(PARAMS)


def _skipping(state, consecutive, reason, total=None):
    return state._replace(consecutive_skips=jnp.int32(consecutive), total_skips=jnp.int32(total or consecutive),
                          skip_reason=jnp.int32(reason), last_step_finite=jnp.array(consecutive == 0))


def test_find_loss_scaling_state_in_nested_containers_and_its_errors():
    s = _state()
    assert find_loss_scaling_state(s) is s
    assert find_loss_scaling_state({"a": [1, (s,)]}) is s
    ms = optax.MultiSteps(jaxmp.loss_scaling(optax.sgd(0.1)), 2).init(PARAMS)
    assert isinstance(find_loss_scaling_state(ms), jaxmp.LossScalingState)
    with pytest.raises(ValueError, match="no jaxmp.loss_scaling state found"):
        find_loss_scaling_state(optax.sgd(0.1).init(PARAMS))
    with pytest.raises(ValueError, match="found 2 jaxmp.loss_scaling states"):
        find_loss_scaling_state((s, _state()))


def test_get_loss_scale_passes_a_loss_scale_through_and_reads_a_state():
    ls = jaxmp.StaticLossScale(3.0)
    assert get_loss_scale(ls) is ls
    assert isinstance(get_loss_scale(jaxmp.NoOpLossScale()), jaxmp.NoOpLossScale)
    assert float(get_loss_scale(_state("static:8")).loss_scale) == 8.0
    assert isinstance(get_loss_scale(_state("none")), jaxmp.NoOpLossScale)


def test_readers_report_the_states_fields_with_their_dtypes():
    s = _skipping(_state("static:16"), 3, NON_FINITE_GRADIENTS, total=7)
    stats = scaling_stats(s)
    assert set(stats) == {"loss_scale", "last_step_finite", "consecutive_skips", "total_skips"}
    assert stats["loss_scale"].dtype == jnp.float32 and float(stats["loss_scale"]) == 16.0
    assert int(stats["consecutive_skips"]) == 3 and int(stats["total_skips"]) == 7
    assert not bool(stats["last_step_finite"])
    # The no-op scale's scale is reported as a float32 1.0 too (a logger sees one dtype).
    assert jax.jit(scaling_stats)(_state("none"))["loss_scale"].dtype == jnp.float32


def test_master_params_is_the_float32_copy_or_a_clear_error():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    state = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True).init(params)
    m = master_params(state)
    assert m["w"].dtype == jnp.float32 and m["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="master_weights=True"):
        master_params(_state())


def test_apply_updates_without_master_passes_integer_leaves_through():
    params = {"w": jnp.ones(2, jnp.bfloat16), "n": jnp.int32(5)}
    updates = {"w": jnp.full(2, 0.5, jnp.float32), "n": np.zeros((), jax.dtypes.float0)}
    out = apply_updates(params, updates)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].tolist() == [1.5, 1.5] and int(out["n"]) == 5


def test_apply_updates_with_master_returns_the_masters_cast_not_param_plus_update():
    tx = jaxmp.loss_scaling(optax.sgd(1e-4), "none", master_weights=True)
    params = {"w": jnp.ones(2, jnp.float16)}
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(3):
        updates, state = update({"w": jnp.ones(2, jnp.float16)}, state, params)
        params = apply_updates(params, updates, state)
    m = master_params(state)["w"]
    np.testing.assert_allclose(np.asarray(m), 1 - 3e-4, rtol=1e-6)
    assert params["w"].tolist() == m.astype(jnp.float16).tolist()


def test_apply_updates_refuses_a_transform_after_the_master_keeper():
    tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True), optax.scale(0.5))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    with pytest.raises(ValueError, match="1 transform\\(s\\) after the one keeping float32 master weights"):
        apply_updates(params, updates, state)


def test_first_non_finite_names_the_first_bad_leaf_in_tree_order():
    tree = {"a": jnp.ones(2), "b": {"c": jnp.array([1.0, jnp.inf]), "d": jnp.array([jnp.nan])},
            "i": jnp.int32(7)}
    assert first_non_finite(tree) == "['b']['c']"
    assert first_non_finite({"a": jnp.ones(2), "i": jnp.int32(7)}) is None
    assert first_non_finite({"z": jnp.array([complex(0, float("nan"))], jnp.complex64)}) == "['z']"


def test_check_health_is_silent_up_to_the_limit_and_raises_past_it():
    state = _skipping(_state(), 3, NON_FINITE_GRADIENTS)
    assert check_health(state, max_consecutive_skips=3) is None
    with pytest.raises(TrainingDivergedError, match="3 consecutive steps were skipped for non-finite gradients "
                                                    r"\(3 skipped in total\)"):
        check_health(state, max_consecutive_skips=2)
    assert issubclass(TrainingDivergedError, FloatingPointError)


@pytest.mark.parametrize("reason,what", [(NON_FINITE_LOSS, "the loss itself was inf/NaN"),
                                         (NON_FINITE_UPDATES, "non-finite updates"),
                                         (99, "non-finite gradients")])
def test_check_health_names_the_recorded_reason(reason, what):
    with pytest.raises(TrainingDivergedError, match=what):
        check_health(_skipping(_state(), 5, reason), max_consecutive_skips=1)


def test_check_health_says_whether_scaling_can_be_the_cause():
    with pytest.raises(TrainingDivergedError, match="No loss scaling is in use"):
        check_health(_skipping(_state("none"), 2, NON_FINITE_GRADIENTS), 1)
    floored = _state(jaxmp.DynamicLossScale(1.0, min_loss_scale=1.0))
    with pytest.raises(TrainingDivergedError, match=r"backed off to its floor \(1\)"):
        check_health(_skipping(floored, 2, NON_FINITE_GRADIENTS), 1)
    with pytest.raises(TrainingDivergedError, match="The loss scale is now 32768"):
        check_health(_skipping(_state(), 2, NON_FINITE_GRADIENTS), 1)


def test_check_health_names_the_leaf_and_the_culprit_and_survives_a_failing_locator():
    state = _skipping(_state(), 2, NON_FINITE_GRADIENTS)
    grads = {"a": jnp.ones(1), "b": jnp.array([jnp.nan])}
    with pytest.raises(TrainingDivergedError, match=r"first non-finite leaf is \['b'\]\. Culprit: dense_3 exp\."):
        check_health(state, 1, tree=grads, locate=lambda: "dense_3 exp")

    def broken():
        raise RuntimeError("no batch")

    with pytest.raises(TrainingDivergedError, match=r"locating the culprit failed: RuntimeError: no batch"):
        check_health(state, 1, locate=broken)
    with pytest.raises(TypeError, match="function of no arguments, got str"):
        check_health(state, 1, locate="dense_3")
    calls = []
    check_health(_state(), 1, locate=lambda: calls.append(1))
    assert calls == []  # a healthy run never pays for the locator


def test_check_health_reads_every_replica_of_a_replicated_state():
    state = _skipping(_state(), 0, 0)
    n = 4
    rep = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), state)
    rep = rep._replace(consecutive_skips=jnp.array([0, 0, 6, 0], jnp.int32),
                       skip_reason=jnp.array([0, 0, NON_FINITE_LOSS, 0], jnp.int32))
    with pytest.raises(TrainingDivergedError, match="6 consecutive.*the loss itself"):
        check_health(rep, 5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
def test_check_health_refuses_a_bad_limit(bad):
    with pytest.raises(ValueError, match="max_consecutive_skips must be an int >= 1"):
        check_health(_state(), bad)


def test_check_health_reads_the_loss_scale_out_of_the_located_culprit():
    # What a culprit located at the run's scale says about that scale (issue 60, item 4); the
    # measurement itself is tests/diagnostics/test_loss_scale_cause.py's.
    import re

    from jaxmp.diagnostics import NonFiniteCulprit

    def culprit(**kw):
        return NonFiniteCulprit(True, "dot_general", "Net/head", "run.py:1:1 (f)", True, ("f16", "f16"), ("f16",),
                                (1024.0, 437.5), 65504.0, "inf", "half list", **kw)

    state = _skipping(_state(), 2, NON_FINITE_GRADIENTS)  # a dynamic scale, now 32768
    with pytest.raises(TrainingDivergedError) as e:
        check_health(state, 1, locate=lambda: culprit(loss_scale=32768.0, fits_scale=1024.0))
    message = str(e.value)
    assert "The loss scale 32768 overflows float16" in message and "learning rate" not in message
    code = re.search(r"jaxmp\.loss_scaling\(tx, jaxmp\.DynamicLossScale\(([\d.]+)\)\)", message)
    assert code and float(code.group(1)) == 128.0, message
    tx = eval(code.group(0), {"jaxmp": jaxmp, "tx": optax.sgd(0.1)})  # noqa: S307 - the message's own code
    assert float(jaxmp.get_loss_scale(tx.init({"w": jnp.ones(2)})).loss_scale) == 128.0
    # Measured to overflow unscaled too: the scale is not the cause, the usual fixes stay.
    with pytest.raises(TrainingDivergedError, match="overflows unscaled too, so lowering the loss scale cannot help"
                       r".*lower the learning rate"):
        check_health(state, 1, locate=lambda: culprit(loss_scale=32768.0, fits_scale=0.0))
    # Located at another seed than the run's scale: the message says which scale to pass.
    with pytest.raises(TrainingDivergedError, match=r"at a loss scale of 1, where this step is finite, but the run's "
                                                    r"scale is 32768: pass loss_scale=jaxmp\.get_loss_scale"):
        check_health(state, 1, locate=lambda: NonFiniteCulprit(False, loss_scale=1.0))
