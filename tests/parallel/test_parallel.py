"""Data-parallel training on 8 simulated CPU devices: one device, pmap and sharded jit agree,
and every replica agrees on every skipped step."""

import functools
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests._support import _multiprocess_demo as demo

N = 8
GLOBAL_BATCH = 64
STEPS = 4
NAN_STEP = 2
NAN_REPLICA = 3


def _data(steps=STEPS, nan_step=NAN_STEP, nan_replica=NAN_REPLICA, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, GLOBAL_BATCH, demo.IN_DIM)).astype(np.float32)
    y = np.sin(x.sum(-1)).astype(np.float32)
    if nan_step is not None:
        # One example of one replica's shard: rows [r * 8, r * 8 + 8) go to replica r.
        x[nan_step, nan_replica * (GLOBAL_BATCH // N) + 1, 2] = np.nan
    return x, y


def _tx(opt, axis_name=None, initial_scale=2.0**15):
    inner = optax.sgd(0.05, momentum=0.9) if opt == "sgd" else optax.adam(1e-2)
    return jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(initial_scale, period=2), axis_name=axis_name)


# Steps are built once per configuration and reused across this module's tests (the `compiled`
# fixture): on the 2 shared CPU cores a compile costs seconds, a step milliseconds.
def _single_step(opt):
    tx = _tx(opt)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jaxmp.value_and_grad(lambda p: demo.loss_fn(p, batch), state)(params)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state, loss

    return tx, step


def _pmap_step(opt, tx_axis="batch"):
    tx = _tx(opt, tx_axis)
    return tx, jaxmp.parallel.make_pmap_train_step(demo.loss_fn, tx, "batch")


def _sharded_step(opt):
    tx = _tx(opt)
    return tx, jaxmp.parallel.make_sharded_train_step(demo.loss_fn, tx, jaxmp.parallel.make_data_mesh())


@pytest.fixture(scope="module")
def compiled():
    """This module's steps, built and compiled once per (path, optimizer): compiling is most of
    each test's cost."""
    return types.SimpleNamespace(single=functools.cache(_single_step), pmap=functools.cache(_pmap_step),
                                 sharded=functools.cache(_sharded_step))


def _single_device(compiled, opt, x, y):
    """The reference: what a user writes for one device (docs/design.md), on the whole global batch."""
    tx, step = compiled.single(opt)
    params = jax.device_put(demo.init_params(), jax.devices()[0])
    state = tx.init(params)
    for t in range(len(x)):
        params, state, _ = step(params, state, {"x": x[t], "y": y[t]})
    return jax.device_get(params), jax.device_get(jaxmp.scaling_stats(state))


def _pmap(compiled, opt, x, y, tx_axis="batch"):
    tx, step = compiled.pmap(opt, tx_axis)
    params = demo.init_params()
    p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
    history = []
    for t in range(len(x)):
        p, s, m = step(p, s, jaxmp.parallel.shard_batch({"x": x[t], "y": y[t]}))
        history.append((p, s, m))
    return p, s, history


def _sharded(compiled, opt, x, y):
    tx, step = compiled.sharded(opt)
    mesh = step.mesh
    params = demo.init_params()
    p, s = jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh)
    for t in range(len(x)):
        p, s, m = step(p, s, jaxmp.parallel.make_global_batch({"x": x[t], "y": y[t]}, mesh))
    return jax.device_get(p), jax.device_get(jaxmp.scaling_stats(s))


