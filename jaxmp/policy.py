"""Precision policies: which dtype parameters are stored, computed and returned in.

A :class:`Policy` is jmp's three-dtype record (param / compute / output) with
casting that touches floating leaves only. :func:`get_policy` parses jmp's
string grammar plus Apex's ``O0``-``O3`` presets and Keras's policy names.
:func:`get_recipe` returns the whole Apex level (policy, master weights, loss
scale, which op classes stay in fp32); :func:`recommended_policy` picks one for
the hardware at hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

_FLOAT_NAMES: dict[str, Any] = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "full": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
}
_SHORT_NAME = {
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.float64): "f64",
}


def half_dtype() -> np.dtype:
    """Returns the half-precision dtype jmp picks for the current backend.

    bfloat16 on TPU, float16 elsewhere (jmp's semantics; :func:`recommended_policy`
    is the hardware-aware choice).

    Returns:
      ``jnp.bfloat16`` or ``jnp.float16`` as a numpy dtype.

    Example:
      >>> jaxmp.half_dtype()  # on CPU
      dtype(float16)
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def parse_dtype(value: str) -> np.dtype:
    """Parses a dtype name of jmp's grammar (``f32``, ``full``, ``bf16``, ``half`` ...).

    Args:
      value: the name.

    Returns:
      The numpy dtype.

    Raises:
      TypeError: ``value`` is not a string.
      ValueError: the name is unknown.

    Example:
      >>> jaxmp.parse_dtype("bf16")
      dtype(bfloat16)
    """
    if not isinstance(value, str):
        raise TypeError(f"dtype name must be a string, got {type(value).__name__}: {value!r}")
    name = value.strip().lower()
    if name == "half":
        return half_dtype()
    if name not in _FLOAT_NAMES:
        raise ValueError(
            f"Unknown dtype name {value!r}: expected one of "
            f"{sorted(set(_FLOAT_NAMES) | {'half'})}."
        )
    return np.dtype(_FLOAT_NAMES[name])


