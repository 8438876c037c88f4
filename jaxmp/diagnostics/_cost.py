"""A cost model for a `PrecisionPlan`: matmul time from vendors' datasheet peaks, a prediction.

Each module's forward matmul FLOPs (the plan's; the two backward matmuls per forward one scale
every rung alike, so they cancel in a ratio) are divided by the dense peak of the format its rung
runs in on the device. Nothing here is measured: a real step also moves memory, quantizes
operands and runs the non-matmul ops, none of which the model counts. See
docs/precision-search.md#what-it-predicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Dense (no structured sparsity) Tensor Core / MXU peaks in TFLOP/s per chip. NVIDIA quotes its
# Tensor Core figures "with sparsity": the dense figure is half of it.
#   H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (SXM column): TF32 989, BF16 1,979, FP16 1,979,
#     FP8 3,958 TFLOPS with sparsity; dense figures from the H100 architecture whitepaper (TF32 494.7,
#     BF16/FP16 989.4, FP8 1978.9). No FP4, no block-scaled (MX) GEMMs.
#   H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: the same Tensor Core figures as H100 SXM
#     (TF32 989, BF16/FP16 1,979, FP8 3,958 with sparsity). No FP4.
#   B200: NVIDIA HGX B200 specifications (8 GPUs): FP4 144 PF, FP8/FP6 72 PF, FP16/BF16 36 PF,
#     TF32 18 PF with sparsity; per GPU and dense: FP4 9,000, FP8 4,500, BF16/FP16 2,250, TF32 1,125.
#     Blackwell's FP8 and FP4 Tensor Cores take block scales (MXFP8, NVFP4) at those rates.
#   TPU v5p: Google Cloud TPU v5p documentation: 459 TFLOPs bf16 per chip (918 TOPS int8, not a
#     format here). No fp8, fp4 or TF32.
DATASHEET_TFLOPS: dict[str, dict[str, float | None]] = {
    "H100": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "mxfp8": None, "fp4": None},
    "H200": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "mxfp8": None, "fp4": None},
    "B200": {"tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "fp4": 9000.0},
    "TPU v5p": {"tf32": None, "bf16": 459.0, "fp16": None, "fp8": None, "mxfp8": None, "fp4": None},
}
#: What the plan's report predicts for, in this order.
DEVICES = tuple(DATASHEET_TFLOPS)
NOTE = "predicted from datasheet peaks, not measured"


def device_key(device: Any) -> str:
    """The table's key for ``device``: a key (``"H100"``), a ``device_kind`` that contains one
    (``"NVIDIA H100 80GB HBM3"``), or a ``jax.Device``; a ValueError names the known ones."""
    kind = getattr(device, "device_kind", device)
    if not isinstance(kind, str):
        raise TypeError(f"device must be a name such as 'H100' or a jax.Device, got {type(device).__name__}: {device!r}")
    for key in DATASHEET_TFLOPS:
        if key.lower() in kind.lower():
            return key
    raise ValueError(f"no datasheet peaks for device {kind!r}: known are {', '.join(DEVICES)}")


def rung_kind(rung: str, compute: str) -> str:
    """The datasheet format a ladder rung's matmuls run in: ``"tf32"`` for ``"float32"`` (JAX's
    default precision on NVIDIA GPUs; a TPU runs it as one bf16 pass, see `rate`), ``compute``
    (``"bf16"``/``"fp16"``) for a rung with no fp8 recipe, ``"fp4"`` for an fp4 recipe, ``"mxfp8"``
    for fp8 in blocks of fewer than 128 elements (Blackwell's block-scaled Tensor Cores), else ``"fp8"``
    (per tensor, per row, 128-blocks: Hopper's fp8 Tensor Cores with the scales applied outside)."""
    import jax.numpy as jnp

    from jaxmp.engine._seams import matmul_format

    if rung == "float32":
        return "tf32"
    recipe = matmul_format(rung)[1]
    if recipe is None:
        return compute
    if np.dtype(recipe.fwd_dtype) == np.dtype(jnp.float4_e2m1fn):
        return "fp4"
    block = getattr(recipe, "block", None)
    if isinstance(block, tuple) and max(block) < 128:
        return "mxfp8"
    return "fp8"


def rate(key: str, kind: str, compute: str) -> tuple[float, str]:
    """``(TFLOP/s, the format it is priced as)`` of format ``kind`` on device ``key``. A format the
    device lacks runs emulated around a matmul in the compute dtype (jaxmp's emulation), so it is
    priced at the compute dtype's peak (the quantize passes, uncounted, only add to it); float32 on
    a TPU is one bf16 pass at JAX's default precision."""
    peaks = DATASHEET_TFLOPS[key]
    got = peaks.get(kind)
    if got is not None:
        return float(got), kind
    own = peaks.get(compute)
    if own is not None:
        return float(own), compute
    return float(peaks["bf16"] or 0.0), "bf16"


@dataclasses.dataclass(frozen=True)
class SpeedupPrediction:
    """What `PrecisionPlan.predicted_speedup` returns: a prediction from datasheet peaks, not a measurement.

    Attributes:
      device: the datasheet's device (``"H100"``, ``"H200"``, ``"B200"``, ``"TPU v5p"``).
      vs_bf16: matmul time with every module in the compute dtype over the chosen rules' matmul time.
      vs_float32: matmul time with every module in float32 over the chosen rules' matmul time.
      priced_as: ``(rung, format it is priced as, TFLOP/s)`` per rung the plan uses.
    """

    device: str
    vs_bf16: float
    vs_float32: float
    priced_as: tuple[tuple[str, str, float], ...]

    def __str__(self) -> str:
        rungs = ", ".join(f"{r} as {k} {t:g}" for r, k, t in self.priced_as)
        from jaxmp.diagnostics import _format

        # The note on a line of its own: wrapped, it must still read whole.
        return "\n".join([f"{self.device}: matmul speed-up {self.vs_bf16:.2f}x over all bf16, {self.vs_float32:.2f}x "
                          f"over all float32", f"    ({NOTE})", _format.wrap(f"    TFLOP/s: {rungs}")])


def predict(flops: list[tuple[str, int]], compute: str, device: Any) -> SpeedupPrediction:
    """The prediction for ``flops`` (``(rung, forward matmul FLOPs)`` per module, the unscoped
    ones at the policy's rung) on ``device``; ``compute``: the policy's half dtype (``"bf16"``)."""
    key = device_key(device)
    used: dict[str, tuple[float, str]] = {}
    time = 0.0
    for rung, f in flops:
        if rung not in used:
            used[rung] = rate(key, rung_kind(rung, compute), compute)
        time += f / used[rung][0]
    total = sum(f for _, f in flops)
    if time <= 0:
        return SpeedupPrediction(key, 1.0, 1.0, ())
    half = rate(key, compute, compute)[0]
    single = rate(key, "tf32", compute)[0]
    priced = tuple((r, k, t) for r, (t, k) in used.items())
    return SpeedupPrediction(key, (total / half) / time, (total / single) / time, priced)
