"""Which mixed-precision recipe to use on the hardware at hand."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxmp._precision._policy import Policy
from jaxmp._precision._presets import Recipe, get_recipe


class Recommendation(NamedTuple):
    """What [`recommended_policy`][jaxmp.recommended_policy] returns.

    Attributes:
      recipe: the recommended [`Recipe`][jaxmp.Recipe] (its ``policy`` is the dtypes).
      reason: one sentence saying why, naming the device.
    """

    recipe: Recipe
    reason: str

    @property
    def policy(self) -> Policy:
        return self.recipe.policy


def _gpu_recommendation(kind: str, cc: Any) -> Recommendation:
    if cc is None:
        raise ValueError(f"cannot tell the compute capability of {kind}; pass compute_capability='8.0' or similar")
    try:
        major = int(str(cc).split(".")[0])
    except ValueError as e:
        raise ValueError(f"compute_capability must look like '8.0', got {cc!r}") from e
    if major >= 8:
        return Recommendation(get_recipe("mixed_bfloat16"), f"{kind} (compute capability {cc}) has bfloat16 Tensor "
                              "Cores: bfloat16 compute with float32 params, no loss scaling.")
    if major == 7:
        return Recommendation(get_recipe("mixed_float16"), f"{kind} (compute capability {cc}) has float16 Tensor "
                              "Cores but no bfloat16: float16 compute with dynamic loss scaling.")
    return Recommendation(get_recipe("float32"), f"{kind} (compute capability {cc}) predates Tensor Cores: half "
                          "precision saves memory but not time, so float32.")


def recommended_policy(device: jax.Device | None = None, *, platform: str | None = None,
                       compute_capability: str | float | None = None) -> Recommendation:
    """Recommends a mixed-precision recipe for a device.

    bfloat16 (no loss scaling) on TPU and on GPUs of compute capability >= 8.0;
    float16 with dynamic loss scaling on 7.x (V100, T4); float32 on CPU and
    pre-Volta GPUs, where half precision brings no speed.

    Args:
      device: a ``jax.Device``; defaults to ``jax.devices()[0]``.
      platform: overrides the device's platform (``"cpu"``, ``"gpu"``/``"cuda"``, ``"tpu"``).
      compute_capability: overrides the GPU's compute capability (``"8.0"``).

    Returns:
      A `jaxmp._precision._platform.Recommendation` with ``recipe`` (and ``policy``) and ``reason``.

    Raises:
      ValueError: an unknown platform, or a GPU whose compute capability is unknown.
      TypeError: ``device`` is not a device (a platform name given positionally), or
        ``platform`` is not a string.

    Example:
      >>> import jaxmp
      >>> rec = jaxmp.recommended_policy(platform="gpu", compute_capability="7.0")
      >>> str(rec.policy), rec.recipe.loss_scale
      ('p=f32,c=f16,o=f32', 'dynamic')
    """
    if isinstance(device, str):
        # recommended_policy("gpu") reads naturally, but the name lands in `device`.
        raise TypeError(f"device must be a jax.Device, got the str {device!r}: pass a platform name as "
                        f"recommended_policy(platform={device!r})")
    if device is not None and not hasattr(device, "platform"):
        raise TypeError(f"device must be a jax.Device (e.g. jax.devices()[0]), got {type(device).__name__}")
    if platform is not None and not isinstance(platform, str):
        raise TypeError(f"platform must be a str ('cpu', 'gpu' or 'tpu'), got {type(platform).__name__}")
    if device is None and platform is None:
        device = jax.devices()[0]
    if platform is None:
        platform = device.platform
    platform = platform.lower()
    kind = getattr(device, "device_kind", platform) if device is not None else platform
    if platform == "tpu":
        return Recommendation(get_recipe("mixed_bfloat16"), f"{kind}: TPUs compute natively in bfloat16, which keeps "
                              "float32's range, so no loss scaling is needed.")
    if platform in ("gpu", "cuda", "rocm"):
        cc = compute_capability if compute_capability is not None else getattr(device, "compute_capability", None)
        return _gpu_recommendation(kind, cc)
    if platform == "cpu":
        return Recommendation(get_recipe("float32"), f"{kind}: CPUs have no fast half-precision matrix units here, so float32.")
    raise ValueError(f"unknown platform {platform!r}: expected cpu, gpu or tpu")
