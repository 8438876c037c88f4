"""The op lists of [`jaxmp.autocast`][jaxmp.autocast] as data: which primitive runs in which dtype.

Three lists, as NVIDIA's AMP and ``torch.autocast`` have them:

* the *half list* runs in the compute dtype (matmuls and convolutions: Tensor Core work);
* the *float32 list* runs in float32 (transcendentals, powers and every reduction: the ops
  whose range or rounding error grows with the size of the data);
* everything else *follows* its inputs under a promotion rule (see [`AutocastRules`][jaxmp.AutocastRules]).

[`AutocastRules`][jaxmp.AutocastRules] is a frozen, hashable record a user can copy and edit, the one rule
vocabulary of both front doors (``jaxmp.autocast(..., rules=)`` and ``jaxmp.flax.mixed_precision(...,
rules=)``): the op lists, and scope, class and path rules that each say what they do (``"half"``,
``"float32"``, ``"keep"``, a dtype; ``"follow"`` takes a class rule off).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import Any, Iterable, Sequence

import numpy as np
from jax.typing import DTypeLike

from jaxmp import _ops, fp8
from jaxmp._dtypes import float_dtype
from jaxmp._precision._policy import Policy
from jaxmp.engine._module_rules import ModuleRules, compile_module_rules

# The lists are read from the one op catalogue (jaxmp/_ops.py): a row there per primitive.

#: Matmuls and convolutions: cast to the compute dtype (torch: matmul, conv, linear, einsum, baddbmm).
HALF_OPS: frozenset[str] = _ops.of_class("half")

#: Ops that run in float32 whatever their inputs (torch: exp, log, pow, softmax, norms, sums, losses):
#: transcendentals, powers and every reduction (softmax, log_softmax, logsumexp, mean/variance, the loss).
FLOAT32_OPS: frozenset[str] = _ops.of_class("float32")

#: Dtype-polymorphic ops that follow their inputs (floating operands are promoted to one dtype).
FOLLOW_OPS: frozenset[str] = _ops.of_class("follow")

#: Ops with several independent operands: each keeps its own dtype (nothing is cast).
PASSTHROUGH_OPS: frozenset[str] = _ops.of_class("passthrough")

#: Collectives: run as traced (a gradient all-reduce keeps its traced dtype, so a sum over
#: replicas cannot overflow fp16); a float32-list result stays float32-list through them, so a
#: synchronised BatchNorm's ``x - pmean(mean(x))`` centres in float32 as an unsynchronised one does.
COLLECTIVE_OPS: frozenset[str] = _ops.of_class("collective")

#: First-order ops that carry a combiner jaxpr traced for their operands' dtypes: they run
#: with the operands in their traced dtypes (like any op without a rule).
COMBINER_OPS: frozenset[str] = _ops.of_class("combiner")

_PROMOTE = ("narrow", "widest", "demand")
_MATMUL_OUT = ("compute", "float32")


@functools.lru_cache(maxsize=1)
def known_primitive_names() -> frozenset[str]:
    """Names of the primitives JAX defines (for validating user edits of the op lists).

    Returns:
      A frozenset of primitive names, e.g. ``"dot_general"``, ``"exp"``.
    """
    from jaxmp.engine import _internals as internals

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
    if isinstance(cls, type):
        return cls
    if isinstance(cls, str):
        hint = f"the string {cls!r}; pass the class itself, e.g. flax.linen.{cls}"
    elif type(cls).__module__ != "builtins":
        hint = f"an instance; pass its class, type(x) = {type(cls).__name__}"
    else:
        hint = f"{type(cls).__name__}: {cls!r}"
    raise TypeError(f"{where}: expected a module class (e.g. flax.linen.LayerNorm, equinox.nn.LayerNorm), got {hint}")


def _class_action(action: Any, where: str) -> Any:
    """A class rule's action: a region dtype, ``"follow"``, or a per-class `jaxmp.Policy` (Flax door)."""
    if isinstance(action, str) and action == "follow":
        return action
    if not isinstance(action, str) and all(hasattr(action, f) for f in ("param_dtype", "compute_dtype",
                                                                          "output_dtype")):
        return action if isinstance(action, Policy) else Policy(action.param_dtype, action.compute_dtype,
                                                                action.output_dtype)
    return _region_dtype(action, where)


