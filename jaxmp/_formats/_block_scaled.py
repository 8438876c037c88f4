"""The block-scaled quantizer: E4M3 / E5M2 / E2M1 elements, one scale per block (1x32, 1x16,
1x128, 128x128, a whole row), scales in E8M0 (a power of two), E4M3 (with NVFP4's per-tensor
float32 second level) or float32; optional stochastic rounding and a random Hadamard transform.

Pure ``jnp`` with exact arithmetic (powers of two are built from their bits, never with ``log2``
or ``exp2``, and never as a subnormal float32, which a backend may flush to zero), so the same
bits come out on every backend, under ``jit`` and op by op.

Layout: ``x`` is 2-D ``[rows, k]`` with the contraction axis last (``_block_ops`` moves it
there); a block ``(a, b)`` is ``a`` rows by ``b`` consecutive elements of ``k``; ``"row"`` is
``(1, k)``. Ragged edges are padded with zeros (they change no amax) and cut off again.

Scales follow the OCP MX convention: the *decode* scale ``X``, ``x ~= q * X``.

E8M0 scale rules (``X = 2**e``; ``emax`` is the exponent of the element format's largest
normal: 8 for E4M3, 15 for E5M2, 2 for E2M1; ``e`` is clamped to [-127, 127]). Each is one
peer's rule, bit for bit (tests/fp8/test_peer_reference.py holds them to torchao's own code):

- ``"floor"``: ``e = floor(log2(amax)) - emax`` from amax's exponent field (a subnormal amax
  reads as 2**-127): the OCP Microscaling spec v1.0 (section 6.3) and torchao's
  ``ScaleCalculationMode.FLOOR`` (its default in ``to_mx``). Values up to ``2**(emax+1)`` map
  above the element's max and saturate: at amax 0.9 (E4M3) ``X = 2**-9`` and 0.9 becomes 460.8,
  saturated to 448; at 449, ``X = 1`` and 449 saturates to 448.
- ``"even"``: torchao's ``EVEN``: amax's float32 mantissa is first rounded (half up) to the
  element's mantissa bits, then the floor rule; the exponent moves up only when that rounding
  carries (E4M3: mantissa >= 1.9375), so 0.9 and 449 give what ``"floor"`` gives.
- ``"ceil"``: torchao's ``CEIL``: amax's exponent rounded up (``+1`` when its mantissa is not
  zero), minus ``emax``. Never saturates; 448 -> ``2**1``, 0.9 -> ``2**-8``.
- ``"rceil"``: ``amax / max`` as an IEEE float32 (gradual underflow), rounded up to a power of
  two: torchao's ``RCEIL`` (the hardware's ``cvt.rp.satfinite.ue8m0x2.f32``), JAX's
  ``scaled_dot_general`` MXFP8 quantizer and Transformer Engine's ``float_to_e8m0(amax *
  max_norm_rcp)`` (the product and the quotient round up alike for every float32 amax and the
  three element formats). 448 -> 1, 449 -> 2, 0.9 -> ``2**-8``.

Every rule, and every element scaling, is computed from the bits: XLA:CPU flushes subnormal
operands and results to zero, so a subnormal value is never handed to float arithmetic
(`ldexp`, `_divide_exact`, `abs_max`).

Traps handled: amax 0 gives ``X = 1`` (E8M0 has no zero; a plain cast of 0 to
``float8_e8m0fnu`` is NaN; Transformer Engine and torchao store ``2**-127`` there, which decodes
the same zeros); a scale is never a plain cast to E8M0 (that rounds to nearest, not the rule);
an inf or NaN amax gives the NaN scale (E8M0 0xFF), and the whole block decodes to NaN.

E4M3 scales are NVFP4's: the per-tensor ``g = amax_tensor / (448 * 6)`` (1 where the tensor is
all zero, at least ``2**-126``), per block ``s = e4m3(amax(x / g) * float32(1 / 6))`` (an E4M3
subnormal or 0 below E4M3's smallest normal, as Transformer Engine and JAX do; torchao floors it
at ``2**-6``), ``q = e2m1((x / g) / s)``, ``x ~= q * s * g``. float32 scales are ``amax / max``
exactly, at least ``2**-126`` (1 for an all-zero block).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _keys
from jaxmp._formats._elements import E2M1, E4M3, E8M0, ELEMENTS, ElementFormat, element_format

SCALE_FORMATS = ("float32", "e8m0", "e4m3")
POW2_RULES = ("floor", "even", "ceil", "rceil")
SCALE_RULES = ("exact", *POW2_RULES)
NVFP4_GLOBAL = ELEMENTS[E4M3].max * ELEMENTS[E2M1].max
"""NVFP4's per-tensor level: E4M3's largest value times E2M1's (448 * 6)."""