def canonical_float_dtype(dtype: Any, what: str = "dtype") -> np.dtype:
    """Returns ``dtype`` as a numpy floating dtype, or raises naming ``what``.

    Args:
      dtype: a dtype-like (``jnp.float16``, ``"bfloat16"``, ``np.dtype``) or a
        jmp-grammar name.
      what: how the error message calls this value (e.g. ``"compute_dtype"``).

    Returns:
      The numpy dtype.

    Raises:
      TypeError: ``dtype`` is not a floating dtype.

    Example:
      >>> jaxmp.policy.canonical_float_dtype("f16")
      dtype(float16)
    """
    if isinstance(dtype, str):
        try:
            return parse_dtype(dtype)
        except ValueError:
            pass
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{what} must be a floating dtype, got {dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{what} must be a floating dtype (float16/bfloat16/float32/float64), got {dt}")
    return dt


def is_floating_array(x: Any) -> bool:
    """True for numpy/JAX arrays (and tracers) whose dtype is floating.

    PRNG key arrays, float0 tangents, ints, bools and non-array leaves are not.

    Args:
      x: any pytree leaf.

    Returns:
      Whether casting policies and finiteness checks should touch the leaf.

    Example:
      >>> jaxmp.policy.is_floating_array(jnp.ones(2)), jaxmp.policy.is_floating_array(3.0)
      (True, False)
    """
    if not isinstance(x, (np.ndarray, jax.Array, np.generic)):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree: T, dtype: Any) -> T:
    """Casts the floating array leaves of ``tree`` to ``dtype``; other leaves pass through.

    Args:
      tree: any pytree.
      dtype: the target floating dtype.

    Returns:
      A tree of the same structure.

    Example:
      >>> jaxmp.cast_floating({"w": jnp.ones(2), "step": jnp.int32(3)}, jnp.float16)["w"].dtype
      dtype('float16')
    """
    dtype = canonical_float_dtype(dtype)

    def cast(x):
        return x.astype(dtype) if is_floating_array(x) and x.dtype != dtype else x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Parameter / compute / output dtypes, jmp's ``Policy`` with validation.

    Attributes:
      param_dtype: dtype parameters are stored in.
      compute_dtype: dtype the forward pass computes in.
      output_dtype: dtype the model returns (usually float32 for the loss).

    Example:
      >>> p = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> p.cast_to_compute(jnp.ones(3)).dtype
      dtype(bfloat16)
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, canonical_float_dtype(getattr(self, field), field))

    def cast_to_param(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the param dtype."""
        return cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the compute dtype."""
        return cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the output dtype."""
        return cast_floating(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> "Policy":
        """Returns a copy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    @property
    def uses_half(self) -> bool:
        """Whether any of the three dtypes is narrower than float32."""
        return any(np.dtype(d).itemsize < 4 for d in (self.param_dtype, self.compute_dtype, self.output_dtype))

    def __str__(self):
        return "p={},c={},o={}".format(
            _SHORT_NAME.get(self.param_dtype, str(self.param_dtype)),
            _SHORT_NAME.get(self.compute_dtype, str(self.compute_dtype)),
            _SHORT_NAME.get(self.output_dtype, str(self.output_dtype)),
        )


def as_policy(policy: Any) -> Policy:
    """Returns a jaxmp :class:`Policy` from a Policy, a ``jmp.Policy`` or a policy string.

    Args:
      policy: a :class:`Policy`, any object with ``param_dtype``/``compute_dtype``/
        ``output_dtype`` attributes (``jmp.Policy``), or a string for :func:`get_policy`.

    Returns:
      A :class:`Policy`.

    Raises:
      TypeError: ``policy`` is none of those.

    Example:
      >>> import jmp
      >>> jaxmp.as_policy(jmp.get_policy("c=bf16")).compute_dtype
      dtype(bfloat16)
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    if all(hasattr(policy, f) for f in ("param_dtype", "compute_dtype", "output_dtype")):
        return Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    raise TypeError(
        f"Expected a jaxmp.Policy, a jmp.Policy or a policy string, got {type(policy).__name__}: {policy!r}"
    )


# ----------------------------------------------------------------------------------------------
# Apex O-levels and Keras names.

#: Op categories that a recipe keeps in float32 (read by the Flax integration).
FP32_CATEGORIES = ("norm", "softmax", "loss")


class Recipe(NamedTuple):
    """A whole mixed-precision level: the policy plus what goes with it.

    Attributes:
      name: the preset name (``"O2"``, ``"mixed_float16"`` ...).
      policy: the dtypes.
      master_weights: whether the optimizer keeps an fp32 master copy of
        half-precision params (Apex O2); pass to :func:`jaxmp.loss_scaling`.
      loss_scale: ``"dynamic"`` or ``"none"``; :func:`jaxmp.make_loss_scale` turns it
        into a loss-scale object.
      keep_fp32: op categories (subset of ``("norm", "softmax", "loss")``) that run in
        float32 whatever the compute dtype.
    """

    name: str
    policy: Policy
    master_weights: bool
    loss_scale: str
    keep_fp32: tuple[str, ...]


_HALF_SUFFIXES = {"": None, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16,
                  "f16": jnp.float16, "float16": jnp.float16}


def preset_half_dtype(device: Any = None) -> np.dtype:
    """The half dtype a preset without ``-bf16``/``-fp16`` uses: the hardware's fast one.

    bfloat16 on TPU and on GPUs of compute capability >= 8.0, float16 elsewhere. (jmp's
    ``half`` in the policy grammar keeps jmp's meaning: see :func:`half_dtype`.)

    Args:
      device: a ``jax.Device``; defaults to the first local device.

    Returns:
      ``bfloat16`` or ``float16`` as a numpy dtype.

    Example:
      >>> jaxmp.policy.preset_half_dtype()  # on CPU
      dtype(float16)
    """
    device = jax.local_devices()[0] if device is None else device
    if device.platform == "tpu":
        return np.dtype(jnp.bfloat16)
    cc = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and cc is not None and int(str(cc).split(".")[0]) >= 8:
        return np.dtype(jnp.bfloat16)
    return np.dtype(jnp.float16)


def _split_preset(name: str):
    """'O2', 'O2-bf16', 'o2_fp16' -> ('O2', half dtype or None); None if not a preset."""
    n = name.strip()
    if len(n) >= 2 and n[0] in "oO" and n[1] in "0123":
        level, rest = "O" + n[1], n[2:]
        if rest[:1] in ("-", "_", ":"):
            rest = rest[1:]
        elif rest:
            return None
        if rest.lower() not in _HALF_SUFFIXES:
            raise ValueError(
                f"Unknown half dtype {rest!r} in preset {name!r}: use e.g. 'O2', 'O2-bf16' or 'O2-fp16'."
            )
        return level, _HALF_SUFFIXES[rest.lower()]
    return None


def get_recipe(name: str) -> Recipe:
    """Returns an Apex-style level or Keras policy name as a full :class:`Recipe`.

    Levels (``half`` is :func:`preset_half_dtype` -- bfloat16 on TPU and Ampere+ GPUs, float16
    elsewhere -- unless the name says ``-bf16`` / ``-fp16``):

    * ``O0``: everything float32, no loss scaling.
    * ``O1``: float32 params, half compute, float32 output; norms, softmax and the
      loss in float32; dynamic loss scaling for float16 (none for bfloat16).
    * ``O2``: half params with an fp32 master copy in the optimizer, half compute,
      float32 output; norms and the loss in float32; dynamic scaling for float16.
    * ``O3``: pure half, no master weights, no loss scaling, nothing kept in fp32.
    * Keras: ``float32`` (= O0), ``mixed_float16`` / ``mixed_bfloat16`` (float32
      params, half compute, float32 output; dynamic scaling for float16).

    Args:
      name: the preset name.

    Returns:
      The :class:`Recipe`.

    Raises:
      TypeError: ``name`` is not a string.
      ValueError: ``name`` is not a preset.

    Example:
      >>> r = jaxmp.get_recipe("O2-bf16")
      >>> r.policy.param_dtype, r.master_weights, r.loss_scale
      (dtype(bfloat16), True, 'none')
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__}")
    f32 = np.dtype(jnp.float32)
    split = _split_preset(name)
    if split is not None:
        level, half = split
        half = np.dtype(half) if half is not None else preset_half_dtype()
        scale = "dynamic" if half == np.dtype(jnp.float16) else "none"
        if level == "O0":
            return Recipe(level, Policy(f32, f32, f32), False, "none", ())
        if level == "O1":
            return Recipe(name.strip(), Policy(f32, half, f32), False, scale, FP32_CATEGORIES)
        if level == "O2":
            return Recipe(name.strip(), Policy(half, half, f32), True, scale, ("norm", "loss"))
        return Recipe(name.strip(), Policy(half, half, half), False, "none", ())
    keras = {
        "float32": Recipe("float32", Policy(f32, f32, f32), False, "none", ()),
        "mixed_float16": Recipe("mixed_float16", Policy(f32, jnp.float16, f32), False, "dynamic", FP32_CATEGORIES),
        "mixed_bfloat16": Recipe("mixed_bfloat16", Policy(f32, jnp.bfloat16, f32), False, "none", FP32_CATEGORIES),
    }
    if name.strip() in keras:
        return keras[name.strip()]
    raise ValueError(
        f"Unknown preset {name!r}: expected O0, O1, O2, O3 (optionally with -bf16/-fp16), "
        "float32, mixed_float16 or mixed_bfloat16."
    )


def get_policy(policy_name: str) -> Policy:
    """Parses a policy string: jmp's grammar, Apex's O-levels or Keras's names.

    jmp's grammar: ``"params=float32,compute=bfloat16,output=float32"`` with short keys
    ``p``/``c``/``o``; unspecified params default to f32, compute follows params and
    output follows compute; a bare dtype name (``"half"``, ``"f32"``) sets all three.
    Presets: ``"O0"``..``"O3"`` (optionally ``"O2-bf16"``), ``"float32"``,
    ``"mixed_float16"``, ``"mixed_bfloat16"`` -- see :func:`get_recipe`.

    Args:
      policy_name: the string.

    Returns:
      A :class:`Policy`.

    Raises:
      TypeError: ``policy_name`` is not a string.
      ValueError: malformed string, unknown key or unknown dtype name.

    Example:
      >>> str(jaxmp.get_policy("p=f32,c=bf16"))
      'p=f32,c=bf16,o=bf16'
      >>> str(jaxmp.get_policy("O1-fp16"))
      'p=f32,c=f16,o=f32'
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"policy name must be a string, got {type(policy_name).__name__}: {policy_name!r}")
    text = policy_name.strip()
    if not text:
        raise ValueError("policy name is empty")
    if "=" not in text:
        if text in ("mixed_float16", "mixed_bfloat16") or _split_preset(text) is not None:
            return get_recipe(text).policy
        dt = parse_dtype(text)
        return Policy(dt, dt, dt)

    param = np.dtype(jnp.float32)
    compute = output = None
    seen = set()
    for part in text.split(","):
        if part.count("=") != 1:
            raise ValueError(f"Malformed policy part {part!r} in {policy_name!r}: expected 'key=dtype'.")
        key, value = (s.strip() for s in part.split("="))
        key = {"p": "params", "c": "compute", "o": "output"}.get(key, key)
        if key not in ("params", "compute", "output"):
            raise ValueError(f"Unknown key {key!r} in {policy_name!r}: expected params/p, compute/c or output/o.")
        if key in seen:
            raise ValueError(f"Key {key!r} given twice in {policy_name!r}.")
        seen.add(key)
        dt = parse_dtype(value)
        if key == "params":
            param = dt
        elif key == "compute":
            compute = dt
        else:
            output = dt
    compute = param if compute is None else compute
    output = compute if output is None else output
    return Policy(param, compute, output)


# ----------------------------------------------------------------------------------------------
# Hardware recommendation.


class Recommendation(NamedTuple):
    """What :func:`recommended_policy` returns.

    Attributes:
      recipe: the recommended :class:`Recipe` (its ``policy`` is the dtypes).
      reason: one sentence saying why, naming the device.
    """

    recipe: Recipe
    reason: str

    @property
    def policy(self) -> Policy:
        return self.recipe.policy


def recommended_policy(device: Any = None, *, platform: str | None = None,
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
      A :class:`Recommendation` with ``recipe`` (and ``policy``) and ``reason``.

    Example:
      >>> rec = jaxmp.recommended_policy(platform="gpu", compute_capability="7.0")
      >>> str(rec.policy), rec.recipe.loss_scale
      ('p=f32,c=f16,o=f32', 'dynamic')
    """
    if device is None and platform is None:
        device = jax.devices()[0]
    if platform is None:
        platform = device.platform
    platform = platform.lower()
    kind = getattr(device, "device_kind", platform) if device is not None else platform
    if platform == "tpu":
        return Recommendation(get_recipe("mixed_bfloat16"), f"{kind}: TPUs compute natively in bfloat16, which keeps float32's range, so no loss scaling is needed.")
    if platform in ("gpu", "cuda", "rocm"):
        cc = compute_capability if compute_capability is not None else getattr(device, "compute_capability", None)
        if cc is None:
            raise ValueError(f"cannot tell the compute capability of {kind}; pass compute_capability='8.0' or similar")
        try:
            major = int(str(cc).split(".")[0])
        except ValueError as e:
            raise ValueError(f"compute_capability must look like '8.0', got {cc!r}") from e
        if major >= 8:
            return Recommendation(get_recipe("mixed_bfloat16"), f"{kind} (compute capability {cc}) has bfloat16 Tensor Cores: bfloat16 compute with float32 params, no loss scaling.")
        if major == 7:
            return Recommendation(get_recipe("mixed_float16"), f"{kind} (compute capability {cc}) has float16 Tensor Cores but no bfloat16: float16 compute with dynamic loss scaling.")
        return Recommendation(get_recipe("float32"), f"{kind} (compute capability {cc}) predates Tensor Cores: half precision saves memory but not time, so float32.")
    if platform == "cpu":
        return Recommendation(get_recipe("float32"), f"{kind}: CPUs have no fast half-precision matrix units here, so float32.")
    raise ValueError(f"unknown platform {platform!r}: expected cpu, gpu or tpu")


def cast_to_full(tree: T) -> T:
    """Casts floating leaves to float32 (jmp's ``cast_to_full``).

    Args:
      tree: any pytree.

    Returns:
      The tree with floating leaves in float32, other leaves unchanged.

    Example:
      >>> jaxmp.cast_to_full(jnp.ones(2, jnp.float16)).dtype
      dtype('float32')
    """
    return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Casts floating leaves to :func:`half_dtype` (jmp's ``cast_to_half``).

    Args:
      tree: any pytree.

    Returns:
      The tree with floating leaves in the half dtype, other leaves unchanged.

    Example:
      >>> jaxmp.cast_to_half(jnp.ones(2)).dtype  # on CPU
      dtype('float16')
    """
    return cast_floating(tree, half_dtype())