def matmul_format(value: Any) -> tuple[bool, Any]:
    """Whether ``value`` names a matmul format, and its fp8 recipe (None: the compute dtype, no fp8).

    A format is a `jaxmp.fp8` recipe, or the name of a mixed-precision preset ("O2-nvfp4",
    "O2-mxfp8", "O2-fp8-current": its recipe; "O2-bf16", "O1": none, the matmuls in the compute
    dtype). Region dtypes (``"float32"``, ``"half"``, ``"bfloat16"``...) are no format.
    """
    if isinstance(value, fp8.Fp8Recipe):
        return True, value
    if isinstance(value, str) and value[:2] in ("O1", "O2", "O3"):
        from jaxmp._precision._presets import get_recipe

        return True, get_recipe(value).fp8
    return False, None


def _format_spec(value: Any, where: str) -> Any:
    """``value`` checked as a matmul format (kept as given: a preset name stays a name, for code)."""
    if isinstance(value, fp8.DelayedScaling):
        raise ValueError(f"{where}: a per-module format takes current scaling (fp8.CurrentScaling, or a preset such "
                         f"as 'O2-mxfp8'); delayed scaling keeps amax histories for the whole model "
                         f"(AutocastRules(fp8_matmuls=...) under the Flax door)")
    ok, _ = matmul_format(value)
    if not ok:
        raise TypeError(f"{where}: expected a matmul format (a jaxmp.fp8 recipe or a preset name such as 'O2-nvfp4', "
                        f"'O2-mxfp8', 'O2-bf16'), got {value!r}")
    return value


