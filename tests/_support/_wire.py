"""Test helper for the quantized collectives (tests/parallel/test_wire_*.py): a small MLP on the
8 simulated devices, its training runs (cached per layout and options), and the program's collectives.

The model's leaves cover every way a gradient is reduced under ZeRO/FSDP with the default
``min_shard_size`` (1024): ``w1`` (16x512) and ``w2`` (512x8) are split (reduce-scattered,
quantized with ``reduce_bits``), ``e`` (7x300: no dimension 8 divides) stays replicated and is
large enough (2100 >= 8 x 256) for a quantized all-reduce, ``b1`` (512) is replicated and
all-reduced in ``reduce_dtype``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from tests._support._arrays import leaf_bytes

N = 8
BF16 = jnp.bfloat16
BATCH = 32
STEPS = 30
NAN_STEP = 10  # a NaN in one row of device 3's shard: only that device's gradient is non-finite


def params(dtype: Any = BF16) -> dict:
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(16, 512)) / 4, dtype), "b1": jnp.zeros(512, dtype),
            "w2": jnp.asarray(rng.normal(size=(512, 8)) / 8, dtype),
            "e": jnp.asarray(rng.normal(size=(7, 300)) / 4, dtype)}


def loss(p: dict, b: dict) -> jax.Array:
    x = b["x"].astype(p["w1"].dtype)
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    side = jnp.tanh(x[:, :7] @ p["e"]).astype(jnp.float32)
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2) + 0.1 * jnp.mean(side ** 2)


def data(steps: int = STEPS, nan_step: int | None = NAN_STEP) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(steps, BATCH, 16)).astype(np.float32)
    y = np.sin(x[..., :8] * 2).astype(np.float32)
    if nan_step is not None and nan_step < steps:
        x[nan_step, 3 * (BATCH // N) + 1, 2] = np.nan
    return x, y


def tx() -> optax.GradientTransformation:
    return jaxmp.loss_scaling(optax.adamw(1e-2), jaxmp.DynamicLossScale(2.0 ** 15, period=8), master_weights=True)


@functools.cache
def step(layout: str, gather_bits: int | None = None, reduce_bits: int | None = None) -> Any:
    """One step per (layout, options), shared by the tests of a session (a compile is most of their cost)."""
    return jaxmp.parallel.make_sharded_train_step(loss, tx(), jaxmp.parallel.make_data_mesh(), layout=layout,
                                                  gather_bits=gather_bits, reduce_bits=reduce_bits)


@functools.cache
def run(layout: str, gather_bits: int | None = None, reduce_bits: int | None = None, repeat: int = 0) -> dict:
    """``STEPS`` steps (a NaN at ``NAN_STEP``): losses, verdicts, scales, the state after the first
    step, the states around the NaN step (as bytes) and the final state (and its bytes). ``repeat``
    runs it again (the same inputs, the same compiled step)."""
    st = step(layout, gather_bits, reduce_bits)
    t_ = tx()
    p, s = jaxmp.parallel.shard_state((params(), t_.init(params())), st.layout)
    x, y = data()
    out: dict = {"loss": [], "finite": [], "scale": []}
    for t in range(STEPS):
        if t == NAN_STEP:
            out["before_nan"] = leaf_bytes((p, s))
        p, s, m = st(p, s, jaxmp.parallel.make_global_batch({"x": x[t], "y": y[t]}, st.mesh))
        verdicts = {bool(sh.data) for sh in m["last_step_finite"].addressable_shards}
        assert len(verdicts) == 1, (layout, t, verdicts)  # every device reaches the same verdict
        out["finite"].append(verdicts.pop())
        out["loss"].append(float(m["loss"]))
        out["scale"].append(float(m["loss_scale"]))
        if t == NAN_STEP:
            out["after_nan"] = leaf_bytes((p, s))
        if t == 0:
            out["first"] = (p, s)
    out["final"] = leaf_bytes((p, s))
    out["state"] = (p, s)
    out["loss"] = np.asarray(out["loss"])
    return out


_COLLECTIVE = re.compile(r'"stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all)"')
_SIGNATURE = re.compile(r": \((tensor<[^)]*?)\) -> \(?(tensor<[^>]*>)")


def changed_leaves(before: list, after: list) -> list[int]:
    """Indices of the leaves whose bytes differ."""
    return [i for i, (a, b) in enumerate(zip(before, after)) if a != b]


def collectives(text: str) -> list[tuple[str, str, int]]:
    """``(kind, element type, elements sent per device)`` of each collective in a lowered program
    (StableHLO, before XLA:CPU widens bf16 ones): an all-to-all sends its whole operand (one row a
    device, its own row included), an all-gather its operand, a reduce-scatter its operand."""
    out = []
    for m in _COLLECTIVE.finditer(text):
        operand = _SIGNATURE.search(text, m.end()).group(1).split(",")[0]
        dims = operand[len("tensor<"):-1].split("x")
        out.append((m.group(1), dims[-1], int(np.prod([int(d) for d in dims[:-1]], dtype=np.int64))))
    return out


def lowered(layout: str, **options: Any) -> str:
    """The lowered step's text for abstract state (no compile)."""
    st = jaxmp.parallel.make_sharded_train_step(loss, tx(), jaxmp.parallel.make_data_mesh(), layout=layout, **options)
    ps, ss = jaxmp.parallel.abstract_state((params(), tx().init(params())), st.layout)
    batch = {"x": jax.ShapeDtypeStruct((BATCH, 16), jnp.float32), "y": jax.ShapeDtypeStruct((BATCH, 8), jnp.float32)}
    return st.lower(ps, ss, batch).as_text()
