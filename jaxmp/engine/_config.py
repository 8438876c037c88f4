"""The resolved settings of one [`jaxmp.autocast`][jaxmp.autocast] call, and the tracing context.

The tracing context is a JAX config state in ``jax.jit``'s cache key, so a jitted function traced
inside autocast and called outside it later gets its own (float32) trace.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxmp.fp8._seams import hardware as fp8_hardware
from jaxmp.engine import _internals as internals
from jaxmp.engine._module_rules import ModuleRules
from jaxmp.engine._rules import PURE_HALF_RULES, AutocastRules
from jaxmp._precision._policy import Policy
from jaxmp._precision._presets import resolve_policy
from jaxmp._misuse import MixedPrecisionWarning

_F32 = np.dtype("float32")


@dataclasses.dataclass(frozen=True)
class AutocastConfig:
    """What one autocast region does (hashable: it is part of jit cache keys).

    Attributes:
      name: the preset or policy it came from (for messages and profiles).
      compute_dtype: the half dtype of the half list.
      output_dtype: floating outputs are cast to it.
      cast_inputs: which floating arguments are cast to ``compute_dtype`` on entry: ``""``
        (none: O1), ``"weights"`` (those whose every use is a half-list op: O2) or ``"all"`` (O3).
      rules: the [`jaxmp.AutocastRules`][jaxmp.AutocastRules].
      identity: the region changes nothing (O0, or a float32 compute dtype).
      modules: the compiled module rules (`jaxmp.engine._module_rules.ModuleRules`) the module hooks read.
      from_flax_wrapper: the config of [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision], which pushes its
        own Linen interceptor (with its recording and module replacements) around the engine.
    """

    name: str
    compute_dtype: np.dtype
    output_dtype: np.dtype
    cast_inputs: str
    rules: AutocastRules
    identity: bool = False
    modules: ModuleRules = ModuleRules()
    from_flax_wrapper: bool = False


def _warn_pure_half(policy: str, compute: np.dtype) -> None:
    """A bare half dtype name means pure half (jmp's grammar); a torch user means mixed precision."""
    short = "bf16" if compute == np.dtype(jnp.bfloat16) else "fp16"
    warnings.warn(
        f"autocast policy {policy!r} is a bare dtype name, which means *pure* {compute.name} (jmp's grammar: "
        f"params, compute and output all {compute.name}; the loss comes back {compute.name}). torch.autocast's "
        f"{short!r} is mixed precision: use 'O1-{short}' for that (matmuls in half, softmax, norms and the loss in "
        f"float32), or 'O3-{short}' to say pure half on purpose.", MixedPrecisionWarning, stacklevel=4)


def resolve_config(policy: Any, rules: AutocastRules | None) -> AutocastConfig:
    """Turns autocast's ``policy`` / ``rules`` arguments into an `jaxmp.engine._config.AutocastConfig`.

    O0 is the identity, O1 casts per op, O2 also casts the weights on entry, O3 is pure half; a
    [`jaxmp.Policy`][jaxmp.Policy] acts as O1 with its dtypes. A bare half dtype name (``"fp16"``) is
    jmp's pure half and warns. See docs/autocast.md#presets-under-autocast.

    Args:
      policy: a preset name, policy string, [`jaxmp.Policy`][jaxmp.Policy], ``jmp.Policy`` or
        [`jaxmp.Recipe`][jaxmp.Recipe].
      rules: explicit [`jaxmp.AutocastRules`][jaxmp.AutocastRules], or None for the preset's; their
        ``promote=None`` (the default) becomes the preset's (O1 ``"demand"``, O2/O3 ``"narrow"``).

    Returns:
      The `jaxmp.engine._config.AutocastConfig`.

    Raises:
      TypeError: ``rules`` is not an [`AutocastRules`][jaxmp.AutocastRules], or a non-floating policy.
      ValueError: an unknown preset or malformed policy string.
    """
    if rules is not None and not isinstance(rules, AutocastRules):
        raise TypeError(f"rules must be a jaxmp.AutocastRules, got {type(rules).__name__}: {rules!r}")
    modules = ModuleRules()
    if rules is not None:
        fp8_hardware.refuse_delayed_in_a_function(rules.fp8_matmuls, "AutocastRules.fp8_matmuls",
                                                  "rules=jaxmp.AutocastRules(fp8_matmuls=jaxmp.fp8.CurrentScaling())")
        # Compiled once, here: path rules and per-class policies are the Flax door's, refused by name.
        modules = rules.module_rules()
        door_formats = sorted({kind for kind, _, _ in rules.matmul_formats if kind != "scope"})
        if door_formats:
            raise ValueError(f"per-module formats by {' and '.join(door_formats)} need the Flax door, which knows "
                             "module paths and classes (jaxmp.flax.mixed_precision(model, policy, rules=...)); under "
                             "jaxmp.autocast give the module a jax.named_scope and use with_scope(name, format)")
    resolved, recipe = resolve_policy(policy)
    compute = np.dtype(resolved.compute_dtype)
    if isinstance(policy, str) and recipe is None and "=" not in policy and compute.itemsize < 4:
        _warn_pure_half(policy, compute)
    name = recipe.name if recipe is not None else str(resolved)
    level = recipe.level if recipe is not None else None
    weights = level == "O2" or (level is None and np.dtype(resolved.param_dtype).itemsize < 4)
    # O1 keeps float32 where a value needs it (the accuracy-first default); O2 and O3 narrow float32
    # operands to half (Apex's "almost pure half" speed trade): see AutocastRules.promote. Rules
    # given with promote=None take the preset's: passing rules must not change the program.
    promote = "narrow" if weights or level == "O3" else "demand"
    if rules is not None and rules.promote is None:
        rules = dataclasses.replace(rules, promote=promote)
    if compute.itemsize >= 4:
        return AutocastConfig(name, compute, np.dtype(resolved.output_dtype), "",
                              rules or AutocastRules(promote="demand"), identity=True, modules=modules)
    if level == "O3":
        return AutocastConfig(name, compute, compute, "all", rules or PURE_HALF_RULES, modules=modules)
    cast_inputs = "weights" if weights else ""
    output = np.dtype(resolved.output_dtype) if level is None else _F32
    rules = rules or AutocastRules(promote=promote)
    fp8_recipe = getattr(recipe, "fp8", None)
    if fp8_recipe is not None:
        fp8_hardware.refuse_delayed_in_a_function(fp8_recipe, name, "'O2-fp8-current'")
        if rules.fp8_matmuls is None:
            rules = dataclasses.replace(rules, fp8_matmuls=fp8_recipe)
    for each in rules.format_recipes():
        # The recipe that will run (the rules' own wins over the preset's): native, emulated with
        # one warning where a block format has no native path, or a clear error naming the way out.
        fp8_hardware.check_for_run(each)
    return AutocastConfig(name, compute, output, cast_inputs, rules, modules=modules)


# The tracing context: set while autocast traces the user's function. Part of jit's cache key.
TRACING = internals.jit_key_state(
    "jaxmp_autocast_tracing", None,
    "The AutocastConfig of the autocast region being traced (None outside autocast).")


def current() -> AutocastConfig | None:
    """The `jaxmp.engine._config.AutocastConfig` of the autocast region being traced, or None.

    Returns:
      The config while autocast traces a function, None otherwise (including inside a
      ``jaxmp[keep]`` region such as a half-input kernel).
    """
    return TRACING.value


def flax_config(policy: Policy, rules: AutocastRules) -> AutocastConfig:
    """The engine settings of [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision] for a policy and its rules.

    Class and path rules compile to casting module rules; fp8 is the door's own, so the
    engine's ``fp8_matmuls`` stays off.

    Args:
      policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].
      rules: the [`jaxmp.AutocastRules`][jaxmp.AutocastRules] of the door
        ([`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] by default).

    Returns:
      An `jaxmp.engine._config.AutocastConfig` (``identity`` for a float32 compute dtype).
    """
    compute = np.dtype(policy.compute_dtype)
    # The door's rules come merged onto default_rules(preset), whose promote is set; rules made by
    # hand with promote=None get what default_rules gives a bare policy.
    ops = dataclasses.replace(rules, class_rules=(), path_rules=(), fp8_matmuls=None, float32_loss=True,
                              fused_attention=True, promote=rules.promote or "demand")
    return AutocastConfig(f"flax {policy}", compute, np.dtype(policy.output_dtype), "", ops,
                          identity=compute.itemsize >= 4, modules=rules.module_rules(policy), from_flax_wrapper=True)
