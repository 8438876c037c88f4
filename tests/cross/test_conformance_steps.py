"""The step-builder conformance matrix: every jaxmp train step x loss-scale kind x master weights.

The matrix is generated, not hand-listed: `BUILDERS` holds one small factory per step builder,
the sharded step's made by iterating over the layouts jaxmp accepts
(``jaxmp.parallel._layouts.LAYOUTS``) with and without `jaxmp.parallel.scan_layers`, and the
loss-scale kinds are jaxmp's own (``jaxmp._scaling._loss_scale.LOSS_SCALE_TYPES``), so a new layout or
loss-scale type joins the matrix by existing (a loss-scale type with no constructor here fails
`test_every_loss_scale_type_of_jaxmp_is_in_the_matrix`). Master weights: on with bfloat16
params (O2), off with float32 params (O1); no combination of these is refused by design.

Each cell (trained: the slow tier) builds a tiny model and state, runs one normal step (finite,
float32 loss, every state leaf keeps its dtype and shape, the params move), then one step on a
batch holding an inf: the step is skipped, so every leaf of params, model state (BatchNorm
statistics, a running mean) and optimizer state (moments and step counts) is bitwise unchanged,
except the loss-scaling bookkeeping, which moves as documented (docs/design.md#loss-scaling):
skip counters +1, ``last_step_finite`` False, a dynamic scale halved with its counter reset, a
static or no-op scale unchanged. The default tier traces a subset of the cells' steps
(``jax.eval_shape``: output structure and dtypes), which compiles nothing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from jaxmp._scaling._loss_scale import LOSS_SCALE_TYPES
from jaxmp.parallel import _wire
from jaxmp.parallel._layouts import KINDS, LAYOUTS

BF16, F32 = jnp.bfloat16, jnp.float32
FEATURES, HIDDEN, LAYERS, OUT, BATCH = 4, 16, 2, 2, 16
PMAP_DEVICES = 2

# Every loss-scale type jaxmp has, one instance each (the static scale != 1, so it shows).
LOSS_SCALES = {
    jaxmp.NoOpLossScale: ("none", jaxmp.NoOpLossScale),
    jaxmp.StaticLossScale: ("static", lambda: jaxmp.StaticLossScale(2.0 ** 10)),
    jaxmp.DynamicLossScale: ("dynamic", jaxmp.DynamicLossScale),
}
MASTERS = {"masters-bf16": True, "f32-no-masters": False}

# The loss-scaling bookkeeping: the only leaves a skipped step may change (path names).
BOOKKEEPING = frozenset({"loss_scale", "counter", "last_step_finite", "consecutive_skips", "total_skips",
                         "skip_reason"})


class Cell(NamedTuple):
    """One built cell: ``step(state, batch) -> (state, metrics)`` on a plain pytree state."""

    state: Any
    step: Callable
    batch: Callable[[bool], Any]   # poisoned -> batch
    compiled: bool = False         # the step jits itself (the parallel steps); else the test jits it
    replicas: int | None = None    # metrics per replica (pmap)
    trace: Callable | None = None  # (state, batch) -> abstract (state, metrics); default eval_shape of step


def _tx(loss_scale, masters, axis_name=None):
    return jaxmp.loss_scaling(optax.adamw(1e-2), loss_scale(), master_weights=masters, axis_name=axis_name)


def _data(poisoned, batch=BATCH):
    x = np.linspace(-1, 1, batch * FEATURES, dtype=np.float32).reshape(batch, FEATURES)
    if poisoned:
        x = x.copy()
        x[0, 0] = np.inf   # one example of the first shard: the reduce must carry it to every device
    return x, (np.arange(batch) % OUT).astype(np.int32)


# ----------------------------------------------------------------------------- Flax Linen and NNX


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False)(nn.Dense(HIDDEN)(x))
        return nn.Dense(OUT)(nn.relu(h))


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.a, self.bn = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.b = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.bn(self.a(x))))


def _policy(masters):
    return "O2-bf16" if masters else "O1-bf16"


def _linen_variables(policy):
    model = jaxmp.flax.mixed_precision(_LinenNet(), policy)
    return model, model.init(jax.random.key(0), _data(False)[0])


@pytest.fixture(scope="module")
def linen_variables():
    """The Linen model and its initialised variables per policy, made once for this module's
    cells (each init compiles); the other builders ignore it."""
    return functools.cache(_linen_variables)


def _linen(loss_scale, masters, linen_variables=_linen_variables):
    model, variables = linen_variables(_policy(masters))
    state = jaxmp.flax.TrainState.create(model, variables, _tx(loss_scale, masters))
    step = jaxmp.flax.make_train_step()
    return Cell(state, step, lambda poisoned: _data(poisoned))


def _nnx(loss_scale, masters):
    model = jaxmp.flax.mixed_precision(_NNXNet(nnx.Rngs(0)), _policy(masters))
    optimizer = nnx.Optimizer(model, _tx(loss_scale, masters), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):  # the functional form of nnx.jit(train_step): state in, state out
        model, optimizer = nnx.merge(graphdef, state)
        metrics = jaxmp.flax.nnx.train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    return Cell(state, step, lambda poisoned: _data(poisoned))


# ----------------------------------------------------------------------------- data parallel


def _mlp_params(dtype):
    k = jax.random.split(jax.random.key(1), 3)
    return {"embed": jax.random.normal(k[0], (FEATURES, HIDDEN), F32).astype(dtype) * 0.5,
            "layers": {"w": (jax.random.normal(k[1], (LAYERS, HIDDEN, HIDDEN), F32) * 0.3).astype(dtype)},
            "head": (jax.random.normal(k[2], (HIDDEN, OUT), F32) * 0.3).astype(dtype)}


def _mlp_loss(scan):
    """A loss with model state (a running mean of the features: kept only on applied steps)."""
    def loss(params, stats, batch):
        h = batch["x"].astype(BF16) @ params["embed"].astype(BF16)
        layer = lambda h, p: (jnp.tanh(h @ p["w"].astype(BF16)), None)  # noqa: E731
        if scan:
            h, _ = jaxmp.parallel.scan_layers(layer, h, params["layers"], dtype=BF16)
        else:
            for i in range(LAYERS):
                h, _ = layer(h, jax.tree_util.tree_map(lambda x: x[i], params["layers"]))
        logits = (h @ params["head"].astype(BF16)).astype(F32)
        target = jax.nn.one_hot(batch["y"], OUT, dtype=F32)
        new = {"mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h.astype(F32), axis=0)}
        return jnp.mean((logits - target) ** 2), new

    return loss


def _stats():
    return {"mean": jnp.zeros(HIDDEN, F32)}


def _sharded(layout, scan, wire=None):
    def factory(loss_scale, masters):
        mesh = jaxmp.parallel.make_data_mesh()
        tx = _tx(loss_scale, masters)
        step = jaxmp.parallel.make_sharded_train_step(_mlp_loss(scan), tx, mesh, layout=layout, model_state=True,
                                                      min_shard_size=0, **(wire or {}))
        params = _mlp_params(BF16 if masters else F32)
        p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
        state = (p, jaxmp.parallel.replicate_on_mesh(_stats(), mesh), s)

        def run(state, batch):
            p, ms, s, metrics = step(*state, batch)
            return (p, ms, s), metrics

        def batch(poisoned):
            x, y = _data(poisoned)
            return jaxmp.parallel.make_global_batch({"x": x, "y": y}, mesh)

        return Cell(state, run, batch, True)

    return factory


def _pmap(loss_scale, masters):
    devices = jax.local_devices()[:PMAP_DEVICES]
    tx = _tx(loss_scale, masters, axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(_mlp_loss(False), tx, "batch", model_state=True, devices=devices)
    params = _mlp_params(BF16 if masters else F32)
    state = tuple(jaxmp.parallel.replicate(t, devices) for t in (params, _stats(), tx.init(params)))

    def run(state, batch):
        p, ms, s, metrics = step(*state, batch)
        return (p, ms, s), metrics

    def trace(state, batch):  # the pmapped body itself: the wrapper checks replicas on the host
        (p, ms), s, metrics = jax.eval_shape(step.pmapped, state[:2], state[2], batch)
        return (p, ms, s), metrics

    def batch(poisoned):
        x, y = _data(poisoned)
        return jaxmp.parallel.shard_batch({"x": x, "y": y}, PMAP_DEVICES)

    return Cell(state, run, batch, True, PMAP_DEVICES, trace)


# The registry: every step builder jaxmp has (the generic builders of jaxmp/_step.py are private).
BUILDERS: dict[str, Callable[..., Cell]] = {
    "linen": _linen,
    "nnx": _nnx,
    **{f"sharded-{layout}{'-scan' if scan else ''}": _sharded(layout, scan) for layout in LAYOUTS
       for scan in (False, True)},
    "pmap": _pmap,
}

CELLS = [(b, s, m) for b in BUILDERS for s in LOSS_SCALES for m in MASTERS]
IDS = [f"{b}-{LOSS_SCALES[s][0]}-{m}" for b, s, m in CELLS]
# The default tier traces a subset (each trace costs ~0.15 s): every builder with both master
# settings under the dynamic scale (the richest state), and every loss-scale kind on the first
# builder; the slow tier trains every cell.
TRACED = [c for c in CELLS if c[1] is jaxmp.DynamicLossScale or c[0] == next(iter(BUILDERS))]
TRACED_IDS = [IDS[CELLS.index(c)] for c in TRACED]


def _build(builder, scale_type, masters, linen_variables):
    build = BUILDERS[builder]
    if build is _linen:   # the one builder whose set-up is shared between cells
        build = functools.partial(_linen, linen_variables=linen_variables)
    return build(LOSS_SCALES[scale_type][1], MASTERS[masters])


# ----------------------------------------------------------------------------- reading states


def _names(path) -> tuple:
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(getattr(key, attr))
                break
    if out and out[-1] == "value":  # an nnx Variable's payload
        out.pop()
    return tuple(out)


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(path): (_names(path), x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _host(x) -> np.ndarray:
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def _bits(x) -> bytes:
    a = np.ascontiguousarray(_host(x))
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def _one(values) -> Any:
    """The single value of a (possibly per-replica) bookkeeping leaf; replicas must agree."""
    flat = _host(values).reshape(-1)
    assert (flat == flat[0]).all(), flat
    return flat[0].item()


def _book(tree) -> dict:
    """The loss-scaling bookkeeping of a state, by field (``scale``: the scale's own leaf)."""
    out = {}
    for names, x in _leaves(tree).values():
        if names[-2:] == ("loss_scale", "loss_scale"):
            out["scale"] = _one(x)
        elif names[-2:] == ("loss_scale", "counter"):
            out["counter"] = _one(x)
        elif names and names[-1] in BOOKKEEPING:
            out[names[-1]] = _one(x)
    return out


def _spec(tree) -> dict:
    return {k: (jnp.shape(x), jnp.dtype(x.dtype) if hasattr(x, "dtype") else type(x))
            for k, (_, x) in _leaves(tree).items()}


def _check_metrics_abstract(metrics, replicas):
    shape = () if replicas is None else (replicas,)
    assert metrics["loss"].dtype == F32 and tuple(metrics["loss"].shape) == shape
    assert metrics["last_step_finite"].dtype == jnp.bool_
    for key in ("loss_scale", "consecutive_skips", "total_skips"):
        assert key in metrics


# ----------------------------------------------------------------------------- the tests


def test_the_matrix_is_generated_from_the_package():
    # Every layout the sharded step accepts, with and without scan_layers; every loss-scale
    # type; both master settings: the size follows from what jaxmp has.
    assert len(LAYOUTS) >= 3 and all(f"sharded-{layout}" in BUILDERS for layout in LAYOUTS)
    assert len(BUILDERS) == 2 * len(LAYOUTS) + 3
    assert len(CELLS) == len(BUILDERS) * len(LOSS_SCALE_TYPES) * len(MASTERS)


def test_every_loss_scale_type_of_jaxmp_is_in_the_matrix():
    missing = [t.__name__ for t in LOSS_SCALE_TYPES if t not in LOSS_SCALES]
    assert not missing, f"add a constructor for {missing} to LOSS_SCALES"


@pytest.mark.standard_promotion(reason="Flax's BatchNorm and optax's adamw mix dtypes inside")
@pytest.mark.parametrize("builder,scale_type,masters", TRACED, ids=TRACED_IDS)
def test_each_cell_traces_to_its_own_state_structure_and_a_float32_loss(linen_variables, builder, scale_type, masters):
    cell = _build(builder, scale_type, masters, linen_variables)
    trace = cell.trace or (lambda s, b: jax.eval_shape(cell.step, s, b))
    new_state, metrics = trace(cell.state, cell.batch(False))
    assert _spec(new_state) == _spec(cell.state)   # structure, shapes and every leaf's dtype
    _check_metrics_abstract(metrics, cell.replicas)


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="Flax's BatchNorm and optax's adamw mix dtypes inside")
@pytest.mark.parametrize("builder,scale_type,masters", CELLS, ids=IDS)
def test_each_cell_trains_then_skips_a_non_finite_step_exactly(linen_variables, builder, scale_type, masters):
    cell = _build(builder, scale_type, masters, linen_variables)
    step = cell.step if cell.compiled else jax.jit(cell.step)

    # One normal step: finite, a float32 loss, each leaf keeps its dtype and shape, params move.
    state, metrics = step(cell.state, cell.batch(False))
    assert _spec(state) == _spec(cell.state)
    assert metrics["loss"].dtype == F32 and np.isfinite(_host(metrics["loss"])).all()
    assert _one(metrics["last_step_finite"]) is True and _one(metrics["total_skips"]) == 0
    moved = [k for k, (names, x) in _leaves(state).items()
             if _bits(x) != _bits(_leaves(cell.state)[k][1]) and not set(names) & BOOKKEEPING]
    assert moved, "the normal step changed nothing"
    before = _book(state)
    assert before["last_step_finite"] is True

    # A batch holding an inf: skipped.
    skipped, metrics = step(state, cell.batch(True))
    assert _one(metrics["last_step_finite"]) is False
    old, new = _leaves(state), _leaves(skipped)
    assert old.keys() == new.keys()
    changed = [k for k, (names, x) in new.items() if _bits(x) != _bits(old[k][1]) and not set(names) & BOOKKEEPING]
    assert not changed, f"a skipped step changed {changed}"

    after = _book(skipped)
    assert after["last_step_finite"] is False
    assert after["consecutive_skips"] == before["consecutive_skips"] + 1
    assert after["total_skips"] == before["total_skips"] + 1 == _one(metrics["total_skips"])
    assert after["skip_reason"] in (jaxmp._scaling._transform.NON_FINITE_LOSS, jaxmp._scaling._transform.NON_FINITE_GRADIENTS)
    scale_before = before.get("scale", 1.0)
    if scale_type is jaxmp.DynamicLossScale:
        assert after["scale"] == scale_before / 2 and after["counter"] == 0   # backoff x0.5, growth count reset
    else:
        assert after.get("scale", 1.0) == scale_before                       # a static / no-op scale stays
    # Every step's metric is the scale this step's loss was multiplied by (the one that overflowed).
    assert _one(metrics["loss_scale"]) == scale_before