def _assert_rel_close(a, b, rtol=1e-6):
    for k in a:
        a_k, b_k = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        rel = np.linalg.norm(a_k - b_k) / np.linalg.norm(a_k)
        assert rel <= rtol, f"{k}: relative difference {rel:.3g} > {rtol}"


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("opt", [pytest.param("sgd", marks=pytest.mark.slow), "adam"])
def test_single_device_pmap_and_sharded_jit_train_to_the_same_params(compiled, opt):
    x, y = _data()  # includes a NaN in one replica's shard at step NAN_STEP: all three paths skip it
    ref, ref_stats = _single_device(compiled, opt, x, y)
    p, s, _ = _pmap(compiled, opt, x, y)
    pmap_params = jax.device_get(jaxmp.parallel.unreplicate(p))
    pmap_stats = jax.device_get(jaxmp.parallel.unreplicate(jaxmp.scaling_stats(s)))
    sharded, sharded_stats = _sharded(compiled, opt, x, y)
    _assert_rel_close(ref, pmap_params)
    _assert_rel_close(ref, sharded)
    for stats in (ref_stats, pmap_stats, sharded_stats):
        assert int(stats["total_skips"]) == 1
        assert float(stats["loss_scale"]) == float(ref_stats["loss_scale"])
    # Training moved the params (the comparison is not trivially between initial values).
    assert np.linalg.norm(ref["w1"] - demo.init_params()["w1"]) > 1e-3


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_nan_in_one_replica_makes_every_replica_skip_and_replicas_stay_bitwise_identical(compiled):
    x, y = _data(steps=5)
    p, s, history = _pmap(compiled, "adam", x, y)
    before, after = history[NAN_STEP - 1], history[NAN_STEP]
    finite = np.asarray(after[2]["last_step_finite"])
    assert finite.shape == (N,) and not finite.any(), "every replica must skip the step with the NaN"
    scale_before = np.asarray(jaxmp.scaling_stats(before[1])["loss_scale"])
    scale_after = np.asarray(jaxmp.scaling_stats(after[1])["loss_scale"])
    np.testing.assert_array_equal(scale_after, scale_before / 2)  # every replica backs off identically
    assert len(set(scale_after.tolist())) == 1
    # The skipped step left params and every optimizer leaf bitwise unchanged, on every replica.
    for a, b in zip(jax.tree_util.tree_leaves(after[0]), jax.tree_util.tree_leaves(before[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adam_before = jaxmp._scaling._opt_state.find_loss_scaling_state(before[1]).inner_state
    adam_after = jaxmp._scaling._opt_state.find_loss_scaling_state(after[1]).inner_state
    for a, b in zip(jax.tree_util.tree_leaves(adam_after), jax.tree_util.tree_leaves(adam_before)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    skips = np.asarray(jaxmp.scaling_stats(s)["total_skips"])
    np.testing.assert_array_equal(skips, np.ones(N, np.int32))
    assert np.asarray(history[-1][2]["last_step_finite"]).all()
    jaxmp.parallel.check_replicated((p, s))  # bitwise, params and the whole optimizer state


def test_pmap_verdict_agrees_even_with_a_transform_built_without_axis_name(compiled):
    # The check runs after the all-reduce, so the NaN reaches every replica anyway; axis_name on
    # loss_scaling only adds the fp32 pmin of the verdict on top.
    x, y = _data(steps=3)
    p, s, history = _pmap(compiled, "sgd", x, y, tx_axis=None)
    assert not np.asarray(history[NAN_STEP][2]["last_step_finite"]).any()
    jaxmp.parallel.check_replicated((p, s))


def _fp16_loss(policy):
    def loss_fn(params, batch):
        # Params stay float32 (the master copy); compute in float16, loss in float32.
        return demo.loss_fn(policy.cast_to_compute(params), policy.cast_to_compute(batch)).astype(jnp.float32)

    return loss_fn


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_fp16_compute_runs_on_both_paths_and_stays_close_to_fp32(compiled):
    policy = jaxmp.get_policy("params=float32,compute=float16,output=float32")
    loss_fn = _fp16_loss(policy)
    x, y = _data(steps=3, nan_step=None)
    params = demo.init_params()
    # Start at 2**10, not 2**15: 8 replicas' float16 gradient sum at 2**15 overflows (that case
    # is the next test); here every step must go through so the result can be compared to fp32.
    tx = _tx("adam", "batch", initial_scale=2.0**10)
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", reduce_dtype=jnp.float16)
    p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
    for t in range(3):
        p, s, m = step(p, s, jaxmp.parallel.shard_batch({"x": x[t], "y": y[t]}))
        assert np.isfinite(np.asarray(m["loss"])).all() and np.asarray(m["last_step_finite"]).all()
    jaxmp.parallel.check_replicated((p, s))
    assert jaxmp.parallel.unreplicate(p)["w1"].dtype == jnp.float32

    mesh = jaxmp.parallel.make_data_mesh()
    tx = _tx("adam", initial_scale=2.0**10)
    sstep = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh)
    q, r = jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh)
    for t in range(3):
        q, r, m = sstep(q, r, jaxmp.parallel.make_global_batch({"x": x[t], "y": y[t]}, mesh))
        assert bool(m["last_step_finite"])
    ref, _ = _single_device(compiled, "adam", x, y)
    for got in (jaxmp.parallel.unreplicate(p), q):
        for k in ref:
            np.testing.assert_allclose(np.asarray(got[k]), ref[k], atol=5e-3)


@pytest.mark.parametrize("reduce_dtype, overflows", [(jnp.float32, False), (jnp.float16, True)])
def test_fp16_all_reduce_overflow_is_caught_and_every_replica_backs_off(reduce_dtype, overflows):
    # Each replica's scaled gradient is 2**15 (fits float16), their sum 8 * 2**15 does not.
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15), axis_name="batch")
    params = {"w": jnp.ones(1)}
    step = jaxmp.parallel.make_pmap_train_step(lambda p, b: jnp.mean(b["x"] * p["w"]), tx, "batch",
                                      reduce_dtype=reduce_dtype)
    p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
    p, s, m = step(p, s, jaxmp.parallel.shard_batch({"x": np.ones((16, 1), np.float32)}))
    np.testing.assert_array_equal(np.asarray(m["last_step_finite"]), np.full(N, not overflows))
    # The scale this step used (the one that overflowed); the backed-off one is in the state.
    np.testing.assert_array_equal(np.asarray(m["loss_scale"]), np.full(N, 2.0**15, np.float32))
    np.testing.assert_array_equal(np.asarray(jaxmp.scaling_stats(s)["loss_scale"]),
                                  np.full(N, 2.0**14 if overflows else 2.0**15, np.float32))
    np.testing.assert_array_equal(np.asarray(p["w"]), np.full((N, 1), 1.0 if overflows else 0.9, np.float32))
    if overflows:
        # Backing off until the *sum* fits: 8 * 2**13 = 65536 still overflows float16 (max 65504),
        # 8 * 2**12 does not -- log2(8) = 3 skipped steps, all replicas in lockstep.
        for _ in range(3):
            p, s, m = step(p, s, jaxmp.parallel.shard_batch({"x": np.ones((16, 1), np.float32)}))
        np.testing.assert_array_equal(np.asarray(m["last_step_finite"]), np.full(N, True))
        np.testing.assert_array_equal(np.asarray(m["total_skips"]), np.full(N, 3))
        np.testing.assert_array_equal(np.asarray(m["loss_scale"]), np.full(N, 2.0**12, np.float32))
        np.testing.assert_allclose(np.asarray(p["w"]), np.full((N, 1), 0.9), rtol=1e-6)


