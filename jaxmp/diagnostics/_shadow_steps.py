"""The k-step mode of `compare_to_float32`: the policy run and its float32 shadow trained side by
side, with their noise twins, so a drift can be told from rounding noise.

See docs/debugging.md (``steps=k``) and jaxmp/diagnostics/_noise.py for the noise floor.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._evaluate import StrictJit
from jaxmp.diagnostics._fix import apply_updates
from jaxmp.diagnostics._inputs import scaled_like_the_step


def _floating(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _format.is_floating(dtype)


def _leaf_relerr(a, b):
    """Relative error of ``a`` against ``b`` (float32; 0 where ``b`` is zero or not finite)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    den = jnp.sqrt(jnp.sum(jnp.square(b)))
    e = jnp.sqrt(jnp.sum(jnp.square(a - b))) / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)
    return jnp.where(jnp.isfinite(e), e, 0.0)


def _uniform_like(leaves: list, key) -> list:
    """A ``uniform(-1, 1)`` float32 array per floating leaf (None for the others), from one draw.

    One ``jax.random.uniform`` of all the leaves' elements, cut into the leaves: the program holds
    one random-bits hash, not one per leaf (at XLA's fast compile each costs about 0.1 s of
    compile time: 5 s for a ResNet's 53 leaves).
    """
    sizes = [int(np.size(x)) if _floating(x) else 0 for x in leaves]
    u = jax.random.uniform(key, (max(sum(sizes), 1),), jnp.float32, -1.0, 1.0)
    out, at = [], 0
    for x, n in zip(leaves, sizes):
        out.append(jax.lax.slice(u, (at,), (at + n,)).reshape(jnp.shape(x)) if _floating(x) else None)
        at += n
    return out