# ----------------------------------------------------------------------------- precision on the wire
#
# The wire options (issue 63) are an axis of their own, generated from what jaxmp has: every
# combination of ``_wire.GATHER_BITS`` and ``_wire.REDUCE_BITS`` (each or None, not both None) on
# every layout that moves state over the data axis (``shards_state``), with and without
# scan_layers, under both master settings, on the dynamic loss scale (the richest bookkeeping).
# ZeRO's quantized gather needs a float32 master (its params are the gathered copy): without one
# the cell checks the documented refusal.

WIRE_BLOCK = 8  # several blocks in each device's piece of this model's leaves
WIRE = [{k: v for k, v in (("gather_bits", g), ("reduce_bits", r)) if v is not None}
        for g in (None, *_wire.GATHER_BITS) for r in (None, *_wire.REDUCE_BITS) if (g, r) != (None, None)]
WIRE_CELLS = [(layout, scan, masters, wire) for layout in LAYOUTS if KINDS[layout].shards_state
              for scan in (False, True) for masters in MASTERS for wire in WIRE]
WIRE_IDS = [f"{layout}{'-scan' if scan else ''}-{masters}-" + "-".join(f"{k.split('_')[0]}{v}" for k, v in w.items())
            for layout, scan, masters, w in WIRE_CELLS]
