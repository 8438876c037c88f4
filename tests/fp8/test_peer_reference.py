"""jaxmp's block-scaled quantizer held to torchao's own MX and NVFP4 code (issue 59 item 5).

tests/fp8/data/blocks_reference.npz was written by benchmarks/peers/blocks_reference.py (torch
2.13.0, torchao 0.18.0); this test needs neither. Every scale, element code and dequantized value
is compared bit for bit; the differences by design (docs/fp8.md#against-the-peers) are not
skipped: each differing block must belong to one, and each kind is counted exactly.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._formats import _block_scaled as B

REF = np.load(pathlib.Path(__file__).parent / "data" / "blocks_reference.npz")
INPUTS = ("normal", "wide", "edge")
ELEMS = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2, "float4_e2m1fn": jnp.float4_e2m1fn}
MODES = ("FLOOR", "EVEN", "CEIL", "RCEIL")
# Blocks that differ from torchao, by kind, summed over the 3 element formats and 4 modes (MX) or
# the inputs (NVFP4); docs/fp8.md#against-the-peers quotes these numbers.
MX_EXPECTED = {"zero": 12, "non-finite": 24, "smallest scale": 12, "RCEIL's log2": 2}
NVFP4_EXPECTED = {"floored scale": 27, "rounding order": 28}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(x, dtype, block, fmt, rule):
    q = B.quantize(x, dtype, block, fmt, rule)
    return jax.lax.bitcast_convert_type(q.scale, jnp.uint8), q.q, B.dequantize(q), q.global_scale


def _run(x, dtype, block, fmt, rule):
    """(scale bytes, element codes one per byte, float32 values, per-tensor scale) as numpy."""
    scale, q, deq, g = _quantize(x, dtype, block, fmt, rule)
    codes = np.asarray(q).view(np.uint8) & (0xF if jnp.dtype(dtype) == jnp.float4_e2m1fn else 0xFF)
    return np.asarray(scale), codes, np.asarray(deq), None if g is None else np.asarray(g)


def _same(a, b):
    return (a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))


def _by_block(mask, n):
    return mask.reshape(mask.shape[0], -1, n).any(-1)


def _mx_kinds(x, elem, mode, scale):
    """The blocks of each difference by design, from the input (and jaxmp's scale for the last)."""
    xb = x.reshape(x.shape[0], -1, 32)
    finite = np.isfinite(xb).all(-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1), 0).astype(np.float32)
    kinds = {"zero": finite & (amax == 0), "non-finite": ~finite,
             # torchao divides by 2**-126 (FLOOR/EVEN/CEIL) or by 1 (RCEIL) under a 2**-127 scale
             "smallest scale": finite & (amax > 0) & (scale == 0)}
    with np.errstate(under="ignore"):
        descale = (amax / np.float32(B.element_format(elem).max)).astype(np.float32)
    near = (descale.view(np.int32) & 0x7FFFFF) <= 8  # just above a power of two: torch.log2 rounds to it
    kinds["RCEIL's log2"] = finite & (amax > 0) & (scale > 0) & near & (descale.view(np.int32) & 0x7FFFFF > 0) \
        if mode == "RCEIL" else np.zeros_like(finite)
    return kinds


def test_mx_scales_codes_and_values_equal_torchaos():
    counts = dict.fromkeys(MX_EXPECTED, 0)
    for name in INPUTS:
        x = REF[f"input/{name}"]
        for ename, elem in ELEMS.items():
            for mode in MODES:
                scale, codes, deq, _ = _run(x, elem, (1, 32), "e8m0", mode.lower())
                ref = {k: REF[f"mx/{name}/{ename}/{mode}/{k}"] for k in ("scale", "codes", "dequant")}
                differ = (scale != ref["scale"]) | _by_block(codes != ref["codes"], 32) \
                    | _by_block(~_same(deq, ref["dequant"]), 32)
                kinds = _mx_kinds(x, elem, mode, scale)
                explained = np.zeros_like(differ)
                for kind, blocks in kinds.items():
                    counts[kind] += int((differ & blocks & ~explained).sum())
                    explained |= blocks
                assert not (differ & ~explained).any(), (name, ename, mode, np.argwhere(differ & ~explained))
                if name != "edge":  # normal-range data: every bit equal
                    assert not differ.any()
    assert counts == MX_EXPECTED


def test_nvfp4_two_level_scales_equal_torchaos_but_for_the_floor():
    counts = dict.fromkeys(NVFP4_EXPECTED, 0)
    for name in INPUTS:
        x = REF[f"input/{name}"]
        x = x[np.isfinite(x).all(axis=1)]
        scale, codes, deq, g = _run(x, jnp.float4_e2m1fn, (1, 16), "e4m3", "exact")
        ref = {k: REF[f"nvfp4/{name}/{k}"] for k in ("scale", "codes", "dequant", "per_tensor_scale")}
        assert g.view(np.int32) == ref["per_tensor_scale"].view(np.int32)
        # torchao clamps each block scale at E4M3's smallest normal, 2**-6 (byte 0x08); jaxmp keeps
        # the E4M3 subnormal (or 0) that Transformer Engine and JAX keep.
        floored = (ref["scale"] == 0x08) & (scale < 0x08)
        assert ((scale != ref["scale"]) == floored).all(), name
        assert not (_by_block(codes != ref["codes"], 16) & ~floored).any(), name
        off = _by_block(~_same(deq, ref["dequant"]), 16) & ~floored
        # elsewhere the values differ only in how q * s * g is rounded (torchao: q * (s * g)), by 1 ulp
        ulps = np.abs(deq.view(np.int32).astype(np.int64) - ref["dequant"].view(np.int32))
        assert ulps.reshape(off.shape[0], -1, 16)[~floored].max() <= 1
        counts["floored scale"] += int(floored.sum())
        counts["rounding order"] += int(off.sum())
        if name == "wide":  # the floor's measured effect: a coarser scale, larger errors there
            xb, f = x.reshape(x.shape[0], -1, 16), floored[..., None]
            mine = np.abs(deq.reshape(xb.shape) - xb)[np.broadcast_to(f, xb.shape)].mean()
            theirs = np.abs(ref["dequant"].reshape(xb.shape) - xb)[np.broadcast_to(f, xb.shape)].mean()
            assert mine < theirs
    assert counts == NVFP4_EXPECTED


@pytest.mark.parametrize("fmt", ["mxfp8_RCEIL", "mxfp8_FLOOR", "nvfp4"])
def test_emulated_matmuls_agree_with_torchaos(fmt):
    a, b = REF["input/normal"], REF["mm/b"]
    if fmt == "nvfp4":
        r = fp8.CurrentScaling(block=(1, 16), fwd_dtype=jnp.float4_e2m1fn, bwd_dtype=jnp.float4_e2m1fn,
                               scale_format="e4m3")
    else:
        r = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0",
                               scale_rule=fmt.split("_")[1].lower())
    dn = (((1,), (1,)), ((), ()))
    mine = np.asarray(jax.jit(lambda p, q: fp8._block_ops.block_dot_general(p, q, dn, r))(a, b))
    theirs = REF[f"mm/{fmt}"]
    # The operands are bit-equal (above); only the summation order of the two matmuls differs.
    bound = 1e-6 * (np.abs(a) @ np.abs(b).T)
    assert (np.abs(mine - theirs) <= bound).all()
