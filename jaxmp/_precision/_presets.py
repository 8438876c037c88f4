"""Presets (Apex ``O0``-``O3``, Keras names) as recipes, and the string entry points.

Every policy string a user passes is parsed once, here, into typed objects:
`jaxmp._precision._presets.resolve_policy` returns the [`Policy`][jaxmp.Policy] and, for a preset, the
[`Recipe`][jaxmp.Recipe] that goes with it (master weights, loss scale, float32 categories).
[`get_policy`][jaxmp.get_policy], [`as_policy`][jaxmp.as_policy] and [`get_recipe`][jaxmp.get_recipe] are views of it.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import fp8 as _fp8
from jaxmp._formats import E2M1 as _E2M1, E4M3 as _E4M3
from jaxmp.fp8._seams import recipes as _fp8_recipes
from jaxmp._typing import PolicyLike
from jaxmp._dtypes import dtype_names
from jaxmp._precision._policy import Policy, parse_policy_grammar

#: Op categories that a recipe keeps in float32 (read by the Flax integration).
FLOAT32_CATEGORIES = ("norm", "softmax", "loss")

_F32 = np.dtype(jnp.float32)
_HALF_SUFFIXES = {"": None, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16,
                  "f16": jnp.float16, "float16": jnp.float16}
_KERAS = ("float32", "mixed_float16", "mixed_bfloat16")
_PRESET_HELP = ("O0, O1, O2, O3 (optionally with -bf16/-fp16, e.g. 'O2-bf16'), O2-fp8 (delayed scaling), "
                "O2-fp8-current (current scaling), the block-scaled O2-mxfp8, O2-fp8-rowwise, O2-fp8-block128 and "
                "O2-nvfp4, float32, mixed_float16, mixed_bfloat16")
# fp8 presets: O2-bf16 with the half list's matmuls and convolutions in fp8 (or fp4). The
# block-scaled ones are documented, with their sources, in docs/fp8.md#block-scaled-formats.
_FP8_SUFFIXES: dict[str, Callable[[], _fp8.Fp8Recipe]] = {
    "fp8": _fp8.DelayedScaling, "fp8-delayed": _fp8.DelayedScaling, "fp8-current": _fp8.CurrentScaling,
    # Transformer Engine's MXFP8BlockScaling: E4M3 in every leg, 1x32 E8M0 scales, its round-up rule.
    "mxfp8": lambda: _fp8.CurrentScaling(block=(1, 32), bwd_dtype=_E4M3, scale_format="e8m0", scale_rule="rceil"),
    # torchao's "rowwise" Float8 recipe: E4M3 everywhere, a power-of-two scale per row.
    "fp8-rowwise": lambda: _fp8.CurrentScaling(block="row", bwd_dtype=_E4M3, scale_format="e8m0", scale_rule="rceil"),
    # DeepSeek-V3: 1x128 activation / gradient tiles, 128x128 weight blocks, E4M3 everywhere.
    "fp8-block128": lambda: _fp8.CurrentScaling(block=(1, 128), rhs_block=(128, 128), bwd_dtype=_E4M3,
                                                scale_format="e8m0", scale_rule="rceil"),
    # NVIDIA's NVFP4 training recipe: E2M1, E4M3 scales per 1x16 (16x16 for weights) and a
    # per-tensor float32 scale, stochastic rounding of gradients, a Hadamard transform on wgrad.
    "nvfp4": lambda: _fp8.CurrentScaling(block=(1, 16), rhs_block=(16, 16), fwd_dtype=_E2M1, bwd_dtype=_E2M1,
                                         scale_format="e4m3", stochastic_rounding=True, hadamard=True),
}
#: Every preset name in its documented spelling: what a typo is compared with ("did you mean").
PRESET_NAMES = (*(f"O{i}{s}" for i in range(4) for s in ("", "-bf16", "-fp16")), "O2-fp8", "O2-fp8-current",
                "O2-mxfp8", "O2-fp8-rowwise", "O2-fp8-block128", "O2-nvfp4", *_KERAS)


def did_you_mean(text: str, choices: Any) -> str:
    """``" (did you mean 'X'?)"`` for the choices closest to a mistyped ``text``, else ``""``.
    """
    choices = list(choices)
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(text).strip().lower(), list(by_lower), n=2, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(by_lower[c]) for c in close) + "?)"


class Recipe(NamedTuple):
    """A whole mixed-precision level: the policy plus what goes with it.

    Attributes:
      name: the preset name (``"O2"``, ``"mixed_float16"`` ...).
      policy: the dtypes.
      master_weights: whether the optimizer keeps a float32 master copy of
        half-precision params (Apex O2); pass to [`jaxmp.loss_scaling`][jaxmp.loss_scaling].
      loss_scale: ``"dynamic"`` or ``"none"``; [`jaxmp.make_loss_scale`][jaxmp.make_loss_scale] turns it
        into a loss-scale object.
      keep_float32: op categories (subset of ``("norm", "softmax", "loss")``) that run in
        float32 whatever the compute dtype.
      fp8: None, or the `jaxmp.fp8` recipe of the half list's matmuls (the ``O2-fp8`` presets).
      level: the Apex level (``"O0"``..``"O3"``); None for a hand-made recipe.
    """

    name: str
    policy: Policy
    master_weights: bool
    loss_scale: str
    keep_float32: tuple[str, ...]
    fp8: _fp8.Fp8Recipe | None = None
    level: str | None = None


def preset_half_dtype(device: jax.Device | None = None) -> np.dtype:
    """The half dtype a preset without ``-bf16``/``-fp16`` uses: the hardware's fast one.

    bfloat16 on TPU and on GPUs of compute capability >= 8.0, float16 elsewhere.

    Args:
      device: a ``jax.Device``; defaults to the first local device.

    Returns:
      ``bfloat16`` or ``float16`` as a numpy dtype.
    """
    device = jax.local_devices()[0] if device is None else device
    if device.platform == "tpu":
        return np.dtype(jnp.bfloat16)
    cc = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and cc is not None and int(str(cc).split(".")[0]) >= 8:
        return np.dtype(jnp.bfloat16)
    return np.dtype(jnp.float16)


def _level_recipe(name: str, level: str, half: Any) -> Recipe:
    half = np.dtype(half) if half is not None else preset_half_dtype()
    scale = "dynamic" if half == np.dtype(jnp.float16) else "none"
    if level == "O0":
        return Recipe(level, Policy(_F32, _F32, _F32), False, "none", (), level=level)
    if level == "O1":
        return Recipe(name, Policy(_F32, half, _F32), False, scale, FLOAT32_CATEGORIES, level=level)
    if level == "O2":
        return Recipe(name, Policy(half, half, _F32), True, scale, ("norm", "loss"), level=level)
    return Recipe(name, Policy(half, half, half), False, "none", (), level=level)


def _keras_recipe(name: str) -> Recipe:
    if name == "float32":
        return Recipe(name, Policy(_F32, _F32, _F32), False, "none", (), level="O0")
    half = jnp.float16 if name == "mixed_float16" else jnp.bfloat16
    return Recipe(name, Policy(_F32, half, _F32), False, "dynamic" if half == jnp.float16 else "none",
                  FLOAT32_CATEGORIES, level="O1")


def parse_preset(name: str) -> Recipe | None:
    """The [`Recipe`][jaxmp.Recipe] of a preset name, or None when ``name`` is not one.

    Args:
      name: a string.

    Returns:
      The recipe, or None for any string that is not a preset (e.g. jmp's grammar).

    Raises:
      ValueError: an O-level with an unknown half-dtype suffix (``"O2-f8"``).
    """
    n = name.strip()
    if n in _KERAS:
        return _keras_recipe(n)
    if len(n) < 2 or n[0] not in "oO" or n[1] not in "0123":
        return None
    level, rest = "O" + n[1], n[2:]
    if rest[:1] in ("-", "_", ":"):
        rest = rest[1:]
        if not rest:  # "O2-": a separator promises a dtype; reading it as "O2" would hide a typo
            raise ValueError(f"Preset {name!r} ends in {name.strip()[-1]!r} with no half dtype after it: use "
                             f"{level!r} (the device's half dtype) or e.g. '{level}-bf16' or '{level}-fp16'.")
    elif rest:
        return None
    if rest.lower() in _FP8_SUFFIXES:
        if level != "O2":
            raise ValueError(f"fp8 presets are O2-based (bf16 elsewhere, float32 masters): use 'O2-{rest}', "
                             f"not {name!r}.")
        return _level_recipe(n, level, jnp.bfloat16)._replace(fp8=_FP8_SUFFIXES[rest.lower()]())
    if rest.lower() not in _HALF_SUFFIXES:
        raise ValueError(f"Unknown half dtype {rest!r} in preset {name!r}{did_you_mean(n, PRESET_NAMES)}: use e.g. "
                         "'O2', 'O2-bf16', 'O2-fp16' or 'O2-fp8'.")
    return _level_recipe(n, level, _HALF_SUFFIXES[rest.lower()])


def _unknown(text: str) -> ValueError:
    return ValueError(
        f"Unknown policy {text!r}{did_you_mean(text, (*PRESET_NAMES, *dtype_names()))}: expected a preset "
        f"({_PRESET_HELP}), a dtype name ({', '.join(dtype_names())}) "
        "or jmp's grammar 'params=float32,compute=bfloat16,output=float32'."
    )


def resolve_policy(policy: PolicyLike) -> tuple[Policy, Recipe | None]:
    """The one parser of user-given policies: a typed [`Policy`][jaxmp.Policy] and, for presets, the Recipe.

    Args:
      policy: a [`jaxmp.Policy`][jaxmp.Policy], a ``jmp.Policy`` (or any object with
        ``param_dtype``/``compute_dtype``/``output_dtype``), a [`Recipe`][jaxmp.Recipe], or a string:
        a preset (``"O1"``, ``"O2-bf16"``, ``"mixed_float16"``), a dtype name or jmp's grammar.

    Returns:
      ``(policy, recipe)``; ``recipe`` is None unless ``policy`` named a preset or was a Recipe.

    Raises:
      TypeError: ``policy`` is none of those, or has non-floating dtypes.
      ValueError: a string that is no preset, dtype name or valid grammar; the message lists them.

    Example:
      >>> import jaxmp
      >>> policy, recipe = jaxmp._precision._presets.resolve_policy("O2-bf16")
      >>> str(policy), recipe.master_weights
      ('p=bf16,c=bf16,o=f32', True)
    """
    if isinstance(policy, Recipe):
        return policy.policy, policy
    if isinstance(policy, Policy):
        return policy, None
    if isinstance(policy, str):
        text = policy.strip()
        if not text:
            raise ValueError("policy name is empty")
        recipe = parse_preset(text)
        if recipe is not None:
            return recipe.policy, recipe
        if "=" not in text and text.lower() not in dtype_names():
            raise _unknown(policy)
        return parse_policy_grammar(text), None
    if all(hasattr(policy, f) for f in ("param_dtype", "compute_dtype", "output_dtype")):
        return Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype), None
    raise TypeError(
        f"Expected a jaxmp.Policy, a jmp.Policy, a Recipe or a policy string, got {type(policy).__name__}: {policy!r}"
    )


def get_recipe(name: str) -> Recipe:
    """Returns an Apex-style level or Keras policy name as a full [`Recipe`][jaxmp.Recipe].

    ``O0``-``O3``, ``O2-fp8`` / ``O2-fp8-current``, the block-scaled ``O2-mxfp8``,
    ``O2-fp8-rowwise``, ``O2-fp8-block128`` and ``O2-nvfp4``, and the Keras names; without ``-bf16`` /
    ``-fp16`` the half dtype is `preset_half_dtype`. The table of levels is in
    docs/concepts.md#policies-and-presets.

    Args:
      name: the preset name.

    Returns:
      The [`Recipe`][jaxmp.Recipe].

    Raises:
      TypeError: ``name`` is not a string.
      ValueError: ``name`` is not a preset (the message lists them).

    Example:
      >>> import jaxmp
      >>> r = jaxmp.get_recipe("O2-bf16")
      >>> r.policy.param_dtype, r.master_weights, r.loss_scale
      (dtype(bfloat16), True, 'none')
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__}")
    recipe = parse_preset(name)
    if recipe is None:
        raise ValueError(f"Unknown preset {name!r}{did_you_mean(name, PRESET_NAMES)}: expected {_PRESET_HELP}.")
    return recipe


