"""Where fp8 runs natively (fp8 Tensor Cores: NVIDIA compute capability >= 8.9) and where it is
emulated, and the check a recipe's ``emulate`` setting asks for."""

from __future__ import annotations


import jax

from jaxmp.fp8._recipes import Fp8Recipe


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
      (False, 'cpu has no fp8 Tensor Cores: fp8 is emulated (fp8 rounding, matmul in the operand dtype)')
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
    native, reason = native_fp8(device)
    if native:
        return "emulated" if recipe.emulate else "native"
    if recipe.emulate is False:
        raise ValueError(f"fp8 with emulate=False needs fp8 Tensor Cores: {reason}")
    if recipe.emulate is None and device.platform != "cpu":
        raise ValueError(f"fp8 is not supported natively here: {reason}. The emulation is slower than bf16 on "
                         "this hardware; opt in with emulate=True (e.g. fp8.DelayedScaling(emulate=True)) "
                         "to test fp8 numerics, or use a bf16 policy")
    return "emulated"