def test_rng_gives_each_device_its_own_key_and_aux_comes_back():
    def loss_fn(params, batch, rng):
        noise = jax.random.uniform(rng, ())
        return jnp.mean(batch["x"] * params["w"]), noise

    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic", axis_name="batch")
    params = {"w": jnp.ones(1)}
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", has_aux=True)
    p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
    _, _, m = step(p, s, jaxmp.parallel.shard_batch({"x": np.ones((16, 1), np.float32)}), jax.random.key(0))
    assert len(set(np.asarray(m["aux"]).tolist())) == N  # different dropout-style keys per device
    mesh = jaxmp.parallel.make_data_mesh()
    sstep = jaxmp.parallel.make_sharded_train_step(loss_fn, jaxmp.loss_scaling(optax.sgd(0.1)), mesh, has_aux=True)
    q, r = jaxmp.parallel.replicate_on_mesh((params, jaxmp.loss_scaling(optax.sgd(0.1)).init(params)), mesh)
    q, r, m = sstep(q, r, {"x": np.ones((16, 1), np.float32)}, jax.random.key(0))
    assert np.asarray(m["aux"]).shape == ()


# ------------------------------------------------------------------------------------------
# Helpers and bad input.


def test_replicate_unreplicate_round_trip_and_replica_check():
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(3)}
    rep = jaxmp.parallel.replicate(tree)
    assert rep["w"].shape == (N, 2, 3) and rep["step"].shape == (N,)
    assert len(rep["w"].sharding.device_set) == N
    back = jaxmp.parallel.unreplicate(rep)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))
    assert back["step"].shape == () and int(back["step"]) == 3
    assert jaxmp.parallel._replication.is_replicated(rep) and not jaxmp.parallel._replication.is_replicated(tree)
    with pytest.raises(ValueError, match=r"leading replica axis of size 8"):
        jaxmp.parallel.check_replicated(tree)
    bad = np.asarray(rep["w"]).copy()
    bad[5, 1, 2] += 1.0
    with pytest.raises(ValueError, match=r"\['w'\] differs between replica 0 .* replica 5"):
        jaxmp.parallel.check_replicated({"w": bad})
    # NaNs with equal bits count as identical; a fully replicated mesh array is accepted too.
    jaxmp.parallel.check_replicated({"w": np.full((N, 2), np.nan, np.float32)})
    jaxmp.parallel.check_replicated(jaxmp.parallel.replicate_on_mesh(tree, jaxmp.parallel.make_data_mesh()))


