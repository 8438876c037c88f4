"""Writes tests/fp8/data/blocks_reference.npz: torchao's own MX and NVFP4 quantizers run on fixed
inputs, for tests/fp8/test_peer_reference.py to hold jaxmp's block-scaled quantizer to (issue 59,
items 2-5), without torch in the test.

Run with a Python that has torch and torchao (not jaxmp's environment; neither is a jaxmp
dependency), from the repository root:

    /work/peers-venv/bin/python benchmarks/peers/blocks_reference.py

Recorded with torch 2.13.0 (CPU) and torchao 0.18.0. What is stored, per input (``normal``:
N(0, 1); ``wide``: rows scaled by exp(4 N(0, 1)); ``edge``: crafted blocks, see ``edge_input``):

- ``mx/<input>/<element>/<mode>/{scale,codes,dequant}``: ``to_mx``'s E8M0 scale bytes, the
  elements' bytes (E2M1: one code per byte, unpacked) and ``to_dtype``'s float32 values, for
  the elements float8_e4m3fn, float8_e5m2, float4_e2m1fn and the modes FLOOR, EVEN, CEIL, RCEIL
  (1x32 blocks);
- ``nvfp4/<input>/{scale,codes,dequant,per_tensor_scale}``: ``NVFP4Tensor.to_nvfp4`` with the
  per-tensor scale ``per_tensor_amax_to_scale(amax)`` (1x16 blocks, E4M3 scale bytes), on the
  input's finite rows;
- ``mm/<format>``: the emulated matmul ``a @ b.T`` of torchao's dequantized operands (float32),
  MX (E4M3, RCEIL and FLOOR) and NVFP4.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fp8" / "data" / "blocks_reference.npz"
MODES = ("FLOOR", "EVEN", "CEIL", "RCEIL")


def edge_input() -> np.ndarray:
    """16 rows of one 1x32 block each (two 1x16 NVFP4 blocks): the boundaries the rules differ
    at, subnormals, a zero block and non-finite blocks."""
    rs = np.random.RandomState(3)
    x = (rs.randn(16, 32) * 0.1).astype(np.float32)
    x[0, 0], x[1, 0], x[2, 0] = 448.0, 449.0, 0.9
    x[2, 1:] *= 0.5
    x[3] = 0.0                                     # a zero block
    x[4] = 1e-40                                   # subnormals only
    x[5] = 0.0
    x[5, :2] = 8.339e-36, 3.66e-41                 # a subnormal beside a tiny normal amax
    for i, m in enumerate((1, 2, 4, 8)):           # amax / 448 just above a power of two
        x[6 + i] *= 1e-3
        x[6 + i, 0] = np.float32(448.0 * 2.0 ** (-3 - i)) * np.float32(1 + m * 2.0 ** -23)
    x[10, 0] = 496.0                               # EVEN's mantissa carry
    x[11] *= 1e-30                                 # far below 1 (E4M3 subnormal codes)
    x[12, 3] = np.nan
    x[13, 7] = np.inf
    x[14] *= 3e4
    x[15, 0] = 6.0
    return x


def inputs() -> dict:
    rs = np.random.RandomState(0)
    normal = rs.randn(8, 128).astype(np.float32)
    wide = (rs.randn(8, 128) * np.exp(rs.randn(8, 1) * 4)).astype(np.float32)
    return {"normal": normal, "wide": wide, "edge": edge_input()}


def _mx(torch, x: np.ndarray, elem, mode) -> dict:
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4  # noqa: F401
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    t = torch.from_numpy(x)
    scale, data = to_mx(t, elem, 32, mode)
    deq = to_dtype(data, scale, elem, 32, torch.float32)
    codes = unpack_uint4(data) if elem == torch.float4_e2m1fn_x2 else data.view(torch.uint8)
    return {"scale": scale.view(torch.uint8).numpy(), "codes": codes.numpy().astype(np.uint8),
            "dequant": deq.numpy().astype(np.float32)}


def _nvfp4(torch, x: np.ndarray) -> dict:
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    t = torch.from_numpy(np.ascontiguousarray(x))
    pts = per_tensor_amax_to_scale(t.abs().max())
    q = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts)
    return {"scale": q.scale.view(torch.uint8).numpy().reshape(x.shape[0], -1),
            "codes": unpack_uint4(q.qdata.view(torch.uint8)).numpy().astype(np.uint8),
            "dequant": q.dequantize(torch.float32).numpy(), "per_tensor_scale": pts.numpy().astype(np.float32)}


def build(torch) -> dict:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    elems = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
             "float4_e2m1fn": torch.float4_e2m1fn_x2}
    out = {}
    xs = inputs()
    for name, x in xs.items():
        out[f"input/{name}"] = x
        for ename, elem in elems.items():
            for mode in MODES:
                for k, v in _mx(torch, x, elem, getattr(ScaleCalculationMode, mode)).items():
                    out[f"mx/{name}/{ename}/{mode}/{k}"] = v
        finite = x[np.isfinite(x).all(axis=1)]  # one per-tensor scale: the non-finite rows left out
        for k, v in _nvfp4(torch, finite).items():
            out[f"nvfp4/{name}/{k}"] = v
    # Matmuls: a [8, 128] @ b.T, b [16, 128], on torchao's dequantized operands.
    rs = np.random.RandomState(9)
    a, b = xs["normal"], (rs.randn(16, 128) * 0.05).astype(np.float32)
    out["mm/b"] = b
    for mode in ("RCEIL", "FLOOR"):
        da = _mx(torch, a, torch.float8_e4m3fn, getattr(ScaleCalculationMode, mode))["dequant"]
        db = _mx(torch, b, torch.float8_e4m3fn, getattr(ScaleCalculationMode, mode))["dequant"]
        out[f"mm/mxfp8_{mode}"] = (torch.from_numpy(da) @ torch.from_numpy(db).T).numpy()
    da, db = _nvfp4(torch, a)["dequant"], _nvfp4(torch, b)["dequant"]
    out["mm/nvfp4"] = (torch.from_numpy(da) @ torch.from_numpy(db).T).numpy()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help=f"the .npz to write (default {OUT})")
    args = parser.parse_args(argv)
    import torch  # only here: --help works without torch
    import torchao
    ref = build(torch)
    ref["versions"] = np.array([torch.__version__, torchao.__version__])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **ref)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(ref)} arrays)")


if __name__ == "__main__":
    main()