def bits_of(x: jax.Array) -> jax.Array:
    """The int32 bits of float32 ``x``.

    Tests on them avoid ``bits & 0x7FFFFFFF == 0`` (and ``!= 0``, ``> 0``): LLVM folds that back
    into a float comparison with 0, which a backend that treats subnormals as zero (XLA:CPU)
    answers wrongly for a subnormal. Sign-free values are tested with ``bits > 0`` instead, and
    the exponent field and mantissa separately.
    """
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def pow2(e: jax.Array) -> jax.Array:
    """float32 ``2**e`` for int32 ``e`` in [-126, 127], built from its bits (exact)."""
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def times_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x * 2**e`` for int32 ``e`` in [-254, 254] as two exact normal multiplications (exact
    where ``x`` and the result are normal floats; see `ldexp` for every float)."""
    e = e.astype(jnp.int32)
    h = e // 2
    return x * pow2(h) * pow2(e - h)


def ldexp(x: jax.Array, e: jax.Array) -> jax.Array:
    """IEEE float32 ``x * 2**e``, rounded to nearest even into the subnormals, for every float32
    ``x`` (zeros, subnormals, inf and NaN included) and int32 ``e``.

    Built from the bits: no operand or result of a float operation is ever a subnormal, which a
    backend may flush to zero (XLA:CPU does, TPUs do), so the same bits come out everywhere.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> blocks = jaxmp._formats._block_scaled
      >>> float(blocks.ldexp(jnp.float32(1e-40), jnp.int32(127)))  # doctest: +ELLIPSIS
      0.01701...
    """
    x = jnp.asarray(x, jnp.float32)
    e = jnp.asarray(e, jnp.int32)
    bits = bits_of(x)
    field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # x = sig * 2**ex with an integer sig < 2**24: exact as a float, and never subnormal.
    sig = jnp.where(field == 0, mant, mant | 0x800000).astype(jnp.float32)
    ex = jnp.where(field == 0, -149, field - 150) + e
    top = jnp.where(sig > 0, floor_log2(jnp.where(sig > 0, sig, 1.0)), 0)
    normal = top + ex >= -126
    # A normal result: two exact normal multiplications (clipped exponents overflow to inf).
    big = times_pow2(sig, jnp.clip(ex, -160, 160))
    # A subnormal one: its mantissa bits are the integer round(sig * 2**(ex + 149)), ties to even.
    small = jnp.round(times_pow2(sig, jnp.clip(ex + 149, -40, 30))).astype(jnp.int32)
    mag = jnp.where(normal, jax.lax.bitcast_convert_type(big, jnp.int32), small)
    # Zeros come out of the arithmetic above as zeros of their sign; inf and NaN stay as they are.
    return jax.lax.bitcast_convert_type(jnp.where(field == 255, bits, mag | (bits & jnp.int32(-0x80000000))), jnp.float32)


def divide(x: jax.Array, c: float) -> jax.Array:
    """``x / c`` rounded once, also under ``jit``: XLA would rewrite a division by a constant into
    a multiplication by its rounded reciprocal (another result), so the constant goes behind an
    optimization barrier."""
    return x / jax.lax.optimization_barrier(jnp.float32(c))


def _fields(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    bits = bits_of(a)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def floor_log2(a: jax.Array) -> jax.Array:
    """``floor(log2(a))`` of positive finite float32 ``a`` from its bits; subnormals give -127
    (the exponent field read as torchao reads it)."""
    field, _ = _fields(a)
    return jnp.where(field == 0, -127, field - 127)


def abs_max(xb: jax.Array, axis: tuple) -> jax.Array:
    """The float32 ``max(|x|)`` over ``axis`` (0 over nothing), from the bits: the magnitudes of
    non-negative floats order as their int32 bits, where a float ``max`` may take a subnormal
    for zero (XLA:CPU does). A NaN gives some NaN; callers mark non-finite blocks themselves."""
    mag = bits_of(xb) & 0x7FFFFFFF
    return jax.lax.bitcast_convert_type(jnp.max(mag, axis=axis, initial=0), jnp.float32)


def _rceil(amax: jax.Array, elem: ElementFormat) -> jax.Array:
    """The RCEIL exponent: ``amax / max`` as an IEEE float32 (gradual underflow), rounded up to a
    power of two as ``cvt.rp.satfinite.ue8m0x2.f32`` does (a quotient at most ``2**-127`` gives
    -127; one in ``(2**-127, 2**-126)`` gives -126). Exact on every backend: a quotient that
    would be subnormal is never formed."""
    normal = amax >= jnp.float32(elem.max * 2.0 ** -126)  # exact: max has 2 or 3 significant bits
    qfield, qmant = _fields(divide(jnp.where(normal, amax, jnp.float32(elem.max)), elem.max))
    e_normal = qfield - 127 + (qmant > 0).astype(jnp.int32)
    # A subnormal quotient rounds above 2**-127 iff amax / max > 2**-127 * (1 + 2**-23) (the tie
    # rounds to even: to 2**-127). With a = amax * 2**127 (exact), a - max is exact (Sterbenz)
    # where it matters, a in [max / 2, 2 max].
    a = ldexp(amax, jnp.int32(127))
    above = (a - jnp.float32(elem.max)) > jnp.float32(elem.max * 2.0 ** -23)
    return jnp.where(normal, e_normal, jnp.where(above, -126, -127))


def e8m0_exponent(amax: jax.Array, elem: ElementFormat, rule: str) -> jax.Array:
    """The unbiased int32 exponent ``e`` of ``X = 2**e`` for float32 ``amax`` under ``rule``
    (see the module docstring), from the bits (exact for subnormal amaxes too); 0 where amax is
    0; garbage where amax is not finite (the caller marks those NaN)."""
    amax = amax.astype(jnp.float32)
    # "> 0" from the bits (amax has no sign): a backend that treats subnormals as zero (XLA's CPU
    # does) would call a subnormal amax zero.
    usable = jnp.isfinite(amax) & (bits_of(amax) > 0)
    safe = jnp.where(usable, amax, jnp.float32(1.0))
    if rule == "floor":
        e = floor_log2(safe) - elem.emax
    elif rule == "even":
        bits = bits_of(safe) + (1 << (23 - elem.mbits - 1))
        e = floor_log2(jax.lax.bitcast_convert_type(bits & 0x7F800000, jnp.float32)) - elem.emax
    elif rule == "ceil":
        _, mant = _fields(safe)
        e = floor_log2(safe) + (mant > 0).astype(jnp.int32) - elem.emax
    elif rule == "rceil":
        e = _rceil(safe, elem)
    else:
        raise ValueError(f"E8M0 scale rule must be one of {POW2_RULES}, got {rule!r}")
    return jnp.where(usable, jnp.clip(e, -127, 127), 0)


def e8m0_bits(e: jax.Array, bad: jax.Array) -> jax.Array:
    """E8M0 storage of ``2**e`` (biased exponent; 0xFF, NaN, where ``bad``)."""
    biased = jnp.where(bad, 255, e + 127).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(biased, E8M0)


def e8m0_exponent_of(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(e, is_nan)`` of stored E8M0 scales (read from the bits, never a conversion)."""
    biased = jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
    return biased - 127, biased == 255


