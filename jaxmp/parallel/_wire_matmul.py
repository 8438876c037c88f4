"""FSDP weight gathers in the matmul's own fp8 format (issue 63: torchao's float8 all-gather).

``make_sharded_train_step(..., layout="fsdp", gather_bits="O2-fp8-current")`` (a preset name or
a ``jaxmp.fp8.CurrentScaling()``) gathers each matmul kernel as the fp8 codes its matmul would
make of it, so the weight is quantized once, before the wire, instead of twice (8-bit codes on
the wire, then fp8 in the matmul):

- the scale is the matmul's: ``fp8_max / amax`` of the whole kernel, its amax one ``pmax`` over
  the devices' slices (one float32 scalar a leaf, as FSDP2 precomputes torchao's);
- each device sends its slice as fp8 codes (bit-cast to uint8: one byte a parameter), every
  device dequantizes every piece with that scale into the param's dtype: exactly the values
  ``jaxmp.fp8``'s per-tensor quantize-dequantize gives the matmul, whose own quantization of them
  is then an identity (same amax, same scale, codes on the grid): the forward and the dgrad leg
  see what they see without the option, bit for bit (tested).

``"O2-fp8-block128"`` (square ``(a, a)`` weight blocks, E8M0 scales) is taken too: the forward
and the dgrad quantize the kernel in the same blocks (transposed), so each device sends its
slice's codes and one-byte scales in them, the blocks inside its slice (else a ValueError).
MXFP8 and rowwise are not: their blocks run along the kernel's contraction axis for the forward
and along the other axis, from the unquantized kernel, for the dgrad, so a copy gathered in the
forward's blocks is quantized twice in the dgrad, which the option exists to avoid
(docs/parallel.md, "Gathers in the matmul's format", has the measurement). NVFP4's per-tensor
second level is not built. Delayed scaling keeps its scale in the model's fp8 state, out of the
gather's reach.

Which leaves: the gather site does not know which op a leaf feeds, so the rule is the leaf's name,
as Flax spells a matmul's weight: a floating leaf of two or more dimensions whose path ends in
``kernel`` (Linen ``Dense``/``DenseGeneral``/``Conv``, NNX ``Linear``/``LinearGeneral``/``Conv``)
goes in the matmul's format; every other leaf (embeddings, biases, norms) is gathered in its own
dtype, as without the option.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MATMUL_LEAF = "kernel"
"""The last key of a leaf gathered in the matmul's format (Flax's name of a matmul's weight)."""


def is_format(value: Any) -> bool:
    """``gather_bits`` names a matmul format (a preset name or a ``jaxmp.fp8`` recipe), not bits."""
    from jaxmp import fp8

    return isinstance(value, (str, fp8.CurrentScaling, fp8.DelayedScaling))


