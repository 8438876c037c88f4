"""The block-scaled ``dot_general``: each of the three matmuls of a linear layer (forward,
dgrad, wgrad) quantizes its two operands along its own contraction axis, in the format the
recipe gives that leg, with a custom gradient (`jaxmp.fp8.fp8_dot_general` calls it for a
[`CurrentScaling`][jaxmp.fp8.CurrentScaling] with ``block`` set).

Legs: forward ``x . w`` (both ``fwd_dtype``); dgrad ``g . w`` (``g`` in ``bwd_dtype`` with
``block``, ``w`` re-quantized along its other axis in ``fwd_dtype`` with ``rhs_block``); wgrad
``x . g`` (``x`` re-quantized along the token axis in ``fwd_dtype``, ``g`` in ``bwd_dtype``, both
with ``block``; optionally after a random Hadamard transform). A leg in ``high_precision_legs``
runs on the unquantized operands. Re-quantizing from the high-precision tensor is what
Transformer Engine's columnwise copies and torchao's MX backward do.

The emulation dequantizes into the operands' dtype and runs ``lax.dot_general`` there: exact
for power-of-two (E8M0) scales and for NVFP4's E4M3 block scales (NVFP4's forward applies its
per-tensor scales to the float32 product; its backward legs round them into the operands, as
float32 block scales are rounded, once).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp.fp8._block_watch import watch, watched_stack
from jaxmp._formats._block_scaled import apply_hadamard, dequantize, hadamard_signs, quantize
from jaxmp.fp8._hardware import native_block
from jaxmp.fp8._recipes import CurrentScaling
from jaxmp.fp8._tangents import is_zero, rounded_cotangent, straight_through, tangent_sum

KEY_IMPL = "threefry2x32"  # as jaxmp's other stochastic rounding: bits independent of sharding


def qdq(x: jax.Array, contract: tuple, batch: tuple, dtype: Any, block: Any, recipe: CurrentScaling,
        key: jax.Array | None = None, h: jax.Array | None = None, split_global: bool = False,
        leg: tuple = ()) -> Any:
    """``x`` quantized and dequantized with blocks along the axes ``contract`` (flattened, in
    order; ``batch`` first, then the free axes, form the rows), back in ``x``'s layout and dtype.
    ``h``: the signs of a Hadamard transform applied along the contraction axis first (its length a multiple
    of the transform's size). ``split_global``: NVFP4's per-tensor scale left out of the values
    (exact in the compute dtype then) and returned beside them. ``leg``: ``(leg, operand, stack)``
    for the debugger's block watch (`jaxmp.fp8._block_watch`; empty when it is off)."""
    free = tuple(d for d in range(x.ndim) if d not in contract and d not in batch)
    perm = (*batch, *free, *contract)
    xt = jnp.transpose(x, perm)
    rows = math.prod(xt.shape[:len(batch) + len(free)])
    x2 = xt.reshape(rows, math.prod(xt.shape[len(batch) + len(free):]))
    if h is not None:
        x2 = apply_hadamard(x2, h)
    qx = quantize(x2, dtype, block, recipe.scale_format, recipe.scale_rule, key)
    if leg:
        watch(x2, qx, *leg)
    # An fp8 (or fp4) operand is dequantized into float32, which holds every decoded value: in its
    # own dtype NVFP4's q * s (up to 6 * 448) is NaN in E4M3 and an E5M2 value may not round-trip.
    dt = jnp.float32 if jnp.dtype(x.dtype).itemsize < 2 else x.dtype
    out = dequantize(qx, dt, with_global=not split_global).reshape(xt.shape)
    out = jnp.transpose(out, tuple(perm.index(d) for d in range(x.ndim)))
    return (out, qx.global_scale) if split_global else out


def rotate(x: jax.Array, contract: tuple, batch: tuple, h: jax.Array) -> jax.Array:
    """The linear part of `qdq` with a Hadamard transform: ``x`` in the same layout, transformed
    along ``contract`` by the signs ``h``, unquantized (in ``x``'s dtype)."""
    free = tuple(d for d in range(x.ndim) if d not in contract and d not in batch)
    perm = (*batch, *free, *contract)
    xt = jnp.transpose(x, perm)
    rows = math.prod(xt.shape[:len(batch) + len(free)])
    x2 = apply_hadamard(xt.reshape(rows, math.prod(xt.shape[len(batch) + len(free):])), h)
    out = x2.astype(x.dtype).reshape(xt.shape)
    return jnp.transpose(out, tuple(perm.index(d) for d in range(x.ndim)))


def _sr_key(recipe: CurrentScaling, g: jax.Array, leg: int) -> jax.Array | None:
    if not recipe.stochastic_rounding:
        return None
    # Folded with the cotangent's bits so that the draws change from step to step without a key
    # in the signature (autocast's functions have none).
    data = jax.lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
    key = jax.random.fold_in(jax.random.key(recipe.seed, impl=KEY_IMPL), leg)
    return jax.random.fold_in(key, data)


def block_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, recipe: CurrentScaling,
                      preferred_element_type: Any = None, precision: Any = None) -> jax.Array:
    """``lax.dot_general`` with block-scaled operands in every leg (see the module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> r = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn,
      ...                        scale_format="e8m0", scale_rule="floor")
      >>> dims = (((1,), (0,)), ((), ()))
      >>> x, w = jnp.ones((2, 64)), jnp.full((64, 3), 0.5)
      >>> fp8._block_ops.block_dot_general(x, w, dims, r).tolist()
      [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
    nb = len(lb)
    out_batch = tuple(range(nb))
    out_lf = tuple(range(nb, nb + len(lf)))
    out_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
    rhs_block = recipe.block if recipe.rhs_block is None else recipe.rhs_block
    fwd_dt, bwd_dt = recipe.fwd_dtype, recipe.bwd_dtype

    def dot(a, b):
        return jax.lax.dot_general(a, b, ((lc, rc), (lb, rb)), precision=precision,
                                   preferred_element_type=preferred_element_type)

    k = math.prod(lhs.shape[d] for d in lc)
    # The module path, read here: custom_jvp traces ``forward`` in a fresh name stack.
    stack = watched_stack()

    def _leg(leg, operand):
        return () if stack is None else (leg, operand, stack)
    # Stage 3: the native MXFP8 forward where it exists (Blackwell, JAX >= 0.12), chosen at trace
    # time; untested on Blackwell here, so the branch is this call and nothing else. Its scales
    # are the "rceil" rule, bit-equal to the emulation (tests/fp8/test_block_ops.py, JAX 0.12).
    native = recipe.emulate is not True and len(lc) == 1 and k % 32 == 0 and native_block(recipe)[0]

    def forward(a, b):
        if native:
            out_dt = preferred_element_type if preferred_element_type is not None else jnp.result_type(a, b)
            return jax.nn.scaled_dot_general(a, b, ((lc, rc), (lb, rb)), preferred_element_type=out_dt,
                                             configs=[jax.nn.get_scaled_dot_general_config("mxfp8")] * 3)
        if recipe.scale_format != "e4m3":
            return dot(qdq(a, lc, lb, fwd_dt, recipe.block, recipe, leg=_leg("forward", "lhs")),
                       qdq(b, rc, rb, fwd_dt, rhs_block, recipe, leg=_leg("forward", "rhs")))
        # NVFP4: the per-tensor scales multiply the float32 product, as the hardware's alpha (and
        # JAX's scaled_dot_general) do; the backward legs fold them into their operands instead.
        (qa, ga), (qb, gb) = (qdq(a, lc, lb, fwd_dt, recipe.block, recipe, split_global=True, leg=_leg("forward", "lhs")),
                              qdq(b, rc, rb, fwd_dt, rhs_block, recipe, split_global=True, leg=_leg("forward", "rhs")))
        out_dt = preferred_element_type if preferred_element_type is not None else jnp.result_type(a, b)
        out = jax.lax.dot_general(qa, qb, ((lc, rc), (lb, rb)), precision=precision,
                                  preferred_element_type=jnp.float32)
        return (out * (ga * gb)).astype(out_dt)

    def jvp(primals, tangents):
        # A custom JVP (jaxmp/fp8/_tangents.py): each leg's tangent is its dot on the operand it
        # quantizes, so reverse mode transposes it into that leg's backward matmul, with the
        # cotangent rounded per leg, and forward mode gets the same linear map untransposed.
        (a, b), (ta, tb) = primals, tangents
        y = f(a, b)  # through this rule again in a second derivative, never through the casts
        parts = []
        if not is_zero(ta):
            with jax.named_scope("dgrad"):  # the legs are named, for the precision report and tests
                parts.append(_dgrad(a, b, ta))
        if not is_zero(tb):
            with jax.named_scope("wgrad"):
                parts.append(_wgrad(a, b, tb))
        return y, tangent_sum(parts, y)

    def _dgrad(a, b, ta):
        if "dgrad" in recipe.high_precision_legs:
            return dot(ta, b)
        b_d = straight_through(lambda v: qdq(v, rf, rb, fwd_dt, rhs_block, recipe, leg=_leg("dgrad", "rhs")), b)

        def rounded(g):
            return qdq(g, out_rf, out_batch, bwd_dt, recipe.block, recipe, _sr_key(recipe, g, 0),
                       leg=_leg("dgrad", "gradient")).astype(g.dtype)
        return rounded_cotangent(dot(ta, b_d), rounded)

    def _wgrad(a, b, tb):
        if "wgrad" in recipe.high_precision_legs:
            return dot(a, tb)
        tokens = math.prod(a.shape[d] for d in lf)
        h = None
        if recipe.hadamard and tokens % 16 == 0:
            h = hadamard_signs(jax.random.fold_in(jax.random.key(recipe.seed, impl=KEY_IMPL), 2))
        a_w = straight_through(lambda v: qdq(v, lf, lb, fwd_dt, recipe.block, recipe, None, h, leg=_leg("wgrad", "lhs")),
                               a)

        def rounded(g):
            return qdq(g, out_lf, out_batch, bwd_dt, recipe.block, recipe, _sr_key(recipe, g, 1), h,
                       leg=_leg("wgrad", "gradient")).astype(g.dtype)

        def untransformed(t):  # a_w and the rounded cotangent meet in the Hadamard basis
            transform = functools.partial(rotate, contract=out_lf, batch=out_batch, h=h)
            return t if h is None else jax.linear_transpose(transform, t)(t)[0]
        return rounded_cotangent(dot(a_w, tb), rounded, untransformed)

    f = jax.custom_jvp(forward)
    f.defjvp(jvp, symbolic_zeros=True)
    return f(lhs, rhs)