# The default tier (about 10 s) trains a slice: every option at once on FSDP with scan_layers and
# masters (the per-layer gathers), and ZeRO's refusal without a master; the slow tier every cell.
WIRE_DEFAULT = [c for c in WIRE_CELLS
                if (c[0] == "fsdp" and c[1] and c[2] == "masters-bf16" and c[3] == WIRE[-1])
                or (c[0] == "zero" and not c[1] and c[2] == "f32-no-masters" and c[3] == WIRE[-1])]


def _wire_refusal(layout, masters, wire):
    if layout == "zero" and "gather_bits" in wire and not MASTERS[masters]:
        return r"gather_bits under layout='zero' .*master_weights=True"
    return None


@functools.cache
def _wire_run(layout, scan, masters, wire_items):
    """Two normal steps and a poisoned one of a sharded cell (``wire_items``: its options as a
    sorted tuple; empty: the unquantized cell): the states and metrics, on the host."""
    opts = dict(wire_items)
    if opts:
        opts["wire_block"] = WIRE_BLOCK
    cell = _sharded(layout, scan, opts)(LOSS_SCALES[jaxmp.DynamicLossScale][1], MASTERS[masters])
    states, metrics = [cell.state], []
    for poisoned in (False, False, True):
        state, m = cell.step(states[-1], cell.batch(poisoned))
        states.append(state)
        metrics.append({k: _host(v) for k, v in m.items() if k != "aux"})
    return states, metrics


