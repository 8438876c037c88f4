"""Module rules as the engine applies them: `ModuleRule` (how one module runs) and `ModuleRules`.

Both front doors compile their class and path rules (`jaxmp.AutocastRules`) to one `ModuleRules`
(`compile_module_rules`), whose `ModuleRules.rule_at` is the one place a module's rule is decided:
path rules, then the most specific class. `jaxmp.engine._modules` applies them.
See docs/architecture.md#module-rules.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, Sequence

import numpy as np

from jaxmp._precision._policy import Policy

_F32 = np.dtype("float32")
_ACTIONS = ("half", "float32", "policy", "region")


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """How one module runs: the engine's unit of a module-level precision rule.

    Attributes:
      compute_dtype: params and floating inputs are cast to this dtype for the call
        (None for a ``"region"`` rule, which casts nothing and only marks the ops inside).
      param_dtype: the dtype params of this module are stored in (used at init; None: as created).
      output: ``"computed"`` (leave the output as computed), ``"input"`` (cast back to
        the dtype of the first floating input, as float32 norms do) or a dtype.
      action: what the rule does. ``"half"``: cast params and inputs to the policy's compute
        dtype and let the op lists decide (an enclosing ``"float32"`` rule wins);
        ``"float32"``: cast them to float32 and run the ops inside in float32;
        ``"policy"``: run under a per-class policy (its compute dtype, region and output);
        ``"region"``: cast nothing, run the ops inside in ``region``.
      region: the dtype the engine runs the ops inside the call in (``"float32"``, ``"half"``,
        ``"keep"`` or a dtype name); None: the op lists decide. Defaults to the compute dtype
        for ``"float32"`` and ``"policy"`` rules, None for ``"half"`` rules.
    """

    compute_dtype: Any
    param_dtype: Any
    output: Any = "computed"
    action: str = "half"
    region: str | None = None

    def __post_init__(self):
        if self.action not in _ACTIONS:
            raise ValueError(f"ModuleRule.action must be one of {_ACTIONS}, got {self.action!r}")
        if self.action == "region":
            if not isinstance(self.region, str):
                raise TypeError(f"a region ModuleRule needs region= a dtype name, 'half' or 'keep', got {self.region!r}")
            return
        # Normalising our own frozen record once, at construction (never a module of the user's).
        object.__setattr__(self, "compute_dtype", np.dtype(self.compute_dtype))
        if self.param_dtype is not None:
            object.__setattr__(self, "param_dtype", np.dtype(self.param_dtype))
        if self.region is None and self.action in ("float32", "policy"):
            object.__setattr__(self, "region", self.compute_dtype.name)

    @property
    def casts(self) -> bool:
        """Whether the rule casts the call's inputs and the module's params (every action but ``"region"``)."""
        return self.action != "region"


_FLOAT32_RULE = ModuleRule(_F32, _F32, "input", "float32")


@functools.lru_cache(maxsize=256)
def compile_module_rules(class_rules: tuple, path_rules: tuple, policy: Policy | None) -> "ModuleRules":
    """``AutocastRules.module_rules``: class and path rules to `ModuleRules` (see there)."""
    if policy is None:
        if any(isinstance(d, Policy) for _, d in class_rules):
            raise TypeError("a class rule with a jaxmp.Policy is a Flax door rule (it sets how params are stored); "
                            "under jaxmp.autocast give the class a dtype: with_class(cls, 'float32')")
        if path_rules:
            raise ValueError(f"path rules {[p for p, _ in path_rules]} need the Flax door, which knows module paths "
                             "(jaxmp.flax.mixed_precision(model, policy, rules=...)); under jaxmp.autocast use "
                             "with_scope(pattern, dtype) or with_class(cls, dtype)")
        return ModuleRules(classes=tuple((c, ModuleRule(None, None, "computed", "region", region=d))
                                         for c, d in class_rules))
    half = ModuleRule(policy.compute_dtype, policy.param_dtype, "computed", "half")

    def rule(action):
        if isinstance(action, Policy):
            return ModuleRule(action.compute_dtype, action.param_dtype, action.output_dtype, "policy")
        if action == "half":
            return half
        if action == "float32":
            return _FLOAT32_RULE
        return ModuleRule(None, None, "computed", "region", region=action)

    return ModuleRules(classes=tuple((c, rule(d)) for c, d in class_rules),
                       paths=tuple((p, _FLOAT32_RULE) for p, _ in path_rules))


def _path_prefixes(path: Sequence[Any]) -> list[str]:
    names = [str(p) for p in path]
    return ["/".join(names[:k]) for k in range(1, len(names) + 1)] or [""]


@dataclasses.dataclass(frozen=True)
class ModuleRules:
    """Module-level rules, compiled: class rules and path rules (hashable: part of jit keys).

    Attributes:
      classes: ``((module_class, ModuleRule), ...)``; a later entry for the same class wins,
        and for an instance the most specific class of its MRO with a rule decides.
      paths: ``((glob, ModuleRule), ...)``: a module whose path (joined by ``"/"``, relative to
        the wrapped model) or an ancestor's matches the glob (`fnmatch.fnmatchcase`,
        ``*`` also crosses ``/``) takes the first matching rule; path rules beat class rules.
    """

    classes: tuple = ()
    paths: tuple = ()

    def __post_init__(self):
        for cls, rule in self.classes:
            if not isinstance(cls, type) or not isinstance(rule, ModuleRule):
                raise TypeError(f"ModuleRules.classes entries must be (class, ModuleRule) pairs, got {(cls, rule)!r}")
        for pattern, rule in self.paths:
            if not isinstance(pattern, str) or not isinstance(rule, ModuleRule):
                raise TypeError(f"ModuleRules.paths entries must be (glob, ModuleRule) pairs, got {(pattern, rule)!r}")

    def __bool__(self) -> bool:
        return bool(self.classes or self.paths)

    @property
    def _by_class(self) -> dict:
        table = self.__dict__.get("_table")
        if table is None:  # a lookup table, built once per (immutable) instance
            table = dict(self.classes)
            self.__dict__["_table"] = table
        return table

    def rule_for(self, module_or_class: Any) -> ModuleRule | None:
        """The class rule of a module (or class): the most specific class of its MRO with a rule.

        Args:
          module_or_class: a module instance or class.

        Returns:
          A `jaxmp.engine._module_rules.ModuleRule`, or None.
        """
        cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
        table = self._by_class
        for klass in cls.__mro__:
            rule = table.get(klass)
            if rule is not None:
                return rule
        return None

    def rule_at(self, path: Sequence[Any] | None, module_or_class: Any) -> ModuleRule | None:
        """The rule of the module at ``path``: a path rule if one matches, else its class rule.

        Args:
          path: the module path (None where the framework has none: class rules only).
          module_or_class: the module instance or class there.

        Returns:
          A `jaxmp.engine._module_rules.ModuleRule`, or None when the module follows its inputs.
        """
        if path is not None and self.paths:
            for pattern, rule in self.paths:
                if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in _path_prefixes(path)):
                    return rule
        return self.rule_for(module_or_class)
