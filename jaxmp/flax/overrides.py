"""Per-module-class precision overrides: which Flax layers run in half, which in float32.

The NVIDIA AMP op lists, at the granularity Flax gives us (module classes):

* half list ("whitelist"): matmuls and convolutions -- ``Dense``, ``DenseGeneral``,
  ``Conv``, ``ConvTranspose``, ``ConvLocal``, ``Einsum``, attention (Linen) and
  ``Linear``, ``LinearGeneral``, ``Conv``, ``ConvTranspose``, ``Einsum``,
  ``MultiHeadAttention`` (NNX). Their params and inputs are cast to the compute dtype.
* float32 list ("blacklist"): normalisation -- ``BatchNorm``, ``LayerNorm``,
  ``GroupNorm``, ``RMSNorm``, ``InstanceNorm`` (Linen and NNX). Params, statistics and
  arithmetic are float32; the output goes back to the dtype of the input.
* everything else follows its inputs: activations, pooling, residual adds, and user
  modules not named in either list (their own params take the policy's compute dtype).

These module rules are the Flax layer of the one precision engine ([`jaxmp.autocast`][jaxmp.autocast]):
the model runs inside the engine, and what the module rules leave open the engine's op lists
decide. Softmax is a function, not a module: with ``"softmax"`` kept (O1) the engine's float32
list keeps it (and every reduction) in float32; attention modules get
[`jaxmp.flax.fused_attention`][jaxmp.flax.fused_attention] (cuDNN on GPUs, a float32 softmax elsewhere); the train
steps compute the loss on float32 logits. The recipe's ``keep_fp32`` categories (``"norm"``,
``"softmax"``, ``"loss"``) switch the three on and off.

The policy wins over a half-list layer's own ``dtype=float32`` (wrapping a model is the request
for mixed precision; Flax's examples set ``dtype`` on every layer): such layers run in half and
the wrapper warns once, naming them. Path rules ([`PrecisionOverrides.with_fp32_paths`][jaxmp.flax.PrecisionOverrides.with_fp32_paths]) and
class rules ([`PrecisionOverrides.with_fp32`][jaxmp.flax.PrecisionOverrides.with_fp32]) keep chosen layers in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import fp8 as _fp8
from jaxmp._typing import PolicyLike
from jaxmp.engine.rules import ModuleRule, ModuleRules
from jaxmp.policy import Policy
from jaxmp.presets import FP32_CATEGORIES, Recipe, as_policy, get_recipe, resolve_policy

#: Linen and NNX matmul / convolution / attention classes that run in the compute dtype.
DEFAULT_HALF_MODULES: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum,
    nn.MultiHeadDotProductAttention,  # nn.MultiHeadAttention and nn.SelfAttention subclass it
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum, nnx.MultiHeadAttention,
)

#: Linen and NNX normalisation classes that a recipe with the ``"norm"`` category keeps in float32.
DEFAULT_NORM_MODULES: tuple[type, ...] = (
    nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm,
    nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm,
)

_F32 = np.dtype(jnp.float32)


def _check_module_class(cls: Any, where: str) -> type:
    """Returns ``cls`` if it is a Linen or NNX module class, else raises a TypeError naming ``where``."""
    if isinstance(cls, type) and issubclass(cls, (nn.Module, nnx.Module)):
        return cls
    if isinstance(cls, (nn.Module, nnx.Module)):
        hint = f" (got an instance; pass its class, type(x) = {type(cls).__name__})"
    elif isinstance(cls, str):
        hint = f" (got the string {cls!r}; pass the class itself, e.g. flax.linen.{cls})"
    else:
        hint = f" (got {type(cls).__name__}: {cls!r})"
    raise TypeError(f"{where}: expected a flax.linen.Module or flax.nnx.Module subclass{hint}")


def _class_tuple(classes: Iterable[Any], where: str) -> tuple[type, ...]:
    if isinstance(classes, type) or isinstance(classes, (str, nn.Module, nnx.Module)):
        classes = (classes,)
    out: list[type] = []
    for c in classes:
        c = _check_module_class(c, where)
        if c not in out:
            out.append(c)
    return tuple(out)


def _check_path_pattern(pattern: Any, where: str) -> str:
    """Returns ``pattern`` if it is a valid module-path glob, else raises naming ``where``."""
    if isinstance(pattern, (tuple, list)) and pattern and all(isinstance(p, (str, int)) for p in pattern):
        joined = "/".join(str(p) for p in pattern)
        raise TypeError(f"{where}: a module path is one string joined by '/', got the sequence {pattern!r}; "
                        f"pass {joined!r}")
    if isinstance(pattern, type) or isinstance(pattern, (nn.Module, nnx.Module)):
        name = pattern.__name__ if isinstance(pattern, type) else type(pattern).__name__
        raise TypeError(f"{where}: expected a module path such as 'decoder/head' (a glob on the path joined by '/'), "
                        f"got the module {'class' if isinstance(pattern, type) else 'instance'} {name}; "
                        f"for a whole class use PrecisionOverrides.with_fp32({name})")
    if not isinstance(pattern, str):
        raise TypeError(f"{where}: expected a module path string such as 'decoder/head', "
                        f"got {type(pattern).__name__}: {pattern!r}")
    if not pattern.strip():
        raise ValueError(f"{where}: empty module path {pattern!r}; the model itself has no path, so keep its class "
                         "in float32 with PrecisionOverrides.with_fp32(cls)")
    if pattern != pattern.strip():
        raise ValueError(f"{where}: module path {pattern!r} has leading or trailing whitespace")
    if pattern.startswith("/") or pattern.endswith("/") or "//" in pattern:
        raise ValueError(f"{where}: module path {pattern!r} has an empty component; paths are relative to the "
                         "wrapped model and joined by single '/', e.g. 'decoder/head' or '*/logits'")
    return pattern


def _path_tuple(patterns: Any, where: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    elif not isinstance(patterns, (tuple, list)):
        raise TypeError(f"{where}: expected a tuple of module path strings, got {type(patterns).__name__}: {patterns!r}")
    out: list[str] = []
    for p in patterns:
        p = _check_path_pattern(p, where)
        if p not in out:
            out.append(p)
    return tuple(out)


def join_path(path: Sequence[Any]) -> str:
    """A module path as the string that path rules match: its components joined by ``"/"``.

    Args:
      path: a Linen ``module.path`` or an NNX graph path, e.g. ``("layers", 0)``.

    Returns:
      The joined string, e.g. ``"layers/0"`` (``""`` for the model itself).

    Example:
      >>> from jaxmp.flax.overrides import join_path
      >>> join_path(("decoder", "layers", 2, "head"))
      'decoder/layers/2/head'
    """
    return "/".join(str(p) for p in path)


def explicit_float32(module: Any) -> bool:
    """Whether a module instance has ``dtype`` set to float32 (not left as ``None``).

    Args:
      module: a Linen or NNX module instance.

    Returns:
      True for a layer built with ``dtype=jnp.float32`` (Flax's computation dtype).

    Example:
      >>> import flax.linen as nn, jax.numpy as jnp
      >>> from jaxmp.flax.overrides import explicit_float32
      >>> explicit_float32(nn.Dense(3, dtype=jnp.float32)), explicit_float32(nn.Dense(3))
      (True, False)
    """
    dtype = getattr(module, "dtype", None)
    if dtype is None:
        return False
    try:
        return np.dtype(dtype) == _F32
    except TypeError:
        return False


def overridden_float32_message(paths: Sequence[str], classes: Sequence[str], compute_dtype: Any) -> str:
    """The warning for half-list layers whose explicit ``dtype=float32`` the policy overrode.

    Args:
      paths: the layers' module paths joined by ``"/"`` (``""`` for the wrapped model itself).
      classes: their class names, in the same order.
      compute_dtype: the policy's compute dtype they run in instead.

    Returns:
      One message naming every layer and the override that keeps them float32.

    Example:
      >>> from jaxmp.flax.overrides import overridden_float32_message
      >>> print(overridden_float32_message(["head"], ["Dense"], "bfloat16"))  # doctest: +ELLIPSIS
      jaxmp.flax.mixed_precision: 1 half-list layer(s) set dtype=float32, but the policy runs their matmuls ...
    """
    named = [p for p in paths if p]
    layers = ", ".join(f"{p!r} ({c})" if p else f"the wrapped model itself ({c})" for p, c in zip(paths, classes))
    routes = []
    if named:
        routes.append("overrides.with_fp32_paths(" + ", ".join(repr(p) for p in named) + ")")
    roots = [c for p, c in zip(paths, classes) if not p]
    if roots:
        routes.append(f"overrides.with_fp32({roots[0]}) (the class rule; the model itself has no path)")
    return (
        f"jaxmp.flax.mixed_precision: {len(paths)} half-list layer(s) set dtype=float32, but the policy runs their "
        f"matmuls and convolutions in {np.dtype(compute_dtype).name} (wrapping a model asks for the policy; a "
        f"layer's dtype does not opt out): {layers}. To keep them in float32, pass "
        f"{' and '.join(routes)}, where overrides is the PrecisionOverrides in use "
        "(jaxmp.flax.PrecisionOverrides.from_recipe(preset) by default). Warned once per wrapped model."
    )


@dataclasses.dataclass(frozen=True)
class PrecisionOverrides:
    """Per-module-class precision rules applied on top of a [`jaxmp.Policy`][jaxmp.Policy].

    Instances are immutable and hashable (usable as static data under ``jit``); the
    ``with_*``/``without`` methods return modified copies. Subclasses match their base's
    entry; the most specific class in a module's MRO wins, and a per-class policy beats
    both lists for the same class.

    Attributes:
      half_modules: classes whose params and inputs are cast to the policy's compute dtype.
      fp32_modules: classes that run entirely in float32 (params, inputs, statistics);
        their output is cast back to their input's dtype.
      module_policies: ``((cls, Policy), ...)`` -- classes with a policy of their own
        (params and inputs in its compute dtype, output in its output dtype). A mapping
        ``{cls: policy}`` is accepted and a policy may be a string or ``jmp.Policy``.
      fp32_softmax: the engine's float32 list applies (softmax, every reduction and the
        transcendentals in float32, as O1); False: pure half outside float32 modules (O2, O3).
      fp32_loss: the train steps compute the loss on float32 logits.
      fused_attention: attention modules with Flax's default attention run
        [`jaxmp.flax.fused_attention`][jaxmp.flax.fused_attention] (cuDNN on GPUs, XLA with a float32 softmax
        elsewhere); False keeps Flax's own attention under the op lists.
      fp8: None, or a `jaxmp.fp8` recipe (``DelayedScaling()`` / ``CurrentScaling()``):
        the half-list ``Dense``/``DenseGeneral``/``Conv`` (Linen) and
        ``Linear``/``LinearGeneral``/``Conv`` (NNX) layers run their matmul or convolution
        in fp8 (`jaxmp.flax.fp8`). Set by the ``O2-fp8`` presets.
      fp32_paths: globs (`fnmatch.fnmatchcase`, ``*`` also crosses ``/``) on module
        paths joined by ``"/"`` (Linen ``module.path``, NNX graph paths, relative to the
        wrapped model): a matching module and everything under it run in float32, as a
        float32-list class does. A path rule beats every class rule. See [`with_fp32_paths`][jaxmp.flax.PrecisionOverrides.with_fp32_paths].

    Example:
      >>> import flax.linen as nn, jaxmp, jaxmp.flax
      >>> class MyNorm(nn.Module): pass
      >>> ov = jaxmp.flax.PrecisionOverrides.from_recipe("O1")
      >>> ov = ov.with_fp32(MyNorm).without(nn.GroupNorm).with_policy(nn.Embed, "f32")
      >>> policy = jaxmp.get_policy("O1-bf16")
      >>> ov.rule_for(MyNorm, policy).kind, ov.rule_for(nn.Embed, policy).kind, ov.rule_for(nn.GroupNorm, policy)
      ('fp32', 'policy', None)
    """

    half_modules: tuple[type, ...] = DEFAULT_HALF_MODULES
    fp32_modules: tuple[type, ...] = DEFAULT_NORM_MODULES
    module_policies: tuple[tuple[type, PolicyLike], ...] | Mapping[type, PolicyLike] = ()
    fp32_softmax: bool = True
    fp32_loss: bool = True
    fused_attention: bool = True
    fp8: _fp8.Fp8Recipe | None = None
    fp32_paths: tuple[str, ...] = ()

    def __post_init__(self):
        if self.fp8 is not None and not isinstance(self.fp8, _fp8.Fp8Recipe):
            raise TypeError(f"PrecisionOverrides.fp8 must be a jaxmp.fp8.DelayedScaling / CurrentScaling recipe or "
                            f"None, got {type(self.fp8).__name__}: {self.fp8!r}")
        half = _class_tuple(self.half_modules, "PrecisionOverrides.half_modules")
        fp32 = _class_tuple(self.fp32_modules, "PrecisionOverrides.fp32_modules")
        both = [c.__name__ for c in half if c in fp32]
        if both:
            raise ValueError(f"module classes {both} are in both half_modules and fp32_modules; pick one")
        items = self.module_policies.items() if isinstance(self.module_policies, Mapping) else self.module_policies
        policies: list[tuple[type, Policy]] = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"module_policies entries must be (module class, policy) pairs, got {item!r}")
            cls = _check_module_class(item[0], "PrecisionOverrides.module_policies")
            policies = [(c, p) for c, p in policies if c is not cls] + [(cls, as_policy(item[1]))]
        for name in ("fp32_softmax", "fp32_loss", "fused_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PrecisionOverrides.{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "half_modules", half)
        object.__setattr__(self, "fp32_modules", fp32)
        object.__setattr__(self, "module_policies", tuple(policies))
        object.__setattr__(self, "fp32_paths", _path_tuple(self.fp32_paths, "PrecisionOverrides.fp32_paths"))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_categories(cls, keep_fp32: Iterable[str] = FP32_CATEGORIES) -> "PrecisionOverrides":
        """Default lists with the recipe categories kept in float32.

        Args:
          keep_fp32: a subset of ``("norm", "softmax", "loss")``: ``"norm"`` puts the
            normalisation classes in the float32 list (else they follow the policy),
            ``"softmax"`` sets ``fp32_softmax``, ``"loss"`` sets ``fp32_loss``.

        Returns:
          A [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          ValueError: an unknown category.

        Example:
          >>> import jaxmp.flax
          >>> jaxmp.flax.PrecisionOverrides.from_categories(("norm", "loss")).fp32_softmax
          False
        """
        if isinstance(keep_fp32, str):
            keep_fp32 = (keep_fp32,)
        keep = tuple(keep_fp32)
        unknown = [c for c in keep if c not in FP32_CATEGORIES]
        if unknown:
            raise ValueError(f"unknown keep_fp32 categories {unknown}: expected a subset of {FP32_CATEGORIES}")
        return cls(
            half_modules=DEFAULT_HALF_MODULES,
            fp32_modules=DEFAULT_NORM_MODULES if "norm" in keep else (),
            fp32_softmax="softmax" in keep,
            fp32_loss="loss" in keep,
        )

    @classmethod
    def from_recipe(cls, recipe: Recipe | str) -> "PrecisionOverrides":
        """Default lists with the recipe's ``keep_fp32`` categories.

        O0 and O1 keep norm, softmax and loss in float32; O2 norm and loss; O3 nothing.

        Args:
          recipe: a [`jaxmp.Recipe`][jaxmp.Recipe] or a preset name for [`jaxmp.get_recipe`][jaxmp.get_recipe].

        Returns:
          A [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Example:
          >>> import jaxmp.flax
          >>> jaxmp.flax.PrecisionOverrides.from_recipe("O3").fp32_modules
          ()
        """
        if isinstance(recipe, str):
            recipe = get_recipe(recipe)
        if not isinstance(recipe, Recipe):
            raise TypeError(f"expected a jaxmp.Recipe or a preset name, got {type(recipe).__name__}")
        # O0 is all float32 anyway; keeping the default lists makes its overrides inert, not different.
        keep = FP32_CATEGORIES if recipe.name == "O0" or recipe.name == "float32" else recipe.keep_fp32
        return dataclasses.replace(cls.from_categories(keep), fp8=recipe.fp8)

    # -- modified copies -----------------------------------------------------------------

    def with_half(self, *classes: type) -> "PrecisionOverrides":
        """Copy with ``classes`` moved to the half list (and off the float32 list / policies).

        Args:
          *classes: Linen or NNX module classes (yours too).

        Returns:
          A new [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          TypeError: an argument is not a module class.

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> policy = jaxmp.get_policy("O1-bf16")
          >>> PrecisionOverrides().with_half(nn.Embed).rule_for(nn.Embed, policy).kind
          'half'
        """
        add = _class_tuple(classes, "with_half")
        return self._without(add)._replace(half_modules=self.half_modules + add)

    def with_fp32(self, *classes: type) -> "PrecisionOverrides":
        """Copy with ``classes`` moved to the float32 list (and off the half list / policies).

        Args:
          *classes: Linen or NNX module classes (yours too).

        Returns:
          A new [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          TypeError: an argument is not a module class.

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> policy = jaxmp.get_policy("O1-bf16")
          >>> class MyNorm(nn.Module): pass
          >>> PrecisionOverrides().with_fp32(MyNorm).rule_for(MyNorm, policy).compute_dtype
          dtype('float32')
        """
        add = _class_tuple(classes, "with_fp32")
        base = self._without(add)
        return base._replace(fp32_modules=base.fp32_modules + add)

    def with_fp32_paths(self, *patterns: str) -> "PrecisionOverrides":
        """Copy where the modules at these paths (and everything under them) run in float32.

        The per-layer route for one layer of a class the policy runs in half, e.g. the
        output head of a model whose other ``Dense`` layers should stay in half. A pattern
        is a glob (`fnmatch.fnmatchcase`; ``*`` matches across ``/`` too) on the
        module path joined by ``"/"``, relative to the wrapped model: Linen ``module.path``
        (``"decoder/head"``, ``"Dense_0"``), NNX attribute paths (``"layers/2"``). A module
        matches when its path or an ancestor's does; it then runs as a float32-list class:
        float32 params (also in storage under O2), inputs and arithmetic, output back in its
        input's dtype. A path rule beats class rules.

        Args:
          *patterns: module path strings or globs, e.g. ``"decoder/head"``, ``"*/logits"``.

        Returns:
          A new [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          TypeError: a pattern is not a string (a tuple path, a module class).
          ValueError: an empty pattern, or one with an empty component (``"a//b"``, ``"/a"``).

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> policy = jaxmp.get_policy("O1-bf16")
          >>> ov = PrecisionOverrides().with_fp32_paths("decoder/head", "*/logits")
          >>> ov.rule_at(("decoder", "head"), nn.Dense, policy).compute_dtype
          dtype('float32')
          >>> ov.rule_at(("decoder", "Dense_0"), nn.Dense, policy).compute_dtype
          dtype(bfloat16)
        """
        if not patterns:
            raise TypeError("with_fp32_paths: give at least one module path, e.g. with_fp32_paths('decoder/head')")
        return self._replace(fp32_paths=self.fp32_paths + _path_tuple(patterns, "with_fp32_paths"))

    def with_policy(self, cls: type, policy: PolicyLike) -> "PrecisionOverrides":
        """Copy where module class ``cls`` runs under its own policy (and is off both lists).

        Its params and inputs are cast to the policy's compute dtype, its output to the
        policy's output dtype, and its params are stored in the policy's param dtype.

        Args:
          cls: a Linen or NNX module class.
          policy: a [`jaxmp.Policy`][jaxmp.Policy], policy string or ``jmp.Policy``.

        Returns:
          A new [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          TypeError: ``cls`` is not a module class or ``policy`` is not a policy.

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> policy = jaxmp.get_policy("O1-bf16")
          >>> PrecisionOverrides().with_policy(nn.Dense, "f32").rule_for(nn.Dense, policy).kind
          'policy'
        """
        cls = _check_module_class(cls, "with_policy")
        base = self._without((cls,))
        return base._replace(module_policies=base.module_policies + ((cls, as_policy(policy)),))

    def without(self, *classes: type) -> "PrecisionOverrides":
        """Copy with ``classes`` removed from both lists and the per-class policies.

        Such modules follow their inputs, and their params take the policy's compute dtype.

        Args:
          *classes: Linen or NNX module classes.

        Returns:
          A new [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides].

        Raises:
          TypeError: an argument is not a module class.

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> policy = jaxmp.get_policy("O1-bf16")
          >>> PrecisionOverrides().without(nn.GroupNorm).rule_for(nn.GroupNorm, policy) is None
          True
        """
        return self._without(_class_tuple(classes, "without"))

    def _without(self, classes: tuple[type, ...]) -> "PrecisionOverrides":
        return self._replace(
            half_modules=tuple(c for c in self.half_modules if c not in classes),
            fp32_modules=tuple(c for c in self.fp32_modules if c not in classes),
            module_policies=tuple((c, p) for c, p in self.module_policies if c not in classes),
        )

    def _replace(self, **changes) -> "PrecisionOverrides":
        return dataclasses.replace(self, **changes)

    # -- resolution ----------------------------------------------------------------------

    def module_rules(self, policy: Policy) -> ModuleRules:
        """These overrides compiled, with ``policy``, to the engine's module rules.

        The one place a module's rule is decided is `jaxmp.engine.rules.ModuleRules.rule_at`:
        half-list classes become ``"half"`` rules (inputs and params in the compute dtype, no
        region), float32-list classes and path rules ``"fp32"`` rules (float32 region, output
        back in the input's dtype), per-class policies ``"policy"`` rules.

        Args:
          policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].

        Returns:
          A `jaxmp.engine.rules.ModuleRules` (cached per overrides and policy).

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> rules = PrecisionOverrides().with_fp32_paths("head").module_rules(jaxmp.get_policy("O1-bf16"))
          >>> rules.rule_at(("head",), nn.Dense).kind, rules.rule_at(("body",), nn.Dense).kind
          ('fp32', 'half')
        """
        return _compile(self, policy)

    def rule_for(self, module_or_class: nn.Module | nnx.Module | type, policy: Policy) -> ModuleRule | None:
        """The class rule for a module (or module class) under ``policy``; None if no list names it.

        Args:
          module_or_class: a Linen/NNX module instance or class.
          policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].

        Returns:
          A `jaxmp.engine.rules.ModuleRule`, or None when the module follows its inputs.

        Example:
          >>> import flax.linen as nn, jaxmp, jaxmp.flax
          >>> ov = jaxmp.flax.PrecisionOverrides()
          >>> ov.rule_for(nn.LayerNorm, jaxmp.get_policy("O1-fp16")).compute_dtype
          dtype('float32')
        """
        return self.module_rules(policy).rule_for(module_or_class)

    def fp32_path_match(self, path: Sequence[Any]) -> str | None:
        """The first ``fp32_paths`` pattern matching a module path or one of its ancestors.

        Args:
          path: the module path (a tuple of names; ``()`` is the wrapped model itself).

        Returns:
          The matching pattern, or None.

        Example:
          >>> from jaxmp.flax import PrecisionOverrides
          >>> ov = PrecisionOverrides().with_fp32_paths("decoder")
          >>> ov.fp32_path_match(("decoder", "Dense_0")), ov.fp32_path_match(("encoder",))
          ('decoder', None)
        """
        return ModuleRules(paths=tuple((p, _FP32_RULE) for p in self.fp32_paths)).path_match(path)

    def rule_at(self, path: Sequence[Any], module_or_class: nn.Module | nnx.Module | type,
                policy: Policy) -> ModuleRule | None:
        """The rule for the module at ``path``: float32 where a path rule matches, else [`rule_for`][jaxmp.flax.PrecisionOverrides.rule_for].

        Args:
          path: the module path (a tuple of names, relative to the wrapped model).
          module_or_class: the Linen/NNX module instance or class there.
          policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].

        Returns:
          A `jaxmp.engine.rules.ModuleRule`, or None when the module follows its inputs.

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> from jaxmp.flax import PrecisionOverrides
          >>> ov = PrecisionOverrides().with_fp32_paths("head")
          >>> ov.rule_at(("head",), nn.Dense, jaxmp.get_policy("O1-bf16")).kind
          'fp32'
        """
        return self.module_rules(policy).rule_at(path, module_or_class)


_FP32_RULE = ModuleRule(_F32, _F32, "input", "fp32")


@functools.lru_cache(maxsize=256)
def _compile(overrides: PrecisionOverrides, policy: Policy) -> ModuleRules:
    half = ModuleRule(policy.compute_dtype, policy.param_dtype, "computed", "half")
    # Later entries win for the same class: per-class policies beat the float32 list, which
    # beats the half list (a class is on one of them anyway, see PrecisionOverrides.with_*).
    classes = [(c, half) for c in overrides.half_modules]
    classes += [(c, _FP32_RULE) for c in overrides.fp32_modules]
    classes += [(c, ModuleRule(p.compute_dtype, p.param_dtype, p.output_dtype, "policy"))
                for c, p in overrides.module_policies]
    return ModuleRules(classes=tuple(classes), paths=tuple((p, _FP32_RULE) for p in overrides.fp32_paths))


def resolve_overrides(policy: PolicyLike, overrides: PrecisionOverrides | Iterable[str] | None) -> tuple[Policy, PrecisionOverrides]:
    """Turns the user's ``policy`` / ``overrides`` arguments into a Policy and overrides.

    Args:
      policy: a [`jaxmp.Policy`][jaxmp.Policy], ``jmp.Policy``, [`jaxmp.Recipe`][jaxmp.Recipe] or policy
        string. A preset name (``"O1"``, ``"O2-bf16"``, ``"mixed_float16"`` ...) or a
        Recipe also picks the default overrides from its ``keep_fp32`` categories.
      overrides: a [`PrecisionOverrides`][jaxmp.flax.PrecisionOverrides], a list of ``keep_fp32`` categories, or
        None for the preset's (or, for a bare policy, all three categories).

    Returns:
      ``(policy, overrides)``.

    Raises:
      TypeError: a policy whose dtypes are not floating, or overrides of the wrong type.
      ValueError: an fp8 recipe this hardware cannot run ([`jaxmp.fp8.check_hardware`][jaxmp.fp8.check_hardware]).

    Example:
      >>> import jaxmp.flax
      >>> policy, ov = jaxmp.flax.overrides.resolve_overrides("O2-bf16", None)
      >>> ov.fp32_softmax
      False
    """
    resolved, recipe = resolve_policy(policy)
    if overrides is None:
        overrides = PrecisionOverrides.from_recipe(recipe) if recipe is not None else PrecisionOverrides()
    elif not isinstance(overrides, PrecisionOverrides):
        if isinstance(overrides, (str, tuple, list, frozenset, set)):
            overrides = PrecisionOverrides.from_categories(overrides)
        else:
            raise TypeError(
                f"overrides must be a jaxmp.flax.PrecisionOverrides or keep_fp32 categories, got {type(overrides).__name__}"
            )
    if overrides.fp8 is not None:
        _fp8.check_hardware(overrides.fp8)  # native, emulated on CPU, or a clear error naming the device
    return resolved, overrides