def _path_pattern(pattern: Any, where: str) -> str:
    """Returns ``pattern`` if it is a valid module-path glob, else raises naming ``where``."""
    if isinstance(pattern, (tuple, list)) and pattern and all(isinstance(p, (str, int)) for p in pattern):
        joined = "/".join(str(p) for p in pattern)
        raise TypeError(f"{where}: a module path is one string joined by '/', got the sequence {pattern!r}; "
                        f"pass {joined!r}")
    if isinstance(pattern, type):
        raise TypeError(f"{where}: expected a module path such as 'decoder/head' (a glob on the path joined by '/'), "
                        f"got the class {pattern.__name__}; for a whole class use "
                        f"with_class({pattern.__name__}, 'float32')")
    if not isinstance(pattern, str):
        raise TypeError(f"{where}: expected a module path string such as 'decoder/head', "
                        f"got {type(pattern).__name__}: {pattern!r}")
    if not pattern.strip():
        raise ValueError(f"{where}: empty module path {pattern!r}; the model itself has no path, so keep its class "
                         "in float32 with with_class(cls, 'float32')")
    if pattern != pattern.strip():
        raise ValueError(f"{where}: module path {pattern!r} has leading or trailing whitespace")
    if pattern.startswith("/") or pattern.endswith("/") or "//" in pattern:
        raise ValueError(f"{where}: module path {pattern!r} has an empty component; paths are relative to the "
                         "wrapped model and joined by single '/', e.g. 'decoder/head' or '*/logits'")
    return pattern


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """What each op and module runs in: the one rule object of ``jaxmp.autocast`` and the Flax door.

    Instances are frozen and hashable; edit them with the ``with_*`` methods, which return
    copies. The default lists are `HALF_OPS`, `FLOAT32_OPS` and the ops that follow. Both front
    doors take it (``rules=``); [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] gives the Flax door's per-preset
    starting point (matmul layers ``"half"``, norm layers ``"float32"``).

    ``promote`` decides an op that follows inputs of different floating dtypes: ``"demand"``
    (O1: float32 where a float32 value is needed downstream), ``"narrow"`` (O2 and O3: half wins)
    or ``"widest"`` (``torch.autocast``'s rule); None (the default) takes the preset's, so passing
    rules never changes a preset's promotion. See docs/autocast.md#the-promotion-rule-ops-that-follow.

    Attributes:
      half_ops: primitive names run in the compute dtype.
      float32_ops: primitive names run in float32.
      promote: ``"demand"``, ``"narrow"``, ``"widest"``, or None: the preset's (O1 ``"demand"``,
        O2 and O3 ``"narrow"``), resolved when autocast or the Flax door reads the rules.
      matmul_output: ``"compute"`` (half-list ops return the compute dtype) or ``"float32"``
        (they return float32 via ``preferred_element_type``); GPUs and TPUs accumulate in
        float32 either way.
      scope_rules: ``((pattern, dtype), ...)``: ops under a ``jax.named_scope`` whose name
        matches the glob ``pattern`` run in ``dtype`` (``"float32"``, ``"half"``, a dtype, or
        ``"keep"``: as traced).
      class_rules: ``((module_class, dtype), ...)``: calls of instances of that class (and
        subclasses) run in ``dtype``; the Flax door also casts the layer's params and inputs, and
        takes a [`jaxmp.Policy`][jaxmp.Policy] as the dtype. ``"follow"`` for a class with no
        earlier rule here stays listed, to take the preset's rule off when these rules are merged
        onto the Flax door's preset rules; it marks nothing itself.
      path_rules: ``((glob, "float32"), ...)`` (Flax door): the module at a matching path and
        everything under it run in float32; beats class rules.
      fp8_matmuls: None or a `jaxmp.fp8` recipe for the half-list matmuls (autocast takes
        ``CurrentScaling`` only; the Flax door takes both).
      matmul_formats: ``((kind, key, format), ...)``, ``kind`` one of ``"scope"`` (``key`` a
        scope pattern, as ``scope_rules``), ``"path"`` (a module path glob, Flax door) or
        ``"class"`` (a module class, Flax door): the half-list matmuls of that module run in
        ``format`` (a `jaxmp.fp8` recipe or a preset name: ``"O2-nvfp4"``, ``"O2-mxfp8"``,
        ``"O2-bf16"`` for none), the innermost (scope) or first (path, then class) rule winning
        over ``fp8_matmuls``. Set with ``with_scope``/``with_path``/``with_class`` given a format.
      float32_loss: the Flax door's train steps compute the loss on float32 logits.
      fused_attention: the Flax door runs attention modules with Flax's default attention
        through [`jaxmp.flax.fused_attention`][jaxmp.flax.fused_attention] (cuDNN on GPUs, a float32 softmax elsewhere).

    Example:
      >>> import flax.linen, jaxmp
      >>> rules = (jaxmp.AutocastRules().with_float32("tanh")
      ...          .with_class(flax.linen.LayerNorm, "float32"))
      >>> "tanh" in rules.float32_ops
      True
    """

    half_ops: frozenset[str] = HALF_OPS
    float32_ops: frozenset[str] = FLOAT32_OPS
    promote: str | None = None
    matmul_output: str = "compute"
    scope_rules: tuple[tuple[str, str], ...] = ()
    class_rules: tuple[tuple[type, Any], ...] = ()
    fp8_matmuls: fp8.Fp8Recipe | None = None
    path_rules: tuple[tuple[str, str], ...] = ()
    matmul_formats: tuple[tuple[str, Any, Any], ...] = ()
    float32_loss: bool = True
    fused_attention: bool = True
    # True for a whole rule set (jaxmp.flax.default_rules and what is built from it): the Flax
    # door uses it as given; other rules are edits merged onto the preset's. Not part of equality.
    _complete: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self):
        if self.fp8_matmuls is not None and not isinstance(self.fp8_matmuls, fp8.Fp8Recipe):
            raise TypeError(f"AutocastRules.fp8_matmuls must be a jaxmp.fp8.CurrentScaling / DelayedScaling recipe "
                            f"or None, got {type(self.fp8_matmuls).__name__}: {self.fp8_matmuls!r}")
        half = _op_set(self.half_ops, "AutocastRules.half_ops")
        f32 = _op_set(self.float32_ops, "AutocastRules.float32_ops")
        if half & f32:
            raise ValueError(f"ops {sorted(half & f32)} are in both half_ops and float32_ops; pick one")
        if self.promote is not None and self.promote not in _PROMOTE:
            raise ValueError(f"AutocastRules.promote must be one of {_PROMOTE} or None (the preset's), "
                             f"got {self.promote!r}")
        if self.matmul_output not in _MATMUL_OUT:
            raise ValueError(f"AutocastRules.matmul_output must be one of {_MATMUL_OUT}, got {self.matmul_output!r}")
        for name in ("float32_loss", "fused_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"AutocastRules.{name} must be a bool, got {getattr(self, name)!r}")
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
            action = _class_action(item[1], f"class rule {cls.__name__}")
            # A later rule for the same class replaces the earlier one; "follow" only removes it (and
            # stays listed where there was none, to remove the preset's rule when merged onto it).
            earlier = any(c is cls for c, _ in classes)
            classes = [(c, d) for c, d in classes if c is not cls]
            if not (action == "follow" and earlier):
                classes.append((cls, action))
        paths: list[tuple[str, str]] = []
        for item in self.path_rules:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"path_rules entries must be (module path glob, 'float32') pairs, got {item!r}")
            pattern = _path_pattern(item[0], "AutocastRules.path_rules")
            if _region_dtype(item[1], f"path rule {pattern!r}") != "float32":
                raise ValueError(f"path rule {pattern!r}: a path rule keeps a layer in 'float32' (the Flax door's "
                                 f"per-layer opt-out), got {item[1]!r}; for other dtypes use with_class or with_scope")
            if pattern not in [p for p, _ in paths]:
                paths.append((pattern, "float32"))
        formats = []
        for item in self.matmul_formats:
            if not (isinstance(item, tuple) and len(item) == 3 and item[0] in ("scope", "path", "class")):
                raise TypeError(f"matmul_formats entries must be ('scope' | 'path' | 'class', key, format) triples, "
                                f"got {item!r}")
            kind, key, value = item
            if kind == "class":
                key = _module_class(key, "AutocastRules.matmul_formats")
            elif kind == "path":
                key = _path_pattern(key, "AutocastRules.matmul_formats")
            elif not isinstance(key, str) or not key:
                raise TypeError(f"a scope format's pattern must be a non-empty string, got {key!r}")
            formats = [f for f in formats if not (f[0] == kind and f[1] == key)]  # a later rule replaces
            formats.append((kind, key, _format_spec(value, f"{kind} format {key!r}")))
        object.__setattr__(self, "matmul_formats", tuple(formats))
        object.__setattr__(self, "half_ops", half)
        object.__setattr__(self, "float32_ops", f32)
        object.__setattr__(self, "scope_rules", tuple(scopes))
        object.__setattr__(self, "class_rules", tuple(classes))
        object.__setattr__(self, "path_rules", tuple(paths))

    # -- copies ---------------------------------------------------------------------------

    def with_half(self, *ops: str) -> "AutocastRules":
        """Copy with ``ops`` moved to the half list (and off the float32 list).

        Args:
          *ops: primitive names, e.g. ``"dot_general"``.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import jaxmp
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
          >>> import jaxmp
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
          >>> import jaxmp
          >>> "reduce_max" in jaxmp.AutocastRules().with_follow("reduce_max").float32_ops
          False
        """
        ops_ = _op_set(ops, "with_follow")
        return dataclasses.replace(self, float32_ops=self.float32_ops - ops_, half_ops=self.half_ops - ops_)

    def with_scope(self, pattern: str, dtype: DTypeLike) -> "AutocastRules":
        """Copy where ops under a ``jax.named_scope`` matching the glob ``pattern`` run in ``dtype``.

        The pattern is matched against each component of the name stack (``"attn*"``
        matches the scope ``attn_0``); the innermost matching scope wins. A pattern with
        ``/`` matches that many nested scopes, ending at one (``"block_1/Dense_0"`` is the
        ``Dense_0`` inside ``block_1``, not the one inside ``block_0``): a module path.

        Args:
        Given a matmul format instead of a dtype (a `jaxmp.fp8` recipe, or a preset name:
        ``"O2-nvfp4"``, ``"O2-mxfp8"``, ``"O2-bf16"`` for no fp8), the scope's half-list matmuls
        run in that format and its other ops as the op lists say: NVFP4 here, MXFP8 there, bf16
        elsewhere (see docs/precision-search.md).

        Args:
          pattern: a glob such as ``"*norm*"``, or a path of scopes such as ``"block_1/Dense_0"``.
          dtype: ``"float32"``, ``"half"``, ``"keep"`` or a floating dtype; or a matmul format.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import jaxmp
          >>> jaxmp.AutocastRules().with_scope("head", "float32").scope_rules
          (('head', 'float32'),)
          >>> jaxmp.AutocastRules().with_scope("mlp", "O2-nvfp4").matmul_formats
          (('scope', 'mlp', 'O2-nvfp4'),)
        """
        if matmul_format(dtype)[0]:
            return dataclasses.replace(self, matmul_formats=self.matmul_formats + (("scope", pattern, dtype),))
        return dataclasses.replace(self, scope_rules=self.scope_rules + ((pattern, dtype),))

    def with_class(self, cls: type, dtype: DTypeLike | Policy) -> "AutocastRules":
        """Copy where every call of a module of class ``cls`` (or a subclass) runs in ``dtype``.

        Flax Linen and NNX, Equinox and Haiku modules. A later rule for the same class replaces
        an earlier one; ``"follow"`` takes the class's rule off.

        Args:
          cls: the module class, e.g. ``flax.linen.LayerNorm``.
          dtype: ``"float32"``, ``"half"``, ``"keep"``, a floating dtype, ``"follow"``, or (Flax
            door) a [`jaxmp.Policy`][jaxmp.Policy] the class runs under, or (Flax door) a matmul
            format (a `jaxmp.fp8` recipe or a preset name such as ``"O2-mxfp8"``) for its matmuls.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Example:
          >>> import flax.linen, jaxmp
          >>> jaxmp.AutocastRules().with_class(flax.linen.LayerNorm, "float32").class_rules[0][1]
          'float32'
        """
        if matmul_format(dtype)[0]:
            return dataclasses.replace(self, matmul_formats=self.matmul_formats + (("class", cls, dtype),))
        return dataclasses.replace(self, class_rules=self.class_rules + ((cls, dtype),))

    def with_path(self, pattern: str, dtype: DTypeLike = "float32") -> "AutocastRules":
        """Copy where the module at ``pattern`` (and everything under it) runs in float32 (Flax door).

        ``pattern`` is a glob (``*`` crosses ``/`` too) on the module path joined by ``"/"``,
        relative to the wrapped model (Linen ``"decoder/head"``, NNX ``"layers/2"``); a path rule
        beats class rules. See docs/guides/flax-linen.md#choosing-what-runs-in-float32.

        Args:
          pattern: a module path or glob, e.g. ``"decoder/head"``, ``"*/logits"``.
          dtype: ``"float32"`` (the one dtype a path rule takes), or a matmul format (a
            `jaxmp.fp8` recipe or a preset name such as ``"O2-nvfp4"``) for the module's matmuls.

        Returns:
          A new [`AutocastRules`][jaxmp.AutocastRules].

        Raises:
          TypeError: ``pattern`` is not a string (a tuple path, a module class).
          ValueError: an empty pattern or component (``"a//b"``), or another dtype.

        Example:
          >>> import jaxmp
          >>> jaxmp.AutocastRules().with_path("decoder/head", "float32").path_rules
          (('decoder/head', 'float32'),)
        """
        if matmul_format(dtype)[0]:
            return dataclasses.replace(self, matmul_formats=self.matmul_formats + (("path", pattern, dtype),))
        return dataclasses.replace(self, path_rules=self.path_rules + ((pattern, dtype),))

    def scope_dtype(self, component: str, outer: tuple[str, ...] = ()) -> str | None:
        """The region dtype a scope rule gives a name-stack component, or None.

        Args:
          component: the scope's name.
          outer: the names of the scopes around it, outermost first (a ``/`` pattern matches
            the innermost of them joined with ``component``).

        Returns:
          The dtype of the last matching rule, or None.
        """
        for pattern, dtype in reversed(self.scope_rules):
            if scope_matches(pattern, component, outer):
                return dtype
        return None

    def scope_format(self, component: str, outer: tuple[str, ...] = ()) -> tuple[bool, Any]:
        """Whether a scope format rule matches a name-stack component, and its recipe (None: no fp8).

        Args:
          component: the scope's name.
          outer: the names of the scopes around it, outermost first.

        Returns:
          ``(matched, recipe)``: the last matching scope format's fp8 recipe (None for a format
          without fp8, such as ``"O2-bf16"``); ``(False, None)`` when none matches.
        """
        for kind, pattern, value in reversed(self.matmul_formats):
            if kind == "scope" and scope_matches(pattern, component, outer):
                return True, matmul_format(value)[1]
        return False, None

    def module_format(self, path: "Sequence[str | int] | None", module: object) -> "fp8.Fp8Recipe | None":
        """The fp8 recipe the matmuls of the module at ``path`` run (Flax door): a path format
        matching it or an ancestor, else its class's (the most specific), else ``fp8_matmuls``.

        Args:
          path: the module path (a sequence of names), or None.
          module: the module instance (or class).

        Returns:
          A `jaxmp.fp8` recipe, or None (the compute dtype, no fp8).
        """
        if path is not None:
            names = [str(p) for p in path]
            prefixes = ["/".join(names[:k]) for k in range(1, len(names) + 1)]
            for kind, pattern, value in self.matmul_formats:
                if kind == "path" and any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
                    return matmul_format(value)[1]
        cls = module if isinstance(module, type) else type(module)
        by_class = {key: value for kind, key, value in self.matmul_formats if kind == "class"}
        for klass in cls.__mro__:
            if klass in by_class:
                return matmul_format(by_class[klass])[1]
        return self.fp8_matmuls

    def format_recipes(self) -> tuple:
        """Every fp8 recipe these rules run (``fp8_matmuls`` and the per-module formats'), once each."""
        found = [self.fp8_matmuls] + [matmul_format(v)[1] for _, _, v in self.matmul_formats]
        return tuple(dict.fromkeys(r for r in found if r is not None))

    def module_rules(self, policy: Policy | None = None) -> "ModuleRules":
        """The class and path rules compiled to the engine's `ModuleRules`.

        Args:
          policy: None under autocast (it owns no params: every class rule marks a region, the
            ops inside run in its dtype); the model-wide [`jaxmp.Policy`][jaxmp.Policy] under the Flax door
            (``"half"`` and ``"float32"`` class rules and path rules also cast the layer's params
            and inputs, a `jaxmp.Policy` runs the class under it, other dtypes mark a region).

        Returns:
          The compiled `ModuleRules` (cached per rules and policy).

        Example:
          >>> import flax.linen as nn, jaxmp
          >>> rules = (jaxmp.AutocastRules().with_class(nn.Dense, "half")
          ...          .with_path("head", "float32"))
          >>> compiled = rules.module_rules(jaxmp.get_policy("O1-bf16"))
          >>> head = compiled.rule_at(("head",), nn.Dense)
          >>> body = compiled.rule_at(("body",), nn.Dense)
          >>> head.action, body.action
          ('float32', 'half')
        """
        return compile_module_rules(tuple((c, d) for c, d in self.class_rules if not _is_follow(d)), self.path_rules, policy)