def check_format(value: Any, layout: Any) -> Any:
    """The per-tensor ``jaxmp.fp8.CurrentScaling`` that ``gather_bits=value`` gathers kernels in.

    Args:
      value: a preset name (``"O2-fp8-current"``) or a ``jaxmp.fp8`` recipe.
      layout: the step's `jaxmp.parallel._layouts.Layout`.

    Returns:
      The recipe: per-tensor, or with square E8M0 weight blocks (`weight_block`).

    Raises:
      ValueError: a name that is no fp8 preset, delayed scaling, another block-scaled recipe, or a layout
        other than ``"fsdp"`` (each named, with the way out).
    """
    from jaxmp import fp8
    from jaxmp.engine._seams import matmul_format

    try:
        ok, recipe = matmul_format(value)
    except ValueError as e:
        raise ValueError(f"gather_bits={value!r}: {e}") from None
    if not ok or recipe is None:
        raise ValueError(f"gather_bits={value!r} names no fp8 matmul format: gather_bits takes None, 8, or the "
                         "fp8 format of the loss's matmuls ('O2-fp8-current', or a jaxmp.fp8.CurrentScaling()), "
                         "whose kernels FSDP then gathers as that format's codes")
    if isinstance(recipe, fp8.DelayedScaling):
        raise ValueError(f"gather_bits={value!r}: delayed scaling keeps each kernel's scale in the model's fp8 "
                         "state, which the gather cannot read; gather in the format of 'O2-fp8-current' "
                         "(current scaling), or use gather_bits=8")
    if recipe.block is not None and weight_block(recipe) is None:
        raise ValueError(f"gather_bits={value!r}: this block-scaled recipe (block={recipe.block!r}, rhs_block="
                         f"{recipe.rhs_block!r}, {recipe.scale_format} scales) is not taken: MXFP8's and rowwise's "
                         "blocks run along a kernel's contraction axis for the forward and along its other axis, "
                         "from the unquantized kernel, for the dgrad, so a copy gathered in the forward's blocks "
                         "would change the dgrad's operand (it is quantized twice there); NVFP4's two-level scales "
                         "are not built; taken are per-tensor current scaling ('O2-fp8-current') and square "
                         "power-of-two weight blocks ('O2-fp8-block128'): use one of those, gather_bits=8 or None")
    if not layout.shards_params:
        raise ValueError(f"gather_bits={value!r} gathers a kernel just before its matmul, which only "
                         f"layout='fsdp' does; layout={layout.name!r} "
                         + ("gathers the params after the update, where no matmul follows: use gather_bits=8 there"
                            if layout.shards_state else "gathers nothing") + ", or leave gather_bits None")
    return recipe


def weight_block(recipe: Any) -> int | None:
    """The side ``a`` of a block-scaled recipe's square ``(a, a)`` weight blocks with power-of-two
    (E8M0) scales, which the forward and the dgrad leg both use (transposed), so a copy gathered in
    them is what both legs make of the kernel; None for any other recipe (1-D blocks re-block the
    kernel in the dgrad; NVFP4's per-tensor second level is not built; an unquantized dgrad leg
    would read the gathered copy itself)."""
    block = recipe.block if recipe.rhs_block is None else recipe.rhs_block
    if recipe.block is None or recipe.scale_format != "e8m0" or "dgrad" in recipe.high_precision_legs:
        return None
    if not isinstance(block, tuple) or block[0] != block[1] or block[0] < 2:
        return None
    return int(block[0])


def leaf_key(path: tuple) -> str:
    """The last key of a ``jax.tree_util`` path as a string (an NNX variable's ``.value`` skipped)."""
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    if len(keys) > 1 and keys[-1] == "value":
        keys = keys[:-1]
    return str(keys[-1]) if keys else ""


def feeds_matmul(key: str, x: Any, recipe: Any = None) -> bool:
    """Whether the leaf ``x`` whose path ends in ``key`` (`leaf_key`) is gathered in the matmul's
    format: a floating kernel of two or more dimensions; exactly two for block-scaled ``recipe``
    (a Dense kernel ``(in, out)``, contracted along its first axis)."""
    from jaxmp._dtypes import is_floating_array

    blocked = recipe is not None and recipe.block is not None
    return key == MATMUL_LEAF and is_floating_array(x) and (jnp.ndim(x) == 2 if blocked else jnp.ndim(x) >= 2)


def leaf_wire(wire: Any, key: str, x: Any) -> Any:
    """The `jaxmp.parallel._wire.Wire` that gathers the leaf ``x`` whose path ends in ``key``: a
    kernel keeps the matmul's format, any other leaf goes in its own dtype (``reduce_bits`` as the
    step's)."""
    if wire is None or wire.gather_format is None or feeds_matmul(key, x, wire.gather_format):
        return wire
    return dataclasses.replace(wire, gather_format=None)