def get_policy(policy_name: str) -> Policy:
    """Parses a policy string: jmp's grammar, Apex's O-levels or Keras's names.

    jmp's grammar (``"p=f32,c=bf16,o=f32"``; compute follows params, output follows compute;
    a bare dtype name sets all three) or a preset (see [`get_recipe`][jaxmp.get_recipe]).

    Args:
      policy_name: the string.

    Returns:
      A [`Policy`][jaxmp.Policy].

    Raises:
      TypeError: ``policy_name`` is not a string.
      ValueError: malformed string, unknown key or unknown name (the message lists presets and dtypes);
        or an fp8 preset (``"O2-fp8"``, ``"O2-mxfp8"``, ``"O2-nvfp4"``...), whose recipe a Policy
        cannot hold: the message names [`get_recipe`][jaxmp.get_recipe] and the doors that keep it.

    Example:
      >>> import jaxmp
      >>> str(jaxmp.get_policy("p=f32,c=bf16"))
      'p=f32,c=bf16,o=bf16'
      >>> str(jaxmp.get_policy("O1-fp16"))
      'p=f32,c=f16,o=f32'
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"policy name must be a string, got {type(policy_name).__name__}: {policy_name!r}")
    return _dtypes_only(policy_name, "get_policy")


def _dtypes_only(policy: PolicyLike, caller: str) -> Policy:
    """The Policy of ``policy``, refusing an fp8 preset's name: a Policy is three dtypes, and
    handing it on (to autocast, a Flax door, Haiku) would run bf16 where the name promised fp8."""
    resolved, recipe = resolve_policy(policy)
    if isinstance(policy, str) and recipe is not None and recipe.fp8 is not None:
        name = policy.strip()
        raise ValueError(
            f"jaxmp.{caller}({name!r}): {name!r} is an fp8 preset, and a Policy holds only dtypes ({resolved}): it would "
            f"drop the recipe {_fp8_recipes.source(recipe.fp8)}. Pass the name where it is applied, "
            f"jaxmp.autocast(fn, {name!r}) or jaxmp.flax.mixed_precision(model, {name!r}); "
            f"jaxmp.get_recipe({name!r}) is the whole level (.fp8 the recipe, .policy the dtypes alone).")
    return resolved


def as_policy(policy: PolicyLike) -> Policy:
    """Returns a jaxmp [`Policy`][jaxmp.Policy] from a Policy, a ``jmp.Policy``, a Recipe or a policy string.

    Args:
      policy: anything `jaxmp._precision._presets.resolve_policy` accepts.

    Returns:
      A [`Policy`][jaxmp.Policy].

    Raises:
      TypeError: ``policy`` is none of those.
      ValueError: an fp8 preset's name, as for [`get_policy`][jaxmp.get_policy].

    Example:
      >>> import jmp, jaxmp
      >>> jaxmp.as_policy(jmp.get_policy("c=bf16")).compute_dtype
      dtype(bfloat16)
    """
    return _dtypes_only(policy, "as_policy")

