"""Gradient range statistics: exact fp16 underflow/overflow counts on crafted arrays."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp.diagnostics._gradient_stats import suggest_loss_scale


def crafted():
    # 3 values below 2**-24, 5 subnormal, 2 normal, 4 zeros, 1 above 65504, 1 inf: 16 elements.
    return np.array([2.0**-30] * 3 + [2.0**-20] * 5 + [1.0, -1.0] + [0.0] * 4 + [1e5, np.inf], np.float32)


def test_underflow_subnormal_overflow_counts_are_exact():
    s = jaxmp.gradient_stats({"w": jnp.asarray(crafted())}).total
    assert (s.size, s.zeros, s.nonfinite) == (16, 4, 1)
    assert (s.underflow, s.subnormal, s.overflow) == (3, 5, 1)
    assert s.underflow_fraction == 3 / 16 and s.subnormal_fraction == 5 / 16 and s.overflow_fraction == 1 / 16
    assert s.max_abs == 1e5 and s.min_abs == 2.0**-30


def test_loss_scale_shifts_the_thresholds():
    # At 2**10: 2**-30 -> 2**-20 (subnormal), 2**-20 -> 2**-10 (normal), 1 -> 1024, 1e5 overflows.
    s = jaxmp.gradient_stats(jnp.asarray(crafted()), loss_scale=2.0**10).total
    assert (s.underflow, s.subnormal, s.overflow) == (0, 3, 1)
    # At 2**16 the +-1 values overflow too (65536 > 65504).
    s = jaxmp.gradient_stats(jnp.asarray(crafted()), loss_scale=2.0**16).total
    assert (s.underflow, s.subnormal, s.overflow) == (0, 0, 3)
    # A fractional scale pushes the subnormals under 2**-24 as well.
    s = jaxmp.gradient_stats(jnp.asarray(crafted()), loss_scale=2.0**-5).total
    assert (s.underflow, s.subnormal) == (8, 0)


def test_thresholds_are_exact_at_the_boundaries():
    below = lambda v: np.nextafter(np.float32(v), np.float32(0))  # next float32 towards zero
    x = jnp.asarray([2.0**-24, below(2.0**-24), 2.0**-14, below(2.0**-14), 65504.0, 65505.0], jnp.float32)
    s = jaxmp.gradient_stats(x).total
    assert s.underflow == 1      # just below 2**-24; 2**-24 itself is fp16's smallest subnormal
    assert s.subnormal == 2      # 2**-24 and just below 2**-14; 2**-14 is normal
    assert s.overflow == 1       # 65504 is fp16's max; 65505 is not representable


def test_log2_histogram_bins():
    x = jnp.asarray([0.75, 1.0, 1.5, 3.0, 4.0, -4.0, 0.0, 2.0**-30, np.nan], jnp.float32)
    s = jaxmp.gradient_stats(x).total
    hist = dict(zip(s.log2_bins, s.log2_counts))
    # Bin e holds 2**e <= |g| < 2**(e+1).
    assert hist == {-30: 1, -1: 1, 0: 2, 1: 1, 2: 2}
    assert sum(s.log2_counts) == s.size - s.zeros - s.nonfinite


def test_groups_by_top_level_branch_leaf_or_all_and_skip_non_floats():
    grads = {"params": {"dense": {"kernel": jnp.full((4, 4), 1e-9), "bias": jnp.ones(4)},
                        "head": {"kernel": jnp.ones((4, 2))}},
             }
    stats = jaxmp.gradient_stats(grads)
    assert [g.name for g in stats.groups] == ["params/dense", "params/head"]
    dense = stats.groups[0]
    assert (dense.size, dense.underflow) == (20, 16)
    assert stats.total.size == 28 and stats.total.underflow == 16

    leaf = jaxmp.gradient_stats(grads, group_by="leaf")
    assert [g.name for g in leaf.groups] == ["params/dense/bias", "params/dense/kernel", "params/head/kernel"]
    assert [g.name for g in jaxmp.gradient_stats(grads, group_by="all").groups] == ["all"]

    mixed = jaxmp.gradient_stats({"a": jnp.ones(3), "b": jnp.ones(5), "step": jnp.int32(7)})
    assert [g.name for g in mixed.groups] == ["a", "b"] and mixed.total.size == 8


def test_suggested_scale_rule():
    # Largest power of two S in [1, 2**24] with max|g| * S * headroom <= 65504.
    assert suggest_loss_scale(1.0) == 2.0**12           # 65504 / 8 = 8188
    assert suggest_loss_scale(1.0, headroom=1.0) == 2.0**15
    assert suggest_loss_scale(2.0**-10) == 2.0**22
    assert suggest_loss_scale(0.0) == 2.0**24           # nothing can overflow
    assert suggest_loss_scale(1e-12) == 2.0**24         # clipped to the maximum
    assert suggest_loss_scale(1e6) == 1.0               # clipped to the minimum
    for m in (3e-3, 0.01, 0.37, 5.0, 100.0):
        s = suggest_loss_scale(m)
        assert s * m * 8 <= 65504 < 2 * s * m * 8
        assert math.log2(s) == int(math.log2(s))


def test_suggestion_in_stats_and_its_underflow_fraction():
    # max|g| = 1 -> 2**12; at 2**12, 2**-40 still underflows (2**-28), 2**-30 does not (2**-18).
    x = jnp.asarray([2.0**-40] * 2 + [2.0**-30] * 6 + [1.0] * 2, jnp.float32)
    stats = jaxmp.gradient_stats(x)
    assert stats.suggested_loss_scale == 2.0**12
    assert stats.total.underflow == 8                   # at scale 1 everything small underflows
    assert stats.suggested_underflow_fraction == 2 / 10
    d = json.loads(stats.to_json())
    assert d["suggested_loss_scale"] == 4096.0 and d["total"]["underflow_fraction"] == 0.8
    assert "2^12" in stats.summary() and "\n" not in stats.summary()
    assert "all" in stats.table() and "80.0%" in stats.table()


def test_half_precision_grads_and_loss_scale_objects():
    g = jnp.asarray([2.0**-14, 2.0**-20, 1.0], jnp.bfloat16)
    s = jaxmp.gradient_stats(g).total
    assert (s.subnormal, s.underflow) == (1, 0)  # 2**-14 is fp16's smallest normal

    class Scale:  # loss-scale objects carry the scale in `.loss_scale`
        loss_scale = jnp.float32(2.0**8)

    stats = jaxmp.gradient_stats(g, loss_scale=Scale())
    assert stats.loss_scale == 256.0
    assert stats.total.subnormal == 0  # 2**-20 * 2**8 = 2**-12 is normal


def test_bad_inputs_raise_clear_errors():
    g = {"w": jnp.ones(3)}
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="loss_scale"):
            jaxmp.gradient_stats(g, loss_scale=bad)
    with pytest.raises(TypeError, match="loss_scale"):
        jaxmp.gradient_stats(g, loss_scale="big")
    with pytest.raises(ValueError, match="empty"):
        jaxmp.gradient_stats({})
    with pytest.raises(ValueError, match="floating"):
        jaxmp.gradient_stats({"step": jnp.int32(1)})
    with pytest.raises(ValueError, match="group_by"):
        jaxmp.gradient_stats(g, group_by="module")
    with pytest.raises(ValueError, match="headroom"):
        jaxmp.gradient_stats(g, headroom=0.5)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    stats = jaxmp.gradient_stats({"a": jnp.asarray(crafted()), "b": jnp.linspace(-1, 1, 50)}, loss_scale=2.0**8)
    path = stats.plot(str(tmp_path / "grads.png"))
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_import_jaxmp_does_not_import_matplotlib_or_tensorflow():
    code = ("import sys, jaxmp; bad = [m for m in ('matplotlib', 'tensorflow') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(Path(__file__).resolve().parents[2]))