def test_shard_batch_splits_evenly_logs_and_names_both_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="jaxmp.parallel"):
        out = jaxmp.parallel.shard_batch({"x": np.arange(48.0).reshape(24, 2), "y": np.arange(24)})
    assert out["x"].shape == (8, 3, 2) and out["y"].shape == (8, 3)
    np.testing.assert_array_equal(out["y"][1], [3, 4, 5])  # contiguous blocks, like the mesh split
    assert "per-device batch 3" in caplog.text
    np.testing.assert_array_equal(jaxmp.parallel._batching.unshard_batch(out)["y"], np.arange(24))
    with pytest.raises(ValueError, match=r"global batch size 20 is not divisible by the device count 8"):
        jaxmp.parallel.shard_batch({"x": np.zeros((20, 2))})
    with pytest.raises(ValueError, match=r"different leading"):
        jaxmp.parallel.shard_batch({"x": np.zeros((16, 2)), "y": np.zeros(8)})
    with pytest.raises(ValueError, match=r"20 is not divisible by the device count 8"):
        jaxmp.parallel.make_global_batch({"x": np.zeros((20, 2))}, jaxmp.parallel.make_data_mesh())
    assert jaxmp.parallel._batching.per_device_batch_size(512, 8) == 64  # the TPU case: 8 cores each see batch / 8


def test_process_slices():
    assert jaxmp.parallel.process_batch_slice(64) == slice(0, 64)  # one process here
    assert jaxmp.parallel.process_batch_slice(64, 3, 4) == slice(48, 64)
    with pytest.raises(ValueError, match=r"global batch \(over processes\) size 10 is not divisible by the device count 4"):
        jaxmp.parallel.process_batch_slice(10, 0, 4)
    assert [jaxmp.parallel.process_dataset_range(10, i, 3) for i in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 9)]
    assert [jaxmp.parallel.process_dataset_range(10, i, 3, drop_remainder=False) for i in range(3)] == [
        slice(0, 4), slice(4, 7), slice(7, 10)]
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        jaxmp.parallel.process_batch_slice(8, 2, 2)