def scope_matches(pattern: str, component: str, outer: tuple[str, ...] = ()) -> bool:
    """Whether a scope rule's ``pattern`` matches ``component`` inside the scopes ``outer``.

    A pattern without ``/`` is matched against the component alone; one with ``n - 1`` slashes
    against the last ``n`` scopes (``outer``'s innermost and ``component``) joined by ``/``.
    """
    if "/" not in pattern:
        return fnmatch.fnmatchcase(component, pattern)
    n = pattern.count("/") + 1
    if len(outer) + 1 < n:
        return False
    return fnmatch.fnmatchcase("/".join((*outer[len(outer) + 1 - n:], component)), pattern)


def merge_rules(base: AutocastRules, edits: AutocastRules) -> AutocastRules:
    """``edits`` (a rules object built from ``AutocastRules()``) applied onto a preset's ``base`` rules.

    What the Flax door does with a rules object that is not a whole rule set
    ([`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] and copies of it are): the op lists move
    the ops that ``edits`` moved relative to ``AutocastRules()``'s lists; scope, class and path rules
    come after the preset's (a class rule of ``edits`` replaces the preset's for that class,
    ``"follow"`` takes it off); every other field set away from ``AutocastRules()``'s default wins.

    Args:
      base: the preset's whole rule set.
      edits: the user's rules.

    Returns:
      A whole rule set (used as given if merged again).
    """
    bare = AutocastRules()
    f32_add, f32_drop = edits.float32_ops - bare.float32_ops, bare.float32_ops - edits.float32_ops
    half_add, half_drop = edits.half_ops - bare.half_ops, bare.half_ops - edits.half_ops
    fields = {f: getattr(edits, f) if getattr(edits, f) != getattr(bare, f) else getattr(base, f)
              for f in ("promote", "matmul_output", "fp8_matmuls", "float32_loss", "fused_attention")}
    return AutocastRules(
        half_ops=(base.half_ops - half_drop - f32_add) | half_add,
        float32_ops=(base.float32_ops - f32_drop - half_add) | f32_add,
        scope_rules=base.scope_rules + edits.scope_rules, class_rules=base.class_rules + edits.class_rules,
        path_rules=base.path_rules + edits.path_rules, matmul_formats=base.matmul_formats + edits.matmul_formats,
        _complete=True, **fields)


def _is_follow(action: Any) -> bool:
    return isinstance(action, str) and action == "follow"


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
    """
    return f"jaxmp[{dtype}]" + (f":{label}" if label else "")
