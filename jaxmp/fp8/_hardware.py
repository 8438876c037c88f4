"""Where fp8 runs natively (fp8 Tensor Cores: NVIDIA compute capability >= 8.9) and where it is
emulated, and the check a recipe's ``emulate`` setting asks for."""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

import jax

from jaxmp._formats import E4M3
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling, Fp8Recipe, source

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
    device = as_device(device)
    emulated = ("emulated (quantize-dequantize around a matmul in the operand dtype: no faster than bf16); "
                "block-scaled formats run natively only on Blackwell (compute capability >= 10.0) with JAX >= 0.12")
    mx = (recipe.block == (1, 32) and recipe.rhs_block in (None, (1, 32)) and recipe.scale_format == "e8m0"
          and recipe.scale_rule == "rceil" and recipe.fwd_dtype == E4M3)
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
    device = as_device(device)
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


# What each way of running costs, beside the reason (check_hardware's verdict carries both).
NATIVE_FP8_COST = "fp8 GEMMs (twice bf16's matmul peak) plus a quantize pass per operand"
NATIVE_BLOCK_COST = ("the forward matmul on block-scaled Tensor Cores; the two backward matmuls emulated "
                     "(quantize-dequantize around a bf16 matmul)")
EMULATED_COST = ("a quantize-dequantize pass per operand around a matmul in the compute dtype: slower than bf16, "
                 "never faster; it shows whether a format trains, not how fast")
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


class HardwareVerdict(str):
    """What [`check_hardware`][jaxmp.fp8.check_hardware] found: the string ``"native"`` or
    ``"emulated"`` (so ``verdict == "native"`` reads as before), with the reason and the cost.

    Attributes:
      reason: why it runs that way on that device.
      cost: what running that way costs (emulation: slower than bf16).
      platform: the device's platform (``"cpu"``, ``"gpu"``, ``"tpu"``).
    """

    reason: str
    cost: str
    platform: str

    def __new__(cls, mode: str, reason: str, cost: str, platform: str):
        verdict = super().__new__(cls, mode)
        verdict.reason, verdict.cost, verdict.platform = reason, cost, platform
        return verdict

    def __getnewargs__(self):  # pickling and copying rebuild it with its fields
        return str(self), self.reason, self.cost, self.platform

    def __repr__(self) -> str:
        return f"HardwareVerdict({str(self)!r}, reason={self.reason!r}, cost={self.cost!r})"


def as_device(device: Any) -> Any:
    """``device`` as something with a ``platform``: a ``jax.Device`` (or a description of one with
    ``platform``, ``device_kind`` and ``compute_capability``) as given; a platform name
    (``"cpu"``, ``"gpu"``/``"cuda"``/``"rocm"``, ``"tpu"``) as that platform's first local device,
    or, where there is none, a description with an unknown compute capability; None: the first device.

    Example:
      >>> from jaxmp import fp8
      >>> fp8._hardware.as_device("cpu").platform
      'cpu'
    """
    if device is None:
        return _first_device()
    if isinstance(device, str):
        platform = _PLATFORMS.get(device.strip().lower())
        if platform is None:
            raise ValueError(f"unknown platform {device!r}: pass one of {sorted(_PLATFORMS)}, a jax.Device "
                             "(e.g. jax.devices()[0]) or None for the first device")
        try:
            return jax.devices(platform)[0]
        except RuntimeError:  # not on this machine: what the name says, and nothing more
            return types.SimpleNamespace(platform=platform, device_kind=platform, compute_capability=None)
    if not isinstance(getattr(device, "platform", None), str):
        raise TypeError(f"device must be a jax.Device (e.g. jax.devices()[0]), a platform name ('cpu', 'gpu', "
                        f"'tpu') or None, got {type(device).__name__}: {device!r}")
    return device