def test_the_wire_axis_is_generated_from_the_package():
    assert len(WIRE) == (len(_wire.GATHER_BITS) + 1) * (len(_wire.REDUCE_BITS) + 1) - 1
    assert {c[0] for c in WIRE_CELLS} == {name for name, kind in KINDS.items() if kind.shards_state}
    assert len(WIRE_CELLS) == len(WIRE) * 2 * len(MASTERS) * sum(kind.shards_state for kind in KINDS.values())
    assert WIRE[-1] == {"gather_bits": max(_wire.GATHER_BITS), "reduce_bits": _wire.REDUCE_BITS[-1]}
    assert len(WIRE_DEFAULT) == 2


def _check_wire_cell(layout, scan, masters, wire):
    refused = _wire_refusal(layout, masters, wire)
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            _wire_run(layout, scan, masters, tuple(sorted(wire.items())))
        return
    (s0, s1, s2, s3), m = _wire_run(layout, scan, masters, tuple(sorted(wire.items())))
    (r0, r1, r2, _), rm = _wire_run(layout, scan, masters, ())
    # The state keeps its structure, shapes and dtypes: no codes of the wire are kept in it.
    assert _spec(s1) == _spec(s0) == _spec(r1)
    # The first loss is the forward on the gathered (dequantized under gather_bits) params; the
    # second also follows one update from the reduced (quantized under reduce_bits) gradients.
    for t in (0, 1):
        assert np.isfinite(m[t]["loss"]) and bool(m[t]["last_step_finite"])
        np.testing.assert_allclose(m[t]["loss"], rm[t]["loss"], rtol=3e-2)
    # Each AdamW step moves a param by about its learning rate (1e-2), either way: after two steps a
    # quantized cell's params are within 4e-2 of the unquantized cell's (both steps the other way),
    # and they did move.
    p2, q2 = _leaves(s2[0]), _leaves(r2[0])
    for k, (_, x) in p2.items():
        np.testing.assert_allclose(_host(x).astype(np.float32), _host(q2[k][1]).astype(np.float32), atol=4e-2)
    assert any(_bits(x) != _bits(_leaves(s0[0])[k][1]) for k, (_, x) in p2.items())
    # The poisoned step is skipped on every device, as in the unquantized cell: every leaf but the
    # loss-scaling bookkeeping is bitwise unchanged, and the bookkeeping moves the same way.
    assert not bool(m[2]["last_step_finite"]) and not bool(rm[2]["last_step_finite"])
    old, new = _leaves(s2), _leaves(s3)
    changed = [k for k, (names, x) in new.items() if _bits(x) != _bits(old[k][1]) and not set(names) & BOOKKEEPING]
    assert not changed, f"a skipped step changed {changed}"
    assert _book(s3) == _book(_wire_run(layout, scan, masters, ())[0][3])


@pytest.mark.standard_promotion(reason="optax's adamw mixes dtypes inside")
@pytest.mark.parametrize("layout,scan,masters,wire", WIRE_DEFAULT,
                         ids=[WIRE_IDS[WIRE_CELLS.index(c)] for c in WIRE_DEFAULT])
def test_a_slice_of_the_wire_cells_trains_close_to_the_unquantized_cell_and_skips_exactly(layout, scan, masters,
                                                                                           wire):
    _check_wire_cell(layout, scan, masters, wire)


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax's adamw mixes dtypes inside")
@pytest.mark.parametrize("layout,scan,masters,wire", WIRE_CELLS, ids=WIRE_IDS)
def test_each_wire_cell_trains_close_to_the_unquantized_cell_and_skips_exactly(layout, scan, masters, wire):
    _check_wire_cell(layout, scan, masters, wire)