def _perturb(params, rel: float, seed: int):
    """``params`` with each floating element times ``1 + rel * uniform(-1, 1)`` (seeded)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    us = _uniform_like(leaves, jax.random.key(seed))
    return jax.tree_util.tree_unflatten(tree, [(x * (1 + rel * u)).astype(x.dtype) if u is not None else x
                                               for x, u in zip(leaves, us)])


def _noisy(g, sizes, key):
    """``g`` with floating leaf ``j`` times ``1 + sqrt(3) * sizes[j] * uniform(-1, 1)`` (seeded by ``key``)."""
    leaves, tree = jax.tree_util.tree_flatten(g)
    us = _uniform_like(leaves, key)
    # uniform(-1, 1) has RMS 1/sqrt(3): the noise's RMS is the measured error
    return jax.tree_util.tree_unflatten(tree, [
        (x * (1 + np.sqrt(3.0) * sizes[j] * u)).astype(x.dtype) if u is not None else x
        for j, (x, u) in enumerate(zip(leaves, us))])


class _Training:
    """The policy run and its float32 shadow, ``steps`` optimizer steps each, with their noise twins.

    Four runs from the same parameters on the same inputs, two lanes each side:
    the policy run and the policy run from parameters perturbed by half an ulp of ``half``
    (rounding-size noise); the float32 shadow and a float32 shadow from the same perturbed
    parameters whose gradients get, at every step, fresh random relative noise as large as the
    policy run's error on that gradient leaf at the first step. The twins measure how far
    rounding-size noise moves each training in ``k`` steps (chaotic training: far; a systematic
    loss such as a narrowed bias: the twins stay with their run). ``half`` None: no twins' noise.

    One program, compiled once, steps a policy run and a float32 shadow run, each with its
    optimizer update: it evaluates the traced step ``prog`` twice, as traced and as its float32
    shadow, so the model is not traced again. `lane` calls it ``steps + 1`` times for one lane
    (0: the runs; 1: their twins) without waiting for results, so the comparison goes on (the
    analysis runs while the twins train). Construction starts the compiles in the
    background: this program, then the analysis ``prog`` runs at the end, which compiles while
    lane 0 trains. Not vmapped over the lanes (a batched convolution is a grouped one, which
    XLA's CPU backend runs far slower at the debugger's fast compile), and not a ``lax.scan``
    (convolutions inside a loop run an order of magnitude slower at that level; the loop would
    save no compile).

    Args:
      prog: the traced step (its sites and float32 shadow).
      params, rest: the parameters and the other inputs of the step.
      steps: optimizer steps per run.
      tx: the optax transformation.
      half: the half dtype whose rounding sets the twins' noise, or None.
    """

    def __init__(self, prog: Any, params, rest: tuple, steps: int, tx, half):  # prog: a _shadow._Program
        self.steps, self.half = steps, half
        rel = float(jnp.finfo(half).eps) / 2 if half is not None else 0.0
        closed, out_tree = prog.closed, prog.out_tree
        n_leaves = len(jax.tree_util.tree_leaves(params))

        def update(loss, g, o, q):
            u, o = tx.update(scaled_like_the_step(g, o), o, q)
            return jnp.asarray(loss, jnp.float32), apply_updates(q, u), o

        def start(params):
            """The twins' parameters and every lane's optimizer state."""
            twin = _perturb(params, rel, 1)
            return twin, tx.init(params), tx.init(twin)

        def pair_step(pol, f32, sizes, lane, i, consts):
            (qp, op), (qs, os_) = pol, f32
            leaves_p = jax.tree_util.tree_leaves((qp, *rest))
            loss_p, g_p = jax.tree_util.tree_unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts, *leaves_p))
            loss_s, g_s = jax.tree_util.tree_unflatten(
                out_tree, prog.shadow_fn(consts, jax.tree_util.tree_leaves((qs, *rest))))
            # The policy run's error per gradient leaf (read on lane 0's first step: the twins' noise)
            err = jnp.stack([_leaf_relerr(a, b) for a, b in
                             zip(jax.tree_util.tree_leaves(g_p), jax.tree_util.tree_leaves(g_s))] or [jnp.zeros(())])
            key = jax.random.fold_in(jax.random.key(lane), i)
            # Only the float32 twin (lane 1) is noisy: lane 0 skips drawing the noise.
            g_s = jax.lax.cond(lane > 0, lambda g: _noisy(g, sizes, key), lambda g: g, g_s)
            return update(loss_p, g_p, op, qp), update(loss_s, g_s, os_, qs), err

        self.consts = list(closed.consts)
        self.sizes = np.zeros((max(n_leaves, 1),), np.float32)
        # Compiled in the background in the order they are needed.
        init = StrictJit(start).prepare(params)
        opt = jax.eval_shape(start, params)[1]
        self.run = StrictJit(pair_step).prepare((params, opt), (params, opt), self.sizes, np.int32(0), np.int32(0),
                                                self.consts)
        prog.prepare((params, *rest))
        twin, o0, o1 = init(params)
        self.start = [(params, o0), (twin, o1)]
        self.rows: list = [[None] * 4 for _ in range(steps + 1)]
        self.final: list = [None, None]

    def lane(self, k: int) -> None:
        """Dispatches lane ``k``'s ``steps + 1`` calls (lane 0 first: lane 1's noise reads it)."""
        if self.final[k] is not None:
            return
        pol = f32 = self.start[k]
        for i in range(self.steps + 1):
            (lp, qp, op), (ls, qs, os_), err = self.run(pol, f32, self.sizes, np.int32(k), np.int32(i), self.consts)
            if i == 0 and k == 0 and self.half is not None:
                self.sizes = err
            self.rows[i][k], self.rows[i][2 + k] = lp, ls
            if i < self.steps:
                pol, f32 = (qp, op), (qs, os_)
        self.final[k] = pol[0]

    @property
    def policy_params(self):
        """The policy run's parameters after the last step (lane 0)."""
        self.lane(0)
        return self.final[0]

    def losses(self, k: int) -> np.ndarray:
        """Lane ``k``'s losses, ``[steps+1, 2]`` (policy, float32); row ``steps``: after the last step."""
        self.lane(k)
        return np.asarray(jax.device_get([[r[k], r[2 + k]] for r in self.rows]), np.float64)