class Quantized(NamedTuple):
    """A block-quantized 2-D tensor: elements, one scale per block, NVFP4's per-tensor scale.

    Attributes:
      q: the elements, ``[rows, k]`` padded to whole blocks, in the element dtype.
      scale: ``[rows / a, k / b]`` in ``float8_e8m0fnu``, ``float8_e4m3fn`` or float32.
      global_scale: float32 scalar (E4M3 scales) or None.
      shape: the unpadded ``(rows, k)``.
      block: the block ``(a, b)`` actually used.
    """

    q: jax.Array
    scale: jax.Array
    global_scale: jax.Array | None
    shape: tuple
    block: tuple


def resolve_block(block: Any, shape: tuple) -> tuple[int, int]:
    """``block`` (``"row"`` or ``(a, b)``) as ``(a, b)`` for a 2-D ``shape``."""
    if block == "row":
        return 1, max(int(shape[1]), 1)
    a, b = block
    return int(a), int(b)


def blocked(x: jax.Array, a: int, b: int) -> jax.Array:
    rows, k = x.shape
    pr, pk = -rows % a, -k % b
    if pr or pk:
        x = jnp.pad(x, ((0, pr), (0, pk)))
    return x.reshape((rows + pr) // a, a, (k + pk) // b, b)


def round_stochastic(y: jax.Array, elem: ElementFormat, key: jax.Array) -> jax.Array:
    """``y`` (float32, finite, ``|y| <= max``) rounded to a neighbour on ``elem``'s grid, up
    with probability equal to the distance over the grid spacing (unbiased)."""
    mag = jnp.abs(y)
    e = jnp.maximum(floor_log2(jnp.where(mag > 0, mag, 1.0)), elem.emin)
    ulp = pow2(e - elem.mbits)
    lo = jnp.floor(mag / ulp) * ulp
    up = _keys.uniform(key, y.shape) < (mag - lo) / ulp
    return jnp.sign(y) * jnp.minimum(lo + jnp.where(up, ulp, 0.0), elem.max)



def _float32_scale(amax: jax.Array, elem: ElementFormat) -> jax.Array:
    """float32 block scales ``amax / max``, never below float32's smallest normal (a subnormal
    scale would be flushed by some backends): blocks of amax under ``max * 2**-126`` get
    ``2**-126``; 1 for an all-zero block."""
    tiny = jnp.float32(2.0 ** -126)
    normal = amax >= jnp.float32(elem.max * 2.0 ** -126)
    s = jnp.where(normal, divide(jnp.where(normal, amax, elem.max), elem.max), tiny)
    return jnp.where(bits_of(amax) > 0, s, 1.0)


def _divide_exact(x: jax.Array, d: jax.Array) -> jax.Array:
    """IEEE ``x / d`` for float32 ``x`` (subnormals included) and normal ``d > 0``, where the
    quotient is normal; a subnormal quotient may come out as a zero of its sign (below every
    element format's smallest value either way). A subnormal ``x`` is divided as
    ``(x * 2**64) / (d * 2**64)``: a backend that flushes subnormal operands would read 0."""
    field, _ = _fields(x)
    sub = field == 0
    num = jnp.where(sub, ldexp(x, jnp.int32(64)), x)
    den = jnp.where(sub, ldexp(d, jnp.int32(64)), d)
    return num / den


def _nvfp4(xb: jax.Array, amax: jax.Array, bad: jax.Array, elem: ElementFormat) -> tuple:
    """NVFP4's two levels for blocked ``xb``: (E4M3 block scales, per-tensor scale, ``x / (g s)``).

    In the order of JAX's scaled_dot_general (bit-equal to it, tests/fp8/test_block_ops.py):
    divide by the per-tensor scale first, then by the block scale ``amax / 6`` as XLA computes it
    under jit (times the float32 reciprocal), saturated to E4M3, rounded to nearest: a block
    scale below E4M3's smallest normal stays an E4M3 subnormal, or 0 (as Transformer Engine and
    JAX do; torchao floors it at 2**-6, docs/fp8.md#against-the-peers).
    """
    # initial=0: an empty tensor has no amax (and scale 1). g is a normal float32: at least 2**-126.
    t = abs_max(amax, tuple(range(amax.ndim)))  # NaN if any block is bad
    g = jnp.where(t >= jnp.float32(NVFP4_GLOBAL * 2.0 ** -126),
                  divide(jnp.where(jnp.isfinite(t), t, 0.0), NVFP4_GLOBAL), jnp.float32(2.0 ** -126))
    g = jnp.where(jnp.isfinite(t) & (bits_of(t) > 0), g, 1.0)
    xg = _divide_exact(xb, g)
    s = jnp.clip(abs_max(xg, (1, 3)) * jnp.float32(1.0 / elem.max), 0.0, ELEMENTS[E4M3].max)
    s = s.astype(E4M3)
    scale = jnp.where(bad, jnp.nan, s.astype(jnp.float32)).astype(E4M3)
    d = s.astype(jnp.float32)[:, None, :, None]
    y = jnp.where(d > 0, xg / jnp.where(d > 0, d, 1.0), 0.0)
    return scale, g, y


def quantize(x: jax.Array, dtype: Any, block: Any = (1, 32), scale_format: str = "e8m0", rule: str = "floor",
             key: jax.Array | None = None) -> Quantized:
    """Block-quantizes a 2-D ``x`` (contraction axis last).

    Args:
      x: ``[rows, k]`` floating.
      dtype: the element format (E4M3, E5M2 or E2M1).
      block: ``(a, b)`` or ``"row"``.
      scale_format: ``"e8m0"``, ``"e4m3"`` (two-level, NVFP4) or ``"float32"``.
      rule: an E8M0 rule (``"floor"``, ``"even"``, ``"ceil"``, ``"rceil"``: torchao's FLOOR,
        EVEN, CEIL, RCEIL); ``"exact"`` for the other scale formats.
      key: a PRNG key for stochastic rounding (None: round to nearest even).

    Returns:
      A `Quantized`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> x = jnp.array([[0.9, -0.25]])
      >>> blocks = jaxmp._formats._block_scaled
      >>> qx = blocks.quantize(x, jnp.float8_e4m3fn, (1, 2), "e8m0", "rceil")
      >>> blocks.dequantize(qx).tolist()
      [[0.875, -0.25]]
    """
    elem = element_format(dtype)
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if (scale_format == "e8m0") != (rule in POW2_RULES):
        raise ValueError(f"scale rule {rule!r} does not go with scale_format {scale_format!r}: E8M0 scales take "
                         f"one of {POW2_RULES}, float32 and E4M3 scales take 'exact'")
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D [rows, k] array, got shape {x.shape}")
    a, b = resolve_block(block, x.shape)
    xb = blocked(x.astype(jnp.float32), a, b)
    # A block's NaN/inf is found by its own reduction, never by trusting max to propagate NaN:
    # XLA's CPU max (fast min/max) drops a NaN next to the zero padding of a ragged block.
    bad = jnp.any(~jnp.isfinite(xb), axis=(1, 3))
    amax = jnp.where(bad, jnp.float32(jnp.nan), abs_max(xb, (1, 3)))
    g = None
    if scale_format == "e8m0":
        e = e8m0_exponent(amax, elem, rule)
        scale = e8m0_bits(e, bad)
        y = ldexp(xb, -e[:, None, :, None])
    elif scale_format == "float32":
        s = _float32_scale(amax, elem)
        scale = jnp.where(bad, jnp.nan, s)
        y = _divide_exact(xb, jnp.where(bad, 1.0, s)[:, None, :, None])
    else:
        scale, g, y = _nvfp4(xb, amax, bad, elem)
    y = jnp.where(jnp.isfinite(y), jnp.clip(y, -elem.max, elem.max), 0.0)
    if key is not None:
        y = round_stochastic(y, elem, key)
    q = y.astype(elem.dtype).reshape(xb.shape[0] * a, xb.shape[2] * b)
    # XLA may fold a later ``fp8 -> float32`` back into a no-op (SimplifyFPConversions under
    # xla_allow_excess_precision), and the matmul would see unquantized values: the barrier keeps
    # the cast, as in JAX's own scaled_dot_general emulation.
    q = jax.lax.optimization_barrier(q)
    return Quantized(q, scale, g, tuple(x.shape), (a, b))


def decode_scale(qx: Quantized) -> jax.Array:
    """The float32 decode scale of each block (NaN for a bad block), without the global scale."""
    if qx.scale.dtype == E8M0:
        e, nan = e8m0_exponent_of(qx.scale)
        return jnp.where(nan, jnp.nan, ldexp(jnp.ones(e.shape, jnp.float32), e))
    return qx.scale.astype(jnp.float32)


def _times_scale(q: jax.Array, s: jax.Array) -> jax.Array:
    """``q * s`` for normal float32 ``q`` and ``s``, with a subnormal product formed from the bits
    (`ldexp`), never flushed; such a product may be rounded twice (to 24 bits, then to the
    subnormal grid) where ``q * s`` has more than 24 significant bits."""
    small = s < 1.0
    lifted = q * jnp.where(small, ldexp(s, jnp.int32(64)), s)
    return jnp.where(small, ldexp(lifted, jnp.int32(-64)), lifted)


def dequantize(qx: Quantized, dtype: Any = jnp.float32, with_global: bool = True) -> jax.Array:
    """``q * X`` (times NVFP4's global scale unless ``with_global=False``) as ``[rows, k]``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> blocks = jaxmp._formats._block_scaled
      >>> qx = blocks.quantize(jnp.zeros((1, 4)), jnp.float4_e2m1fn, (1, 4))
      >>> blocks.dequantize(qx).tolist()
      [[0.0, 0.0, 0.0, 0.0]]
    """
    a, b = qx.block
    n, m = qx.scale.shape
    qb = qx.q.astype(jnp.float32).reshape(n, a, m, b)
    if qx.scale.dtype == E8M0:
        e, nan = e8m0_exponent_of(qx.scale)
        out = jnp.where(nan[:, None, :, None], jnp.nan, ldexp(qb, e[:, None, :, None]))
    else:
        out = _times_scale(qb, qx.scale.astype(jnp.float32)[:, None, :, None])
    if with_global and qx.global_scale is not None:
        out = _times_scale(out, qx.global_scale)
    rows, k = qx.shape
    return out.reshape(n * a, m * b)[:rows, :k].astype(dtype)


def hadamard_signs(key: jax.Array, n: int = 16) -> jax.Array:
    """The ``n`` random signs (float32 +-1) of a random Hadamard transform, from ``key``."""
    return jax.random.rademacher(key, (n,), jnp.float32)


def apply_hadamard(x: jax.Array, signs: jax.Array) -> jax.Array:
    """``x`` (``[rows, k]``, float32) times the block-diagonal ``H diag(signs) / sqrt(n)`` along
    ``k`` (``n = len(signs)``, a power of two; Sylvester's ``H``), by butterflies (adds and
    subtracts, no matmul: nothing for autocast to see). ``k`` is zero-padded to whole blocks,
    which keeps ``(x R)(y R)^T == x y^T`` for any ``k``."""
    n = signs.shape[0]
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-two size, got {n}")
    rows, k = x.shape
    pad = -k % n
    xp = (jnp.pad(x, ((0, 0), (0, pad))) if pad else x).astype(jnp.float32)
    lead = (rows, (k + pad) // n)
    h = 1
    while h < n:
        pairs = xp.reshape(*lead, n // (2 * h), 2, h)
        lo, hi = pairs[..., 0, :], pairs[..., 1, :]
        xp = jnp.stack([lo + hi, lo - hi], axis=-2).reshape(*lead, n)
        h *= 2
    return (xp * (signs / np.float32(np.sqrt(n)))).reshape(rows, k + pad)


def hadamard(key: jax.Array, n: int = 16) -> jax.Array:
    """The random orthogonal ``n x n`` transform `apply_hadamard` applies per block, as a matrix.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmp
      >>> h = jaxmp._formats._block_scaled.hadamard(jax.random.key(0))
      >>> bool((h @ h.T == jnp.eye(16)).all())
      True
    """
    return apply_hadamard(jnp.eye(n, dtype=jnp.float32), hadamard_signs(key, n))