def test_prefetch_puts_batches_on_devices():
    batches = [{"x": np.full((16, 3), i, np.float32)} for i in range(3)]
    got = list(jaxmp.parallel.prefetch_to_device(iter(batches), size=2))
    assert len(got) == 3 and got[2]["x"].shape == (N, 2, 3)
    assert len(got[0]["x"].sharding.device_set) == N and float(got[2]["x"][0, 0, 0]) == 2.0
    mesh = jaxmp.parallel.make_data_mesh()
    got = list(jaxmp.parallel._sharding.prefetch_to_mesh(iter(batches), mesh))
    assert got[1]["x"].shape == (16, 3) and got[1]["x"].sharding.spec == jax.sharding.PartitionSpec("data")


def test_pmap_step_rejects_unreplicated_or_divergent_state_and_unsharded_batch():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name="batch")
    params = {"w": jnp.ones(1)}
    loss_fn = lambda p, b: jnp.mean(b["x"] * p["w"])  # noqa: E731
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch")
    batch = jaxmp.parallel.shard_batch({"x": np.ones((16, 1), np.float32)})
    with pytest.raises(ValueError, match=r"params must have a leading axis of size 8 .* jaxmp.parallel.replicate"):
        step(params, jaxmp.parallel.replicate(tx.init(params)), batch)
    with pytest.raises(ValueError, match=r"batch must have a leading axis of size 8 .*jaxmp.parallel.shard_batch"):
        step(jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params)), {"x": np.ones((16, 1), np.float32)})
    diverged = np.ones((N, 1), np.float32)
    diverged[7] = 2.0
    with pytest.raises(ValueError, match=r"params is not replicated: leaf \['w'\] differs"):
        step({"w": diverged}, jaxmp.parallel.replicate(tx.init(params)), batch)


def test_unbound_or_mismatched_axis_names_raise_value_error():
    params = {"w": jnp.ones(1)}
    loss_fn = lambda p, b: jnp.mean(b["x"] * p["w"])  # noqa: E731
    batch = jaxmp.parallel.shard_batch({"x": np.ones((16, 1), np.float32)})
    with pytest.raises(ValueError, match=r"axis_name='batch' is not bound"):
        jaxmp.parallel.all_reduce_gradients({"w": jnp.ones(1)}, "batch")
    # loss_scaling built for another axis than the pmap's.
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name="devices")
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", check_replicas="never")
    with pytest.raises(ValueError, match=r"axis_name='devices' is not bound"):
        step(jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params)), batch)
    # An axis name under plain jit (sharded path): there is no axis to bind.
    mesh = jaxmp.parallel.make_data_mesh()
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name="data")
    sstep = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh)
    q, r = jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh)
    with pytest.raises(ValueError, match=r"axis_name='data' is not bound"):
        sstep(q, r, jaxmp.parallel.make_global_batch({"x": np.ones((16, 1), np.float32)}, mesh))
    with pytest.raises(ValueError, match=r"16 is not divisible|10 is not divisible"):
        jaxmp.parallel.make_sharded_train_step(loss_fn, jaxmp.loss_scaling(optax.sgd(0.1)), mesh)(
            q, r, {"x": np.ones((10, 1), np.float32)})