def check_hardware(recipe: Fp8Recipe, device: jax.Device | str | None = None) -> HardwareVerdict:
    """Whether ``recipe`` runs natively or emulated on ``device``, why, and at what cost; a clear
    error where the recipe's ``emulate`` setting rules out both.

    ``recipe.emulate`` None (default): per-tensor fp8 runs natively on fp8 Tensor Cores (NVIDIA
    compute capability >= 8.9), emulated on CPU (so everything can be tested there), and is a
    ``ValueError`` on other accelerators (older GPUs, TPU), where its only point, speed, is lost:
    the message gives the same recipe with ``emulate=True``, code that runs when pasted.
    Block-scaled recipes (``CurrentScaling(block=...)``, ``"O2-mxfp8"``, ``"O2-nvfp4"``...) run
    natively only on Blackwell with JAX >= 0.12, and then only MXFP8's forward matmul
    (`native_block`); everywhere else (H100, H200, TPU, CPU) they run emulated, as torchao's MX
    formats and ``jax.nn.scaled_dot_general`` do there, and the doors (`jaxmp.autocast`,
    `jaxmp.flax.mixed_precision`) warn once off CPU, since the emulation is slower than bf16.
    ``emulate=True`` emulates anywhere, silently; ``emulate=False`` requires the native path.

    Args:
      recipe: a `CurrentScaling` or `DelayedScaling`.
      device: a ``jax.Device``, a platform name (``"cpu"``, ``"gpu"``, ``"tpu"``; a name with no
        local device stands for that platform with an unknown compute capability), or None for
        the first device.

    Returns:
      A `HardwareVerdict`: ``"native"`` or ``"emulated"`` (a ``str``), with ``.reason`` and ``.cost``.

    Raises:
      TypeError: ``recipe`` is not an fp8 recipe, or ``device`` is no device or platform name.
      ValueError: the hardware cannot run it the way ``recipe.emulate`` asks.

    Example:
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> verdict = fp8.check_hardware(fp8.DelayedScaling(), "cpu")
      >>> verdict == "emulated", verdict.reason.split(":")[0]
      (True, 'cpu has no fp8 Tensor Cores')
      >>> fp8.check_hardware(jaxmp.get_recipe("O2-mxfp8").fp8, "cpu").cost.split(":")[0]
      'a quantize-dequantize pass per operand around a matmul in the compute dtype'
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"expected a jaxmp.fp8 recipe (CurrentScaling or DelayedScaling), got {type(recipe).__name__}")
    dev: Any = as_device(device)  # a jax.Device or a description of one (a platform name's)
    block = isinstance(recipe, CurrentScaling) and recipe.block is not None
    if isinstance(recipe, CurrentScaling) and recipe.block is not None:
        native, reason = native_block(recipe, dev)
    else:
        native, reason = native_fp8(dev)
    if native and not recipe.emulate:
        return HardwareVerdict("native", reason, NATIVE_BLOCK_COST if block else NATIVE_FP8_COST, dev.platform)
    if native:
        return HardwareVerdict("emulated", f"emulate=True (the hardware has the native path: {reason})",
                               EMULATED_COST, dev.platform)
    if recipe.emulate is False:
        raise ValueError(f"fp8 with emulate=False needs {'native block-scaled matmuls' if block else 'fp8 Tensor Cores'}: "
                         f"{reason}. To run it emulated ({EMULATED_COST}), keep the recipe with emulate=True: "
                         f"{source(recipe, emulate=True)}")
    if recipe.emulate is None and dev.platform != "cpu" and not block:
        raise ValueError(f"fp8 is not supported natively here: {reason}. The emulation costs {EMULATED_COST}; opt in "
                         f"with emulate=True, keeping the recipe: {way_out(recipe)}; or use a bf16 policy")
    return HardwareVerdict("emulated", reason, EMULATED_COST, dev.platform)


def way_out(recipe: Fp8Recipe) -> str:
    """The pasteable call that runs ``recipe`` emulated on purpose, through either door."""
    return (f"rules=jaxmp.AutocastRules(fp8_matmuls={source(recipe, emulate=True)}) to jaxmp.autocast or "
            "jaxmp.flax.mixed_precision (with import jax.numpy as jnp, jaxmp)")


_WARNED: set = set()


def _first_device() -> Any:
    return jax.devices()[0]


def check_for_run(recipe: Fp8Recipe) -> HardwareVerdict:
    """[`check_hardware`][jaxmp.fp8.check_hardware] on the first device, as the doors call it when
    a model or function is wrapped: and one warning (once per recipe and device) where a block-scaled recipe will run emulated
    off CPU without ``emulate=True`` having asked for it (H100, H200, TPU), with the reason, the
    cost and the pasteable call that keeps the recipe and silences it."""
    verdict = check_hardware(recipe)
    key = (recipe, verdict.reason)
    if verdict == "emulated" and recipe.emulate is None and verdict.platform != "cpu" and key not in _WARNED:
        _WARNED.add(key)  # once per recipe and device: Linen re-resolves its rules on every clone
        warnings.warn(f"{source(recipe)} runs emulated here: {verdict.reason}. Cost: {verdict.cost}. To run it "
                      f"emulated on purpose (the recipe kept, this warning gone), pass {way_out(recipe)}",
                      MixedPrecisionWarning, stacklevel=_user_stacklevel())
    return verdict


def refuse_delayed_in_a_function(recipe: Fp8Recipe | None, where: str, instead: str) -> None:
    """Refuses delayed scaling where ``jaxmp.autocast`` runs a plain function: the one text of
    that refusal, for each place a recipe reaches autocast from (its rules, its preset).

    Args:
      recipe: the fp8 recipe that reached autocast, or None.
      where: what gave it (``"AutocastRules.fp8_matmuls"``, or the preset's name), for the message.
      instead: the pasteable current-scaling spelling of the same place.

    Raises:
      ValueError: ``recipe`` is a `DelayedScaling`: its amax histories have no state to live in.

    Example:
      >>> import jaxmp
      >>> delayed = jaxmp.fp8.DelayedScaling()
      >>> refuse = jaxmp.fp8._hardware.refuse_delayed_in_a_function
      >>> try:
      ...     refuse(delayed, "O2-fp8", "'O2-fp8-current'")
      ... except ValueError as e:
      ...     print(str(e)[:48])
      O2-fp8: delayed fp8 scaling keeps amax histories
    """
    if isinstance(recipe, DelayedScaling):
        raise ValueError(f"{where}: delayed fp8 scaling keeps amax histories per layer across steps, which a plain "
                         f"function under jaxmp.autocast has no state for; use {instead} here (current scaling), or "
                         "the Flax door, jaxmp.flax.mixed_precision(model, 'O2-fp8'), which keeps them for "
                         "delayed scaling")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jaxmp (the user's wrapping call)."""
    frame: Any = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
