"""8-bit and 4-bit optimizer moments as an optax transformation (re-exported as ``jaxmp.lean.quantized_moments``).

Blockwise dynamic quantization (bitsandbytes' 8-bit Adam, torchao's 4-bit AdamW): each large moment
leaf is stored as uint8 codes plus one float32 absmax per block; ``update`` dequantizes, runs the
inner optimizer in float32 and requantizes. The scheme: jaxmp/_blockwise.py; the choices and the
measurements: docs/lean-recipes.md#8-bit-and-4-bit-moments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp import _blockwise
from jaxmp._dtypes import is_floating_array
from jaxmp._keys import key_data as _key_data, leaf_keys
from jaxmp._scaling._transform import check_inner
from jaxmp._typing import PyTree

#: NamedTuple fields (optax's state classes) that hold non-negative moments: squares and their
#: running means. A leaf under one of them gets the non-negative map; every other quantized leaf
#: the signed one (correct for any sign, one bit less precise for a non-negative leaf).
NON_NEGATIVE_FIELDS = frozenset({"nu", "nu_max", "sum_of_squares", "v_row", "v_col", "e_g", "e_x"})

#: Leaves with fewer elements stay float32 (bitsandbytes' ``min_8bit_size``, torchao's 4096):
#: biases and norms cost little and their per-block scale would cost more than it saves.
MIN_SIZE = 4096

_BLOCKS = {8: 256, 4: 128}   # torchao's AdamW8bit / AdamW4bit (bitsandbytes: 256 on the GPU path)
_ROUNDINGS = ("nearest", "stochastic")


class QuantizedMomentsState(NamedTuple):
    """State of [`quantized_moments`][jaxmp.lean.quantized_moments].

    Attributes:
      inner_state: the wrapped transformation's state with each quantized leaf (floating, ``ndim >= 1``,
        at least ``min_size`` elements) replaced by its codes: uint8 of the leaf's shape (8 bits), or two
        4-bit codes a byte (the last axis halved when it is even, else flat: ``ceil(size / 2)``). Other
        leaves (small moments, counts, hyperparameters) as the inner transformation keeps them.
      absmax: the same tree as ``inner_state`` with one float32 scale per block of ``block``
        consecutive elements (C order) at each quantized leaf and None elsewhere: of shape
        ``shape[:-1] + (shape[-1] // block,)`` when the leaf's last axis is a whole number of
        blocks (and even, at 4 bits), else ``(ceil(size / block),)``.
      key: uint32[2], the raw threefry2x32 key data (zeros for nearest rounding; constant).
      count: int32 [], updates applied so far (folded into ``key`` for each update's bits).
      grid: the ``bits`` and ``block`` the leaves are cut by: static (part of the tree's structure,
        no leaf), so that jaxmp.parallel's ZeRO and FSDP layouts split each quantized leaf where
        no block crosses a device.
    """

    inner_state: optax.OptState
    absmax: PyTree
    key: jax.Array
    count: jax.Array  # type: ignore[assignment]  # optax names its step counters count
    grid: _blockwise.Grid


def _non_negative(path: tuple) -> bool:
    """The leaf's class from the state's structure: a NamedTuple field on its path named in
    `NON_NEGATIVE_FIELDS` (dict keys, the user's param names, never count)."""
    return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in NON_NEGATIVE_FIELDS for k in path)


def _quantizable(x: Any, min_size: int) -> bool:
    return (is_floating_array(x) and jnp.ndim(x) >= 1 and jnp.asarray(x).dtype in (jnp.float32, jnp.bfloat16)
            and int(np.prod(jnp.shape(x))) >= max(min_size, 1))


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def quantized_moments(inner: optax.GradientTransformation, key: jax.Array | int | None = None, *, bits: int = 8,
                      block: int | None = None, rounding: str = "nearest",
                      min_size: int = MIN_SIZE) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s moments in 8 or 4 bits a value, blockwise (bitsandbytes' 8-bit Adam, torchao's 4-bit).

    Each floating state leaf with ``ndim >= 1`` and at least ``min_size`` elements is kept as uint8 codes
    plus a float32 absmax per ``block`` consecutive elements: 1 + 4/256 bytes a value at 8 bits, 0.5 +
    4/128 at 4. ``update`` dequantizes them, runs ``inner`` in float32 and requantizes the new state.
    A leaf under a NamedTuple field named ``nu``, ``nu_max``, ``sum_of_squares``, ``v_row``, ``v_col``,
    ``e_g`` or ``e_x`` is non-negative (unsigned dynamic map at 8 bits; the zero-free linear map
    ``(i + 1) / 16`` at 4 bits, so no second moment rounds to 0); every other one is signed (dynamic
    map). The class comes from the state's structure, never from the values' signs at run time.
    A partial last block is zero-padded in the computation (the padding is not stored); smaller
    leaves and scalars (step counts) keep their dtype. See docs/lean-recipes.md#8-bit-and-4-bit-moments.

    Args:
      inner: the optax transformation whose moments are quantized (e.g. ``optax.adamw``).
      key: an int seed or a threefry2x32 ``jax.random.key``; required for stochastic rounding.
      bits: 8 or 4.
      block: elements per absmax (default 256 at 8 bits, 128 at 4: torchao's); under ZeRO/FSDP, pick
        it so that ``size / devices`` is a multiple of it: no block then crosses a device.
      rounding: ``"nearest"`` (default, as bitsandbytes and torchao) or ``"stochastic"``.
      min_size: leaves with fewer elements stay in their dtype (4096, bitsandbytes' ``min_8bit_size``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is [`QuantizedMomentsState`][jaxmp.lean.QuantizedMomentsState].

    Raises:
      ValueError: ``bits`` not 8 or 4, a ``block`` < 2, a ``min_size`` < 0 or an unknown ``rounding``.
      TypeError: no ``key`` for stochastic rounding.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxmp.lean import quantized_moments
      >>> tx = quantized_moments(optax.adam(1e-3), bits=8)
      >>> state = tx.init({"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)})
      >>> adam = state.inner_state[0]
      >>> adam.mu["w"].dtype, state.absmax[0].nu["w"].shape, adam.mu["b"].dtype   # "b" is too small
      (dtype('uint8'), (32,), dtype('float32'))
      >>> updates, state = tx.update({"w": jnp.ones((64, 128)), "b": jnp.ones(128)}, state)
    """
    inner = check_inner(inner)
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    block = _BLOCKS[bits] if block is None else _check_int(block, "block", 2)
    min_size = _check_int(min_size, "min_size", 0)
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    key_data = _key_data(key, "quantized_moments") if rounding == "stochastic" or key is not None \
        else jnp.zeros(2, jnp.uint32)

    grid = _blockwise.Grid(bits, block)

    def quantize(path, x, k=None):
        return _blockwise.quantize(x, bits, not _non_negative(path), block, k)

    def init_fn(params):
        state = inner.init(params)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        stored, scales = [], []
        for path, x in leaves:
            if _quantizable(x, min_size):
                codes, absmax = quantize(path, x)
                stored.append(codes)
                scales.append(absmax)
            else:
                stored.append(x)
                scales.append(None)
        return QuantizedMomentsState(treedef.unflatten(stored), treedef.unflatten(scales), jnp.array(key_data),
                                     jnp.zeros([], jnp.int32), grid)

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, QuantizedMomentsState):
            raise TypeError(f"state must be the QuantizedMomentsState made by quantized_moments' init, got "
                            f"{type(state).__name__}")
        if state.grid != grid:
            raise ValueError(f"quantized_moments: the state was made with bits={state.grid.bits}, "
                             f"block={state.grid.block}, this transformation has bits={bits}, block={block}")
        # The leaves' own shapes (4-bit codes are packed): the inner state the grads' shapes give.
        template = jax.eval_shape(inner.init, grads)
        t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        stored = treedef.flatten_up_to(state.inner_state)
        scales = treedef.flatten_up_to(state.absmax)
        wide = []
        for (path, t), c, a in zip(t_leaves, stored, scales):
            if a is None:
                wide.append(c)
                continue
            if jnp.shape(c) != _blockwise.codes_shape(t.shape, bits) or a.shape != _blockwise.scales_shape(
                    t.shape, bits, block):
                raise ValueError(f"quantized_moments: state leaf at {jax.tree_util.keystr(path)} holds codes of shape "
                                 f"{jnp.shape(c)} and {a.shape} scales, not those of a {t.shape} moment: the "
                                 "state was made for other params (or another bits/block)")
            wide.append(_blockwise.dequantize(c, a, bits, not _non_negative(path), block, t.shape))
        updates, new_inner = inner.update(grads, treedef.unflatten(wide), params, **extra_args)
        new_leaves = treedef.flatten_up_to(new_inner)
        keys = leaf_keys(state.key, state.count, len(new_leaves)) if rounding == "stochastic" else [None] * len(
            new_leaves)
        out, out_scales = [], []
        for (path, _), new, a, k in zip(t_leaves, new_leaves, scales, keys):
            if a is None:
                out.append(new)
                out_scales.append(None)
            else:
                codes, absmax = quantize(path, new, k)
                out.append(codes)
                out_scales.append(absmax)
        return updates, QuantizedMomentsState(treedef.unflatten(out), treedef.unflatten(out_scales), state.key,
                                              (state.count + 1).astype(jnp.int32), grid)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
