"""Where fp8 runs natively (fp8 Tensor Cores: NVIDIA compute capability >= 8.9) and where it is
emulated, and the check a recipe's ``emulate`` setting asks for."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmp.fp8._recipes import CurrentScaling, Fp8Recipe

NATIVE_JAX = (0, 12)  # jax.nn.scaled_dot_general's MXFP8 on cuDNN's block-scaled GEMMs


def _jax_version() -> tuple[int, int]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2])  # type: ignore[return-value]


def native_block(recipe: CurrentScaling, device: jax.Device | None = None) -> tuple[bool, str]:
    """Whether a block-scaled recipe's forward matmul runs natively on ``device``, and why.

    Block-scaled formats run natively only on Blackwell (compute capability >= 10.0) with
    JAX >= 0.12, through ``jax.nn.scaled_dot_general``, and only for what it implements exactly
    as jaxmp's emulation does: MXFP8 (E4M3, 1x32 blocks on both operands, E8M0 scales by JAX's
    rule, ``"rceil"``). Everything else (H100, TPU, CPU, NVFP4, rowwise, 128-blocks) is
    the emulation: a quantize-dequantize around a bf16 matmul, which buys no speed.
    Not tested on Blackwell hardware here: the native branch is kept to this one check.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> r = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn,
      ...                        scale_format="e8m0", scale_rule="rceil")
      >>> fp8._hardware.native_block(r, jax.devices("cpu")[0])[0]
      False
    """
    device = jax.devices()[0] if device is None else device
    emulated = ("emulated (quantize-dequantize around a matmul in the operand dtype: no faster than bf16); "
                "block-scaled formats run natively only on Blackwell (compute capability >= 10.0) with JAX >= 0.12")
    mx = (recipe.block == (1, 32) and recipe.rhs_block in (None, (1, 32)) and recipe.scale_format == "e8m0"
          and recipe.scale_rule == "rceil" and recipe.fwd_dtype == jnp.float8_e4m3fn)
    cc = getattr(device, "compute_capability", None)
    try:
        major = int(str(cc).split(".")[0])
    except ValueError:
        major = 0
    if device.platform != "gpu" or major < 10:
        return False, f"{getattr(device, 'device_kind', device.platform)}: {emulated}"
    if _jax_version() < NATIVE_JAX:
        return False, f"JAX {jax.__version__} has no block-scaled GEMM: {emulated}"
    if not mx:
        return False, f"only MXFP8 (1x32 E4M3, E8M0 scales by the 'rceil' rule) runs natively: {emulated}"
    return True, f"{device.device_kind} (compute capability {cc}): MXFP8 forward through jax.nn.scaled_dot_general"


def native_fp8(device: jax.Device | None = None) -> tuple[bool, str]:
    """Whether ``device`` has fp8 Tensor Cores, and why (compute capability >= 8.9 on NVIDIA).

    Elsewhere (CPU, TPU, older GPUs) `fp8_dot_general` still runs, emulated: fp8 rounding
    and scaling, the matmul in the operands' dtype.

    Args:
      device: a ``jax.Device`` (default: the first device).

    Returns:
      ``(available, reason)``.

    Example:
      >>> import jax
      >>> from jaxmp import fp8
      >>> fp8._hardware.native_fp8(jax.devices("cpu")[0])
      (False, 'cpu has no fp8 Tensor Cores: fp8 is emulated (fp8 rounding, matmul in ...)')
    """
    device = jax.devices()[0] if device is None else device
    emulated = "fp8 is emulated (fp8 rounding, matmul in the operand dtype)"
    if device.platform != "gpu":
        return False, f"{device.platform} has no fp8 Tensor Cores: {emulated}"
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return False, f"{device.device_kind}: compute capability unknown ({cc!r}): {emulated}"
    if (major, minor) < (8, 9):
        return False, f"{device.device_kind} (compute capability {cc}) needs >= 8.9 for fp8 Tensor Cores: {emulated}"
    return True, f"{device.device_kind} (compute capability {cc}) has fp8 Tensor Cores"


def check_hardware(recipe: Fp8Recipe, device: jax.Device | None = None) -> str:
    """Whether ``recipe`` runs natively or emulated on ``device``; a clear error if neither is allowed.

    ``recipe.emulate`` None (default): native on fp8 Tensor Cores (NVIDIA compute capability
    >= 8.9), emulated on CPU (so everything can be tested there), a ``ValueError`` on other
    accelerators (older GPUs, TPU), where the emulation is slower than bf16 and is opt-in
    (``emulate=True``). ``emulate=False`` requires fp8 Tensor Cores.

    Block-scaled recipes (``CurrentScaling(block=...)``, ``"O2-mxfp8"``, ``"O2-nvfp4"``...) run
    natively only on Blackwell with JAX >= 0.12, and then only MXFP8's forward matmul
    (`native_block`); elsewhere, H100 included, they are emulated, which buys no speed: the
    emulation answers whether a format trains, not how fast.

    Args:
      recipe: a `CurrentScaling` or `DelayedScaling`.
      device: a ``jax.Device`` (default: the first device).

    Returns:
      ``"native"`` or ``"emulated"``.

    Raises:
      TypeError: ``recipe`` is not an fp8 recipe.
      ValueError: the hardware cannot run it the way ``recipe.emulate`` asks.

    Example:
      >>> import jax
      >>> from jaxmp import fp8
      >>> fp8.check_hardware(fp8.DelayedScaling(), jax.devices("cpu")[0])
      'emulated'
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"expected a jaxmp.fp8 recipe (CurrentScaling or DelayedScaling), got {type(recipe).__name__}")
    device = jax.devices()[0] if device is None else device
    block = isinstance(recipe, CurrentScaling) and recipe.block is not None
    if isinstance(recipe, CurrentScaling) and recipe.block is not None:
        native, reason = native_block(recipe, device)
    else:
        native, reason = native_fp8(device)
    if native:
        return "emulated" if recipe.emulate else "native"
    if recipe.emulate is False:
        raise ValueError(f"fp8 with emulate=False needs {'native block-scaled matmuls' if block else 'fp8 Tensor Cores'}: "
                         f"{reason}")
    if recipe.emulate is None and device.platform != "cpu":
        raise ValueError(f"fp8 is not supported natively here: {reason}. The emulation is slower than bf16 on "
                         "this hardware; opt in with emulate=True (e.g. fp8.DelayedScaling(emulate=True)) "
                         "to test fp8 numerics, or use a bf16 policy")
    return "emulated"
