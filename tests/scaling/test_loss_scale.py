"""Loss scales: exact trajectories, torch parity, pytree round trips, float32 scale, fp16 underflow."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp


def _reference(seq, scale, period, factor, backoff, lo, hi):
    """The documented rule, transcribed in plain Python floats (float32-rounded)."""
    counter, out = 0, []
    for finite in seq:
        if finite:
            counter += 1
            if counter == period:
                counter = 0
                new = float(np.float32(min(scale * factor, hi)))
                if math.isfinite(new):
                    scale = new
        else:
            counter = 0
            scale = float(np.float32(max(scale * backoff, lo)))
        out.append(scale)
    return out


def _torch_grad_scaler(seq, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
    """torch.amp.GradScaler's `_amp_update_scale_` (aten/src/ATen/native/cuda/AmpKernels.cu)."""
    tracker, out = 0, []
    for finite in seq:
        if not finite:
            scale = float(np.float32(scale * backoff))
            tracker = 0
        else:
            successful = tracker + 1
            if successful == interval:
                new = float(np.float32(scale * growth))
                if math.isfinite(new):
                    scale = new
                tracker = 0
            else:
                tracker = successful
        out.append(scale)
    return out


def _run(ls, seq):
    adjust = jax.jit(lambda s, f: s.adjust(f))
    out = []
    for finite in seq:
        ls = adjust(ls, jnp.asarray(finite))
        out.append(float(ls.loss_scale))
    return out, ls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scripted_trajectory_matches_documented_rule(seed):
    rng = np.random.default_rng(seed)
    seq = list(rng.random(400) < 0.85)
    ls = jaxmp.DynamicLossScale(2.0**10, period=5, factor=2.0, min_loss_scale=2.0, max_loss_scale=2.0**13)
    got, _ = _run(ls, seq)
    assert got == _reference(seq, 2.0**10, 5, 2.0, 0.5, 2.0, 2.0**13)
    # The run above must have exercised both clamps.
    assert min(got) == 2.0 or max(got) == 2.0**13


def test_grows_after_exactly_period_finite_steps_and_backs_off():
    ls = jaxmp.DynamicLossScale(8.0, period=3, factor=2.0)
    got, _ = _run(ls, [True, True, True, True, True, False, True])
    assert got == [8.0, 8.0, 16.0, 16.0, 16.0, 8.0, 8.0]


def test_min_and_max_clamping():
    got, _ = _run(jaxmp.DynamicLossScale(4.0, period=1, min_loss_scale=1.0, max_loss_scale=16.0),
                  [False, False, False, True, True, True, True])
    assert got == [2.0, 1.0, 1.0, 2.0, 4.0, 8.0, 16.0]
    got, _ = _run(jaxmp.DynamicLossScale(3.0, period=1, max_loss_scale=5.0), [True, True])
    assert got == [5.0, 5.0]  # clamped to the cap, never past it


def test_growth_never_produces_non_finite_scale():
    big = float(np.finfo(np.float32).max) / 1.5
    ls = jaxmp.DynamicLossScale(big, period=1, max_loss_scale=math.inf)
    got, ls = _run(ls, [True] * 5)
    assert all(math.isfinite(g) for g in got) and got[-1] == np.float32(big)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_parity_sequence(seed):
    rng = np.random.default_rng(seed)
    # Long finite runs so growth happens (interval 2000), with overflow bursts, and a long
    # burst to show there is no floor (torch goes below 1).
    seq = [True] * 4100 + list(rng.random(3000) < 0.999) + [False] * 20 + [True] * 2000
    got, _ = _run(jaxmp.DynamicLossScale.torch_parity(), seq)
    assert got == _torch_grad_scaler(seq)
    assert min(got) < 1.0


