"""jaxmp/parallel/_pmap.py: make_pmap_train_step's own contract: arguments, the per-call checks, the
device subset, model state and the re-labelled input layout (end-to-end agreement is in test_parallel.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp.parallel import make_pmap_train_step, replicate, shard_batch, unreplicate

N = jax.local_device_count()


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _tx():
    return jaxmp.loss_scaling(optax.sgd(0.1), "none", axis_name="batch")


def _batch(n=N, size=16):
    return shard_batch({"x": np.ones((size, 2), np.float32), "y": np.ones(size, np.float32)}, n)


def test_refuses_a_non_callable_loss_and_a_non_transformation():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        make_pmap_train_step("loss", _tx())
    with pytest.raises(TypeError, match="tx must be an optax GradientTransformation"):
        make_pmap_train_step(_loss, optax.sgd)


DEVS = jax.local_devices()[:2]
TRACES = []


@pytest.fixture(scope="module")
def step2():
    """One step on two devices (checks on the first call), shared: each step built compiles anew."""

    def loss(p, b):
        TRACES.append(1)  # a Python side effect: runs once per trace
        return _loss(p, b)

    return make_pmap_train_step(loss, _tx(), devices=DEVS)


def test_one_sgd_step_on_a_device_subset_equals_the_hand_computed_update(step2):
    assert step2.num_devices == 2 and callable(step2.pmapped) and callable(step2.pmapped_with_rng)
    params = {"w": jnp.zeros(2)}
    p, s, m = step2(replicate(params, DEVS), replicate(_tx().init(params), DEVS), _batch(2))
    # loss = mean((0 - 1)^2) = 1; grad w = mean(2 * (x.w - y) * x) = -2 per component; w = 0 + 0.1 * 2.
    np.testing.assert_allclose(np.asarray(unreplicate(p)["w"]), [0.2, 0.2], rtol=1e-6)
    assert m["loss"].shape == (2,) and float(m["loss"][0]) == 1.0 and bool(m["last_step_finite"][0])
    assert sorted(m) == ["consecutive_skips", "last_step_finite", "loss", "loss_scale", "total_skips"]
    # Inputs laid out over replicate's own axis name are re-labelled, not traced and compiled again.
    p, s, _ = step2(replicate(unreplicate(p), DEVS), replicate(unreplicate(s), DEVS), _batch(2))
    step2(p, s, _batch(2))
    assert len(TRACES) == 1


def test_check_replicas_first_always_and_never(step2):
    params, tx = {"w": jnp.zeros(2)}, _tx()
    good, opt = replicate(params, DEVS), replicate(tx.init(params), DEVS)
    diverged = {"w": np.zeros((2, 2), np.float32)}
    diverged["w"][1, 0] = 1.0
    step2(good, opt, _batch(2))
    step2(diverged, opt, _batch(2))  # "first": checked on the first call only
    always = make_pmap_train_step(_loss, tx, check_replicas="always", devices=DEVS)
    always(good, opt, _batch(2))
    with pytest.raises(ValueError, match=r"params is not replicated: leaf \['w'\] differs .* replica 1"):
        always(diverged, opt, _batch(2))
    never = make_pmap_train_step(_loss, tx, check_replicas="never", devices=DEVS)
    never(diverged, opt, _batch(2))
    with pytest.raises(ValueError, match="batch must have a leading axis"):  # the cheap check still runs
        never(diverged, opt, _batch(N))


def test_a_wrongly_sized_opt_state_is_named_with_its_remedy(step2):
    params, tx = {"w": jnp.zeros(2)}, _tx()
    with pytest.raises(ValueError, match=r"opt_state must have a leading axis of size 2.*found leading sizes"
                                         r".*replicate\(tx.init\(params\)\)"):
        step2(replicate(params, DEVS), tx.init(params), _batch(2))


def test_model_state_is_averaged_over_replicas_and_threaded():
    tx = _tx()

    def loss(p, state, b):
        mean = jnp.mean(b["x"])  # each replica sees its own shard
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {"count": state["count"] + 1.0, "mean": mean}

    step = make_pmap_train_step(loss, tx, model_state=True, devices=DEVS)
    params = {"w": jnp.zeros(2)}
    x = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 3.0], [3.0, 3.0]], np.float32)  # shard means 0 and 3
    batch = shard_batch({"x": x, "y": np.ones(4, np.float32)}, 2)
    state = replicate({"count": jnp.float32(0.0), "mean": jnp.float32(0.0)}, DEVS)
    p, new_state, s, m = step(replicate(params, DEVS), state, replicate(tx.init(params), DEVS), batch)
    assert np.asarray(new_state["count"]).tolist() == [1.0, 1.0]
    assert np.asarray(new_state["mean"]).tolist() == [1.5, 1.5]  # the replicas' mean