def matmul_gather(piece: jax.Array, axis: str, dim: int, recipe: Any) -> jax.Array:
    """This device's slice all-gathered along ``dim`` as the fp8 codes ``recipe``'s matmul makes of
    the whole param, dequantized to ``piece.dtype``: the values ``jaxmp.fp8``'s quantize-dequantize
    of the gathered param gives its matmul. Call inside a ``shard_map`` over ``axis``."""
    if recipe.block is not None:
        return _block_gather(piece, axis, dim, recipe)
    from jaxmp.fp8._seams import amax, compute_scale, dequantize, quantize

    dtype = recipe.fwd_dtype
    # The whole param's amax (a max is exact in any order): the scale the matmul computes.
    scale = compute_scale(jax.lax.pmax(amax(piece), axis), jnp.float32(1.0), dtype, recipe.margin)
    codes = jax.lax.bitcast_convert_type(quantize(piece, scale, dtype), jnp.uint8)
    codes = jax.lax.all_gather(codes, axis, axis=dim, tiled=True)
    return dequantize(jax.lax.bitcast_convert_type(codes, dtype), scale, piece.dtype)


def _block_gather(piece: jax.Array, axis: str, dim: int, recipe: Any) -> jax.Array:
    """`matmul_gather` for square E8M0 weight blocks (`weight_block`): each device quantizes its
    2-D slice ``(in, out)`` as the forward does the kernel (rows ``out``, blocks along ``in``), its
    codes and scales (one byte each) all-gathered, every piece dequantized and put in place."""
    from jaxmp._formats._block_scaled import Quantized, dequantize, quantize

    a = weight_block(recipe)
    assert a is not None and piece.ndim == 2
    if piece.shape[dim] % a:
        raise ValueError(f"gather_bits in the format of a recipe with {a}x{a} weight blocks: a kernel sharded "
                         f"along dimension {dim} into slices of shape {tuple(piece.shape)} splits its blocks "
                         f"between devices ({piece.shape[dim]} is no multiple of {a}); give it a size that the "
                         f"device count times {a} divides, keep it replicated (min_shard_size), or use "
                         "gather_bits=8")
    qx = quantize(piece.T, recipe.fwd_dtype, (a, a), recipe.scale_format, recipe.scale_rule)
    rows, k = qx.shape
    # The codes without the blocks' zero padding (a ragged last block), which each device adds back.
    codes = jax.lax.all_gather(jax.lax.bitcast_convert_type(qx.q[:rows, :k], jnp.uint8), axis)
    scales = jax.lax.all_gather(jax.lax.bitcast_convert_type(qx.scale, jnp.uint8), axis)
    pad = ((0, qx.q.shape[0] - rows), (0, qx.q.shape[1] - k))

    def one(c, sc):
        q = Quantized(jax.lax.bitcast_convert_type(jnp.pad(c, pad), qx.q.dtype),
                      jax.lax.bitcast_convert_type(sc, qx.scale.dtype), None, qx.shape, qx.block)
        return dequantize(q, piece.dtype).T

    pieces = jax.vmap(one)(codes, scales)  # (n, *piece.shape), in device order
    pieces = jnp.moveaxis(pieces, 0, dim)
    return pieces.reshape(piece.shape[:dim] + (-1,) + piece.shape[dim + 1:])


def check_leaves(wire: Any, keys: list, leaves: list, kinds: list) -> None:
    """A ValueError when ``gather_bits`` names a matmul format and no leaf the step gathers is a
    kernel (`feeds_matmul`): the option would gather nothing in that format, silently."""
    if wire is None or wire.gather_format is None:
        return
    # A deferred (scan_layers) leaf is stacked: its layer's slice has one dimension less.
    if any(kind == "gather" and feeds_matmul(key, x, wire.gather_format)
           or kind == "defer" and feeds_matmul(key, jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), wire.gather_format)
           for key, x, (kind, _) in zip(keys, leaves, kinds)):
        return
    raise ValueError(f"gather_bits in a matmul format gathers the params whose path ends in {MATMUL_LEAF!r} "
                     "(floating, two or more dimensions: Flax's Dense/DenseGeneral/Conv and NNX's Linear/Conv "
                     "kernels), and no param the FSDP step gathers is one; name the matmul weights "
                     f"{MATMUL_LEAF!r}, lower min_shard_size if they stay replicated, or use gather_bits=8")