def test_torch_parity_against_real_torch_if_installed():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    seq = list(rng.random(3000) < 0.99) + [True] * 2500
    scale = torch.full((), 2.0**16)
    tracker = torch.zeros((), dtype=torch.int32)
    want = []
    for finite in seq:
        found_inf = torch.full((), 0.0 if finite else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000)
        want.append(float(scale))
    got, _ = _run(jaxmp.DynamicLossScale.torch_parity(), seq)
    assert got == want


def test_every_field_survives_jit_tree_map_and_checkpoint(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ls = jaxmp.DynamicLossScale(2.0**12, counter=7, period=13, factor=3.0, min_loss_scale=0.25,
                                backoff_factor=0.25, max_loss_scale=2.0**20)

    def fields(x):
        return (float(x.loss_scale), int(x.counter), x.period, x.factor, x.backoff_factor, x.min_loss_scale,
                x.max_loss_scale)

    assert fields(jax.jit(lambda s: s)(ls)) == fields(ls)
    assert fields(jax.tree_util.tree_map(lambda x: x, ls)) == fields(ls)
    # jmp's bug: min_loss_scale reset to 1 after a jitted adjust; ours keeps it through backoff.
    backed = jax.jit(lambda s: s.adjust(jnp.array(False)).adjust(jnp.array(False)))(
        jaxmp.DynamicLossScale(1.0, min_loss_scale=0.25))
    assert float(backed.loss_scale) == 0.25 and backed.min_loss_scale == 0.25
    static = jax.jit(lambda s: s)(jaxmp.StaticLossScale(512.0))
    assert float(static.loss_scale) == 512.0

    state = {"dyn": ls, "static": jaxmp.StaticLossScale(64.0), "noop": jaxmp.NoOpLossScale()}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ls", state)
    ckpt.wait_until_finished()
    template = {"dyn": jaxmp.DynamicLossScale(1.0, period=13, factor=3.0, min_loss_scale=0.25,
                                              backoff_factor=0.25, max_loss_scale=2.0**20),
                "static": jaxmp.StaticLossScale(1.0), "noop": jaxmp.NoOpLossScale()}
    restored = ckpt.restore(tmp_path / "ls", template)
    assert fields(restored["dyn"]) == fields(ls)
    assert float(restored["static"].loss_scale) == 64.0 and isinstance(restored["noop"], jaxmp.NoOpLossScale)


@pytest.mark.parametrize("make", [lambda: jaxmp.DynamicLossScale(2.0**15), lambda: jaxmp.StaticLossScale(2.0**15),
                                  lambda: jaxmp.DynamicLossScale(np.float16(1024))])
def test_scale_is_float32_whatever_the_compute_dtype(make, strict_promotion):
    ls = make()
    assert ls.loss_scale.dtype == jnp.float32
    loss16 = jnp.float16(0.5)
    scaled = ls.scale(loss16)
    assert scaled.dtype == jnp.float32 and float(scaled) == 0.5 * float(ls.loss_scale)
    g16 = {"w": jnp.full(3, 1024.0, jnp.float16), "i": jnp.int32(3)}
    un = ls.unscale(g16)
    assert un["w"].dtype == jnp.float32 and un["i"] is g16["i"]
    # fp16 cannot hold 2**16: an fp16 scale would have been inf. The adjusted scale stays f32.
    adjusted = ls.adjust(jnp.array(True))
    assert adjusted.loss_scale.dtype == jnp.float32


def test_fp16_underflow_through_value_and_grad():
    # Realistic path: fp16 compute, fp32 loss, gradient ~1e-8 per element.
    w = jnp.asarray(np.ones(64, np.float32))
    x = jnp.asarray(np.full(64, 1e-8 * 2**10, np.float32))  # representable input

    def loss_fn(p):
        h = (p.astype(jnp.float16) * x.astype(jnp.float16)) * jnp.float16(2.0**-10)  # -> ~1e-8 outputs
        return jnp.sum(h.astype(jnp.float32))

    ls = jaxmp.DynamicLossScale(2.0**15)

    @jax.jit  # both gradients in one program (eagerly, each op compiles on its own)
    def grads(w):
        _, g_scaled = jaxmp.value_and_grad(loss_fn, ls)(w)
        return jax.grad(loss_fn)(w), ls.unscale(g_scaled)

    g_plain, g = grads(w)
    assert np.max(np.abs(np.asarray(g_plain))) == 0.0  # underflowed in fp16 backward
    np.testing.assert_allclose(np.asarray(g), 1e-8, rtol=2e-2)


def test_all_finite_and_select_tree():
    tree = {"a": jnp.ones(3), "i": jnp.int32(7), "k": jax.random.key(0), "h": jnp.ones(2, jnp.float16)}
    assert bool(jaxmp.all_finite(tree))
    assert not bool(jaxmp.all_finite({**tree, "h": jnp.array([1.0, jnp.nan], jnp.float16)}))
    assert not bool(jaxmp.all_finite({**tree, "a": jnp.array([jnp.inf, 0, 0])}))
    assert bool(jaxmp.all_finite({}))
    a, b = {"x": jnp.ones(2), "n": jnp.int32(1)}, {"x": jnp.zeros(2), "n": jnp.int32(2)}
    assert jaxmp.select_tree(jnp.array(True), a, b)["n"] == 1
    assert float(jax.jit(jaxmp.select_tree)(jnp.array(False), a, b)["x"].sum()) == 0.0


def test_make_loss_scale_specs():
    assert isinstance(jaxmp.make_loss_scale("dynamic"), jaxmp.DynamicLossScale)
    assert float(jaxmp.make_loss_scale("torch").loss_scale) == 2.0**16
    assert isinstance(jaxmp.make_loss_scale(None), jaxmp.NoOpLossScale)
    assert float(jaxmp.make_loss_scale("static:256").loss_scale) == 256.0
    assert float(jaxmp.make_loss_scale(8).loss_scale) == 8.0
    ls = jaxmp.DynamicLossScale()
    assert jaxmp.make_loss_scale(ls) is ls
    d = jaxmp.DynamicLossScale()
    assert (float(d.loss_scale), d.period, d.factor, d.backoff_factor, d.min_loss_scale, d.max_loss_scale) == (
        2.0**15, 2000, 2.0, 0.5, 1.0, 2.0**24)


@pytest.mark.parametrize("cls", [jaxmp.DynamicLossScale, jaxmp.StaticLossScale])
@pytest.mark.parametrize("value", [0.0, -4.0, math.inf, math.nan])
def test_a_scale_given_as_a_bad_array_is_refused_by_the_transform(cls, value):
    import optax

    with pytest.raises(ValueError, match="loss_scale must be a positive finite"):
        jaxmp.loss_scaling(optax.sgd(0.1), cls(jnp.array(value, jnp.float32)))


@pytest.mark.parametrize("damaged, want", [(math.inf, 2.0**24), (0.0, 1.0), (math.nan, 1.0)])
def test_a_damaged_dynamic_scale_recovers_on_the_next_adjust(damaged, want):
    # e.g. restored from a damaged checkpoint: inf used to stay inf (max(inf * 0.5, floor)), every step skipped.
    ls = dataclasses.replace(jaxmp.DynamicLossScale(), loss_scale=jnp.array(damaged, jnp.float32))
    for finite in (False, True):
        assert float(ls.adjust(jnp.array(finite)).loss_scale) == want
    torch = dataclasses.replace(jaxmp.DynamicLossScale.torch_parity(), loss_scale=jnp.array(math.inf, jnp.float32))
    assert float(torch.adjust(jnp.array(False)).loss_scale) == 2.0**127


@pytest.mark.parametrize("value", [2**200, 2.0**200, -(2**200)])
def test_a_python_int_too_big_for_float32_is_out_of_range_like_the_float(value):
    """Issue 37 item 18: ``StaticLossScale(2**200)`` said "got object array of shape ()"."""
    for make in (jaxmp.StaticLossScale, jaxmp.DynamicLossScale):
        with pytest.raises(ValueError, match=r"loss_scale must be a positive finite number that float32 holds"):
            make(value)
    with pytest.raises(ValueError, match=r"loss_scale is out of range: got an integer of 1330 bits"):
        jaxmp.StaticLossScale(2**1329)
    assert float(jaxmp.StaticLossScale(2**15).loss_scale) == 32768.0


def test_fold_exactness_is_a_property_of_the_loss_scale():
    # Issue 38, item 2: the scale says whether jaxmp._scaling._fold is exact (scale >= 1 on every step).
    assert jaxmp.DynamicLossScale().fold_is_exact()
    assert not jaxmp.DynamicLossScale.torch_parity().fold_is_exact()  # no floor at 1
    assert not jaxmp.DynamicLossScale(1.0, min_loss_scale=0.5).fold_is_exact()
    assert jaxmp.StaticLossScale(4.0).fold_is_exact() and not jaxmp.StaticLossScale(0.5).fold_is_exact()
    assert not jaxmp.NoOpLossScale().fold_is_exact()
    # Traced, a static scale is known by the one the transform was built with.
    traced = jax.jit(lambda s, built: jnp.float32(s.fold_is_exact(built)), static_argnums=1)
    assert float(traced(jaxmp.StaticLossScale(4.0), jaxmp.StaticLossScale(4.0))) == 1.0
    assert float(traced(jaxmp.StaticLossScale(4.0), jaxmp.StaticLossScale(0.5))) == 0.0
    assert float(traced(jaxmp.StaticLossScale(4.0), None)) == 0.0


def test_flax_serialization_is_registered_once_not_on_every_init(monkeypatch):
    import flax.serialization

    from jaxmp._scaling._loss_scale import register_flax_serialization

    assert register_flax_serialization(force=True)
    calls = []
    real = flax.serialization.register_serialization_state
    monkeypatch.setattr(flax.serialization, "register_serialization_state",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    for _ in range(3):
        tx.init({"w": jnp.ones(2)})
    assert register_flax_serialization()
    assert calls == []  # registered once per Flax: not again per build, per init or per call


@pytest.mark.slow  # a fresh interpreter importing jax, optax, jaxmp and flax: ~4 s, nothing to trim
def test_a_flax_checkpoint_round_trips_with_only_jaxmp_imported_and_flax_imported_after_it():
    import subprocess
    import sys

    code = """
import sys
import jax.numpy as jnp, optax, jaxmp
assert "flax" not in sys.modules and "jaxmp.flax" not in sys.modules
import flax.serialization as fs
tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0 ** 9))
state = tx.init({"w": jnp.ones(2)})
back = fs.from_bytes(jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)}), fs.to_bytes(state))
assert float(back.loss_scale.loss_scale) == 512.0, back.loss_scale
assert "jaxmp.flax" not in sys.modules
print("ok")
"""
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]  # this checkout's jaxmp
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_array_hyperparameters_are_taken_as_jmp_takes_them():
    # jmp's constructor contract: array hyperparameters (here an unhashable jax.Array floor).
    ls = jaxmp.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=jnp.float32(0.37))
    assert ls.min_loss_scale == float(np.float32(0.37)) and isinstance(ls.min_loss_scale, float)
    for _ in range(20):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == np.float32(0.37)
    # Whole-number periods as jmp passes them (5., a 0-d int array); a fraction is refused.
    assert jaxmp.DynamicLossScale(10.0, jnp.int32(0), 5.0, 2.0).period == 5
    assert jaxmp.DynamicLossScale(10.0, period=jnp.int32(20), factor=jnp.float32(3.0)).factor == 3.0
    with pytest.raises(TypeError, match="whole number"):
        jaxmp.DynamicLossScale(10.0, period=2.5)
    # jmp's warning for an integer array given as a scale.
    with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
        jaxmp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.asarray(1, jnp.int32))
