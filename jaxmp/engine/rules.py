"""The op lists of [`jaxmp.autocast`][jaxmp.autocast] as data: which primitive runs in which dtype.

Three lists, as NVIDIA's AMP and ``torch.autocast`` have them:

* the *half list* runs in the compute dtype (matmuls and convolutions: Tensor Core work);
* the *float32 list* runs in float32 (transcendentals, powers and every reduction: the ops
  whose range or rounding error grows with the size of the data);
* everything else *follows* its inputs under a promotion rule (see [`AutocastRules`][jaxmp.AutocastRules]).

[`AutocastRules`][jaxmp.AutocastRules] is a frozen, hashable record a user can copy and edit; region rules
(``jax.named_scope`` patterns and module classes) live on it too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import Any, Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp import fp8
from jaxmp.dtypes import float_dtype

#: Matmuls and convolutions: cast to the compute dtype (torch: matmul, conv, linear, einsum, baddbmm).
HALF_OPS: frozenset[str] = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

#: Ops that run in float32 whatever their inputs (torch: exp, log, pow, softmax, norms, sums, losses).
FLOAT32_OPS: frozenset[str] = frozenset({
    # transcendentals
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "pow", "integer_pow", "square",
    "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt", "tan", "sinh", "cosh", "asin", "acos",
    "atan", "atan2", "asinh", "acosh", "atanh", "lgamma", "digamma", "igamma", "igammac",
    "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    # reductions (softmax, log_softmax, logsumexp, mean/variance, the loss)
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_window_sum",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
})

#: Dtype-polymorphic ops that follow their inputs (floating operands are promoted to one dtype).
FOLLOW_OPS: frozenset[str] = frozenset({
    "add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min", "floor", "ceil",
    "round", "is_finite", "select_n", "clamp", "tanh", "sin", "cos", "nextafter",
    "reduce_precision", "broadcast_in_dim", "reshape", "transpose", "squeeze", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "copy",
    "stop_gradient", "add_any", "eq", "ne", "lt", "le", "gt", "ge", "argmax", "argmin",
    "reduce_window_max", "reduce_window_min", "top_k", "sharding_constraint", "reshard",
    "split", "tile", "zeros_like", "iota", "select_and_gather_add", "mesh_cast", "pvary",
    "name",  # checkpoint_name: the remat policy saves the value in the dtype it was computed in
})

#: Ops with several independent operands: each keeps its own dtype (nothing is cast).
PASSTHROUGH_OPS: frozenset[str] = frozenset({"sort", "optimization_barrier", "device_put"})

#: Collectives: run as traced (a gradient all-reduce keeps its traced dtype, so a sum over
#: replicas cannot overflow fp16); a float32-list result stays float32-list through them, so a
#: synchronised BatchNorm's ``x - pmean(mean(x))`` centres in float32 as an unsynchronised one does.
COLLECTIVE_OPS: frozenset[str] = frozenset({
    "psum", "pmax", "pmin", "pmean", "all_gather", "all_to_all", "ppermute", "psum_scatter",
    "reduce_scatter", "psum_invariant", "ragged_all_to_all",
})

#: First-order ops that carry a combiner jaxpr traced for their operands' dtypes: they run
#: with the operands in their traced dtypes (like any op without a rule).
COMBINER_OPS: frozenset[str] = frozenset({
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add", "cumred",
    "custom_linear_solve", "argsort",
})

_PROMOTE = ("narrow", "widest", "demand")
_MATMUL_OUT = ("compute", "float32")


@functools.lru_cache(maxsize=1)
def known_primitive_names() -> frozenset[str]:
    """Names of the primitives JAX defines (for validating user edits of the op lists).

    Returns:
      A frozenset of primitive names, e.g. ``"dot_general"``, ``"exp"``.

    Example:
      >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
      >>> "dot_general" in known_primitive_names()
      True
    """
    from jaxmp.engine import internals

    return frozenset(internals.all_primitive_names()
                     | HALF_OPS | FLOAT32_OPS | FOLLOW_OPS | PASSTHROUGH_OPS | COMBINER_OPS | COLLECTIVE_OPS)


def _op_set(ops: Iterable[str], where: str) -> frozenset[str]:
    if isinstance(ops, str):
        ops = (ops,)
    out = set()
    ours = HALF_OPS | FLOAT32_OPS | FOLLOW_OPS | PASSTHROUGH_OPS | COMBINER_OPS
    for op in ops:
        if not isinstance(op, str):
            raise TypeError(f"{where}: op names must be strings (primitive names such as 'exp'), got {op!r}")
        # Walking JAX's modules for every primitive takes a while: only for names we do not list.
        if op not in ours and op not in (known := known_primitive_names()):
            close = [k for k in sorted(known) if k.startswith(op[:3])][:5]
            raise ValueError(f"{where}: unknown op {op!r}; it is not a JAX primitive name"
                             + (f" (did you mean one of {close}?)" if close else ""))
        out.add(op)
    return frozenset(out)


def _region_dtype(dtype: Any, where: str) -> str:
    """A region dtype: ``"float32"``/``"half"``/``"keep"`` or a floating dtype name."""
    if isinstance(dtype, str) and dtype in ("half", "keep"):
        return dtype
    try:
        return np.dtype(float_dtype(dtype, where)).name
    except TypeError as e:
        raise TypeError(f"{where}: a region dtype must be a floating dtype, 'half' or 'keep', got {dtype!r}") from e


def _module_class(cls: Any, where: str) -> type:
    if not isinstance(cls, type):
        raise TypeError(f"{where}: expected a module class (e.g. flax.linen.LayerNorm, equinox.nn.LayerNorm), "
                        f"got {type(cls).__name__}: {cls!r}")
    return cls


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """What [`jaxmp.autocast`][jaxmp.autocast] does with each op: three op lists, promotion, regions.

    Instances are frozen and hashable; edit them with the ``with_*`` methods, which return
    copies. The default lists are `HALF_OPS`, `FLOAT32_OPS` and the ops that follow.

    **Promotion** (``promote``) decides the dtype of an op that follows its inputs when their
    floating dtypes differ:

    * ``"demand"`` (default; O1): a float32 value meeting a half one computes in float32 where
      float32 is needed: where the result flows, through ops that follow, into a float32-list
      op, an output or loop carry, or an op the rules do not type. Otherwise (the result only
      feeds matmuls) it is narrowed. A bias add feeding a layer norm or the logits is float32.
    * ``"narrow"`` (O2): a float32 *input or constant* meeting a half value takes the half
      dtype (a bias add after a bf16 matmul stays bf16).
    * ``"widest"``: ``torch.autocast``'s rule for every op, the widest input wins.

    Under each, the *result of a float32-list op* stays float32 and promotes what it meets
    (``x - mean(x)`` of a layer norm runs in float32), and Python scalars and plain float32
    scalars never decide. docs/autocast.md has the measured cost of each rule.

    Attributes:
      half_ops: primitive names run in the compute dtype.
      float32_ops: primitive names run in float32.
      promote: ``"demand"``, ``"narrow"`` or ``"widest"``.
      matmul_output: ``"compute"`` (half-list ops return the compute dtype) or ``"float32"``
        (they return float32 via ``preferred_element_type``); GPUs and TPUs accumulate in
        float32 either way.
      scope_rules: ``((pattern, dtype), ...)``: ops under a ``jax.named_scope`` whose name
        matches the glob ``pattern`` run in ``dtype`` (``"float32"``, ``"half"``, a dtype, or
        ``"keep"``: as traced).
      fp8_matmuls: a [`jaxmp.fp8.CurrentScaling`][jaxmp.fp8.CurrentScaling] recipe, or None: half-list
        ``dot_general`` ops become scaled fp8 dots (E4M3 operands, E5M2 cotangents;
        [`jaxmp.fp8.fp8_dot_general`][jaxmp.fp8.fp8_dot_general]). Delayed scaling needs state across steps, which
        autocast's functional form has none of: it is refused.
      class_rules: ``((module_class, dtype), ...)``: ops inside calls of instances of that
        class (Flax Linen / NNX, Equinox, Haiku; subclasses too) run in ``dtype``.

    Example:
      >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
      >>> rules = jaxmp.AutocastRules().with_float32("tanh").with_class(flax.linen.LayerNorm, "float32")
      >>> "tanh" in rules.float32_ops
      True
    """

    half_ops: frozenset[str] = HALF_OPS
    float32_ops: frozenset[str] = FLOAT32_OPS
    promote: str = "demand"
    matmul_output: str = "compute"
    scope_rules: tuple[tuple[str, str], ...] = ()
    class_rules: tuple[tuple[type, str], ...] = ()
    fp8_matmuls: fp8.CurrentScaling | None = None

    def __post_init__(self):
        if isinstance(self.fp8_matmuls, fp8.DelayedScaling):
            raise ValueError("AutocastRules.fp8_matmuls: delayed scaling keeps amax histories across steps, "
                             "which autocast's functional form has no state for; use fp8.CurrentScaling()")
        if self.fp8_matmuls is not None and not isinstance(self.fp8_matmuls, fp8.CurrentScaling):
            raise TypeError(f"AutocastRules.fp8_matmuls must be a jaxmp.fp8.CurrentScaling or None, "
                            f"got {type(self.fp8_matmuls).__name__}")
        half = _op_set(self.half_ops, "AutocastRules.half_ops")
        fp32 = _op_set(self.float32_ops, "AutocastRules.float32_ops")
        if half & fp32:
            raise ValueError(f"ops {sorted(half & fp32)} are in both half_ops and float32_ops; pick one")
        if self.promote not in _PROMOTE:
            raise ValueError(f"AutocastRules.promote must be one of {_PROMOTE}, got {self.promote!r}")
        if self.matmul_output not in _MATMUL_OUT:
            raise ValueError(f"AutocastRules.matmul_output must be one of {_MATMUL_OUT}, got {self.matmul_output!r}")
        scopes = []
        for item in self.scope_rules:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"scope_rules entries must be (pattern string, dtype) pairs, got {item!r}")
            scopes.append((item[0], _region_dtype(item[1], f"scope rule {item[0]!r}")))
        classes = []
        for item in self.class_rules:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"class_rules entries must be (module class, dtype) pairs, got {item!r}")
            cls = _module_class(item[0], "AutocastRules.class_rules")
            classes = [(c, d) for c, d in classes if c is not cls]
            classes.append((cls, _region_dtype(item[1], f"class rule {cls.__name__}")))
        object.__setattr__(self, "half_ops", half)
        object.__setattr__(self, "float32_ops", fp32)
        object.__setattr__(self, "scope_rules", tuple(scopes))
        object.__setattr__(self, "class_rules", tuple(classes))

    # -- copies ---------------------------------------------------------------------------

    def with_half(self, *ops: str) -> "AutocastRules":
        """Copy with ``ops`` moved to the half list (and off the float32 list).

        Args:
          *ops: primitive names, e.g. ``"dot_general"``.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
          >>> "tanh" in jaxmp.AutocastRules().with_half("tanh").half_ops
          True
        """
        ops_ = _op_set(ops, "with_half")
        return dataclasses.replace(self, half_ops=self.half_ops | ops_, float32_ops=self.float32_ops - ops_)

    def with_float32(self, *ops: str) -> "AutocastRules":
        """Copy with ``ops`` moved to the float32 list (and off the half list).

        Args:
          *ops: primitive names, e.g. ``"tanh"``.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
          >>> "dot_general" in jaxmp.AutocastRules().with_float32("dot_general").float32_ops
          True
        """
        ops_ = _op_set(ops, "with_float32")
        return dataclasses.replace(self, float32_ops=self.float32_ops | ops_, half_ops=self.half_ops - ops_)

    def with_follow(self, *ops: str) -> "AutocastRules":
        """Copy with ``ops`` taken off both lists: they follow their inputs.

        Args:
          *ops: primitive names.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
          >>> "reduce_max" in jaxmp.AutocastRules().with_follow("reduce_max").float32_ops
          False
        """
        ops_ = _op_set(ops, "with_follow")
        return dataclasses.replace(self, float32_ops=self.float32_ops - ops_, half_ops=self.half_ops - ops_)

    def with_scope(self, pattern: str, dtype: DTypeLike) -> "AutocastRules":
        """Copy where ops under a ``jax.named_scope`` matching the glob ``pattern`` run in ``dtype``.

        The pattern is matched against each component of the name stack (``"attn*"``
        matches the scope ``attn_0``); the innermost matching scope wins.

        Args:
          pattern: a glob such as ``"*norm*"``.
          dtype: ``"float32"``, ``"half"``, ``"keep"`` or a floating dtype.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
          >>> jaxmp.AutocastRules().with_scope("head", "float32").scope_rules
          (('head', 'float32'),)
        """
        return dataclasses.replace(self, scope_rules=self.scope_rules + ((pattern, dtype),))

    def with_class(self, cls: type, dtype: DTypeLike) -> "AutocastRules":
        """Copy where every call of a module of class ``cls`` (or a subclass) runs in ``dtype``.

        Works for Flax Linen and NNX, Equinox and Haiku modules, whatever the instance is called.

        Args:
          cls: the module class, e.g. ``flax.linen.LayerNorm``.
          dtype: ``"float32"``, ``"half"``, ``"keep"`` or a floating dtype.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
          >>> jaxmp.AutocastRules().with_class(flax.linen.LayerNorm, "float32").class_rules[0][1]
          'float32'
        """
        return dataclasses.replace(self, class_rules=self.class_rules + ((cls, dtype),))

    def scope_dtype(self, component: str) -> str | None:
        """The region dtype a scope rule gives a name-stack component, or None."""
        for pattern, dtype in reversed(self.scope_rules):
            if fnmatch.fnmatchcase(component, pattern):
                return dtype
        return None


#: The rules of O3: pure half precision, nothing kept in float32.
PURE_HALF_RULES = AutocastRules(float32_ops=frozenset(), promote="narrow")

#: Marker scopes the engine reads: ``jaxmp[float32]``, ``jaxmp[half]``, ``jaxmp[keep]`` (+ ``:label``).
MARKER = re.compile(r"^jaxmp\[(?P<dtype>[a-z0-9]+)\](?::.*)?$")


def marker(dtype: str, label: str = "") -> str:
    """The ``jax.named_scope`` name that marks a region of ``dtype`` for the engine.

    Args:
      dtype: ``"float32"``, ``"half"``, ``"keep"`` or a floating dtype name.
      label: text shown after the marker in profiles (e.g. the module class).

    Returns:
      The scope name, e.g. ``"jaxmp[float32]:LayerNorm"``.

    Example:
      >>> import flax.linen, jaxmp; from jaxmp.engine.rules import known_primitive_names, marker
      >>> marker("float32", "LayerNorm")
      'jaxmp[float32]:LayerNorm'
    """
    return f"jaxmp[{dtype}]" + (f":{label}" if label else "")


def is_float32(dtype: Any) -> bool:
    """Whether ``dtype`` is float32 (the dtype the float32 list computes in)."""
    return np.dtype(dtype) == np.dtype(jnp.float32)


# -- module rules ------------------------------------------------------------------------------

_F32 = np.dtype("float32")
_KINDS = ("half", "fp32", "policy", "region")


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """How one module runs: the engine's unit of a module-level precision rule.

    Attributes:
      compute_dtype: params and floating inputs are cast to this dtype for the call
        (None for a ``"region"`` rule, which casts nothing and only marks the ops inside).
      param_dtype: the dtype params of this module are stored in (used at init; None: as created).
      output: ``"computed"`` (leave the output as computed), ``"input"`` (cast back to
        the dtype of the first floating input, as float32 norms do) or a dtype.
      kind: ``"half"``, ``"fp32"``, ``"policy"`` (the Flax front door's half list, float32
        list and per-class policies) or ``"region"`` (an ``AutocastRules`` class rule).
      region: the dtype the engine runs the ops inside the call in (``"float32"``, ``"half"``,
        ``"keep"`` or a dtype name); None: the op lists decide. Defaults to the compute dtype
        for ``"fp32"`` and ``"policy"`` rules, None for ``"half"`` rules.

    Example:
      >>> import numpy as np
      >>> from jaxmp.engine.rules import ModuleRule
      >>> ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32").region
      'float32'
    """

    compute_dtype: Any
    param_dtype: Any
    output: Any = "computed"
    kind: str = "half"
    region: str | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"ModuleRule.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "region":
            if not isinstance(self.region, str):
                raise TypeError(f"a region ModuleRule needs region= a dtype name, 'half' or 'keep', got {self.region!r}")
            return
        # Normalising our own frozen record once, at construction (never a module of the user's).
        object.__setattr__(self, "compute_dtype", np.dtype(self.compute_dtype))
        if self.param_dtype is not None:
            object.__setattr__(self, "param_dtype", np.dtype(self.param_dtype))
        if self.region is None and self.kind in ("fp32", "policy"):
            object.__setattr__(self, "region", self.compute_dtype.name)

    @property
    def casts(self) -> bool:
        """Whether the rule casts the call's inputs and the module's params (every kind but ``"region"``)."""
        return self.kind != "region"


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

    Example:
      >>> import numpy as np
      >>> from jaxmp.engine.rules import ModuleRule, ModuleRules
      >>> class Norm: pass
      >>> class MyNorm(Norm): pass
      >>> f32 = ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32")
      >>> rules = ModuleRules(classes=((Norm, f32),), paths=(("head", f32),))
      >>> rules.rule_at(("x",), MyNorm()).kind, rules.rule_at(("head", "Dense_0"), object) is f32
      ('fp32', True)
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

    def path_match(self, path: Sequence[Any]) -> str | None:
        """The first path glob matching ``path`` or one of its ancestors, or None.

        Args:
          path: the module path (a tuple of names; ``()`` is the wrapped model itself).

        Returns:
          The matching glob, or None.

        Example:
          >>> import numpy as np
          >>> from jaxmp.engine.rules import ModuleRule, ModuleRules
          >>> f32 = ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32")
          >>> ModuleRules(paths=(("dec*", f32),)).path_match(("decoder", "Dense_0"))
          'dec*'
        """
        if not self.paths:
            return None
        prefixes = _path_prefixes(path)
        for pattern, _ in self.paths:
            if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
                return pattern
        return None

    def rule_for(self, module_or_class: Any) -> ModuleRule | None:
        """The class rule of a module (or class): the most specific class of its MRO with a rule.

        Args:
          module_or_class: a module instance or class.

        Returns:
          A `jaxmp.engine.rules.ModuleRule`, or None.

        Example:
          >>> import numpy as np
          >>> from jaxmp.engine.rules import ModuleRule, ModuleRules
          >>> rules = ModuleRules(classes=((int, ModuleRule(None, None, kind="region", region="float32")),))
          >>> rules.rule_for(True).region, rules.rule_for(1.0)
          ('float32', None)
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
          A `jaxmp.engine.rules.ModuleRule`, or None when the module follows its inputs.

        Example:
          >>> import numpy as np
          >>> from jaxmp.engine.rules import ModuleRule, ModuleRules
          >>> f32 = ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32")
          >>> ModuleRules(paths=(("head", f32),)).rule_at(("head",), object).kind
          'fp32'
        """
        if path is not None and self.paths:
            for pattern, rule in self.paths:
                if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in _path_prefixes(path)):
                    return rule
        return self.rule_for(module_or_class)

    @classmethod
    def from_class_rules(cls, class_rules: Sequence[tuple[type, str]]) -> "ModuleRules":
        """Region rules from ``AutocastRules.class_rules`` (``((cls, dtype), ...)``).

        Args:
          class_rules: ``((module_class, dtype), ...)`` with dtype ``"float32"``, ``"half"``,
            ``"keep"`` or a dtype name.

        Returns:
          The compiled `ModuleRules`.

        Example:
          >>> import flax.linen as nn
          >>> from jaxmp.engine.rules import ModuleRules
          >>> ModuleRules.from_class_rules(((nn.LayerNorm, "float32"),)).rule_for(nn.LayerNorm).region
          'float32'
        """
        return cls(classes=tuple((c, ModuleRule(None, None, "computed", "region", region=d)) for c, d in class_rules))