def test_argument_validation():
    tx = jaxmp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"reduce_dtype"):
        jaxmp.parallel.make_pmap_train_step(lambda p, b: 0.0, tx, reduce_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"reduce_dtype=float8_e4m3fn cannot hold gradients"):
        jaxmp.parallel.make_pmap_train_step(lambda p, b: 0.0, tx, reduce_dtype=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"grad_reduce_dtype"):  # one name for one setting: reduce_dtype
        jaxmp.parallel.make_pmap_train_step(lambda p, b: 0.0, tx, grad_reduce_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"check_replicas"):
        jaxmp.parallel.make_pmap_train_step(lambda p, b: 0.0, tx, check_replicas="sometimes")
    with pytest.raises(ValueError, match=r"axis_name must name"):
        jaxmp.parallel.make_pmap_train_step(lambda p, b: 0.0, tx, axis_name=None)
    with pytest.raises(ValueError, match=r"data_axis 'model' is not an axis"):
        jaxmp.parallel.make_sharded_train_step(lambda p, b: 0.0, tx, jaxmp.parallel.make_data_mesh(), data_axis="model")
    with pytest.raises(ValueError, match=r"host:port"):
        jaxmp.parallel.initialize_distributed("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"process_id 2 is out of range for num_processes=2"):
        jaxmp.parallel.initialize_distributed("127.0.0.1:1234", 2, 2)
    with pytest.raises(TypeError, match=r"num_processes must be an int"):
        jaxmp.parallel.initialize_distributed("127.0.0.1:1234", "2", 0)


def test_initialize_distributed_reads_environment(monkeypatch):
    monkeypatch.setenv("JAXMP_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    monkeypatch.setenv("JAXMP_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"JAXMP_NUM_PROCESSES='two' is not an integer"):
        jaxmp.parallel.initialize_distributed()
    monkeypatch.setenv("JAXMP_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXMP_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"process_id 5 is out of range for num_processes=2"):
        jaxmp.parallel.initialize_distributed()


def test_check_replicated_handles_prng_keys():
    state = jaxmp.parallel.replicate({"key": jax.random.key(0), "w": jnp.ones(2)})
    jaxmp.parallel.check_replicated(state)
    assert jaxmp.parallel._replication.is_replicated(state)


def test_an_integer_params_leaf_is_a_type_error_naming_it_on_both_paths():
    params = {"w": np.ones((4, 1), np.float32), "idx": np.arange(4, dtype=np.int32)}
    batch = {"x": np.ones((16, 4), np.float32), "y": np.ones(16, np.float32)}

    def loss_fn(p, b):
        return jnp.mean(((b["x"][:, p["idx"]] @ p["w"])[:, 0] - b["y"]) ** 2)

    message = r"params leaf at \['idx'\] has dtype int32: .*close over them in loss_fn, pass them in the batch"
    mesh = jaxmp.parallel.make_data_mesh()
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    step = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh)
    with pytest.raises(TypeError, match=message):
        step(*jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh), batch)
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch")
    with pytest.raises(TypeError, match=message):
        step(*jaxmp.parallel.replicate((params, tx.init(params))), jaxmp.parallel.shard_batch(batch))


_REUSE_DONATED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax, jaxmp
mesh = jaxmp.parallel.make_data_mesh()
tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
step = jaxmp.parallel.make_sharded_train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]), tx, mesh, donate=True)
params, state = jaxmp.parallel.replicate_on_mesh(({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)})), mesh)
batch = {"x": np.ones((8, 3), np.float32)}
new_params, new_state, _ = step(params, state, batch)
for args in ((params, state), (new_params, state)):  # the donated state again; then only its opt_state
    try:
        step(*args, batch)
    except ValueError as e:
        print("ValueError:", e)
new_params, new_state, _ = step(new_params, new_state, batch)  # the returned state still works
print("step ok", float(new_params["w"][0]))
"""


def test_a_donated_state_used_again_is_a_clear_error_not_a_segfault():
    # Issue 37, item 14: XLA:CPU crashed the process (SIGSEGV) on a deleted input buffer. Run in a
    # child process: before the fix the crash would take the test runner with it.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REUSE_DONATED], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ValueError: params leaf at ['w'] was donated to an earlier call of this step")
    assert "pass the params and opt_state the last call returned" in lines[0]
    assert lines[1].startswith("ValueError: opt_state leaf at ") and "donated" in lines[1]
    assert lines[2].startswith("step ok")
