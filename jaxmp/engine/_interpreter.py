"""The engine: re-evaluates a jaxpr primitive by primitive, each op in the dtype its rule gives.

Higher-order primitives go to `jaxmp.engine._control_flow`; JAX internals are read through
`jaxmp.engine._internals`. See docs/architecture.md#the-engines-interpreter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _ops, fp8
from jaxmp.fp8._seams import recipes as fp8_recipes
from jaxmp.engine import _control_flow as control_flow, _internals as internals
from jaxmp.engine._internals import Literal
from jaxmp.engine._config import AutocastConfig
from jaxmp.engine._rules import COLLECTIVE_OPS, COMBINER_OPS, FLOAT32_OPS, FOLLOW_OPS, HALF_OPS, MARKER, PASSTHROUGH_OPS
from jaxmp.engine._values import F32, Val, dtype_of, is_complex, is_float, lost_in, np_dtype, saturate, widest


class Interpreter:
    """Runs jaxprs under one `jaxmp.engine._config.AutocastConfig`.

    Args:
      config: the resolved autocast settings.
      explain: wrap every op in a ``jaxmp.rule=...`` name scope, for the precision report.
      repeated: returns the ``id`` of every equation of the program whose op occurs more than
        once in it (`repeated_ops`); called once, when a transformation is first met:
        under one only those ops are bound staged (see `bind`). None: every op is.
    """

    def __init__(self, config: AutocastConfig, explain: bool = False,
                 repeated: Callable[[], frozenset] | None = None):
        self.config = config
        self.rules = config.rules
        self.explain = explain
        self._repeated_fn = repeated
        self._repeated: frozenset | None = None
        self._regions: dict[tuple[str, ...], Any] = {}
        self._formats: dict[tuple[str, ...], Any] = {}
        self._staged = False  # the jaxpr being run has operands of a transformation
        self._stage_now = False  # and the equation being run is bound staged
        self._demand: frozenset = frozenset()  # promote="demand": the variables needed in float32
        defaults = HALF_OPS | FLOAT32_OPS | FOLLOW_OPS
        self.follow_ops = (defaults - self.rules.half_ops - self.rules.float32_ops)

    # -- regions ----------------------------------------------------------------------------

    def region(self, components: tuple[str, ...]) -> Any:
        """The dtype a name stack forces (a dtype, ``"keep"``) or None: the innermost rule wins."""
        if components not in self._regions:
            found = None
            # A path pattern ("block_1/Dense_0") reads the user's scopes around a component:
            # jaxmp's own markers between them are not part of the module path.
            names = tuple(c for c in components if not MARKER.match(c))
            for i, comp in reversed(list(enumerate(components))):
                m = MARKER.match(comp)
                outer = names[:sum(1 for c in components[:i] if not MARKER.match(c))]
                dtype = m.group("dtype") if m else self.rules.scope_dtype(comp, outer)
                if dtype is not None:
                    found = "keep" if dtype == "keep" else (
                        self.config.compute_dtype if dtype == "half" else np.dtype(dtype))
                    break
            self._regions[components] = found
        return self._regions[components]

    def matmul_recipe(self, components: tuple[str, ...]) -> Any:
        """The fp8 recipe a name stack's half-list matmuls run (None: the compute dtype): the
        innermost scope with a format rule decides, else ``fp8_matmuls``."""
        if not self.rules.matmul_formats:
            return self.rules.fp8_matmuls
        if components not in self._formats:
            found = self.rules.fp8_matmuls
            names = tuple(c for c in components if not MARKER.match(c))
            for i in range(len(names) - 1, -1, -1):
                matched, recipe = self.rules.scope_format(names[i], names[:i])
                if matched:
                    found = recipe
                    break
            self._formats[components] = found
        return self._formats[components]

    def scopes_seen(self) -> set:
        """The name-stack component tuples of the ops run so far (for rules that match none)."""
        return set(self._regions)

    # -- running a jaxpr --------------------------------------------------------------------

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Val],
            prefix: tuple[str, ...] = ()) -> list[Val]:
        """Evaluates ``jaxpr`` on interpreted values; returns interpreted outputs.

        Args:
          jaxpr: an open jaxpr.
          consts: values of its constvars (arrays; they are weak, like arguments).
          args: `Val` inputs, one per invar, in any dtypes.
          prefix: the name-stack components of the enclosing ops (for region rules).

        Returns:
          One `Val` per outvar.
        """
        staged, self._staged = self._staged, internals.transformed(
            [*consts, *(a.x if isinstance(a, Val) else a for a in args)])
        try:
            return self._run(jaxpr, consts, args, prefix)
        finally:
            self._staged = staged

    def _run(self, jaxpr, consts, args, prefix) -> list[Val]:
        env: dict[Any, Val] = {}
        casts: dict[tuple[int, np.dtype, bool], tuple[Any, Any]] = {}
        # Pure half (no float32 list, O3) keeps every op in half: its constants saturate instead.
        mixed = self.config.compute_dtype.itemsize < 4 and bool(self.rules.float32_ops)
        half = self.config.compute_dtype if mixed else None
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Val(c, True, False, True) if half is not None and lost_in(c, half) else Val(c, False, False, True)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a if isinstance(a, Val) else Val(a)

        def read(atom) -> Val:
            if isinstance(atom, Literal):
                if half is not None and lost_in(atom.val, half):  # decisive, and runs its ops in float32
                    return Val(atom.val, True, False, True)
                return Val(atom.val, False, bool(getattr(atom.aval, "weak_type", False)), True)
            return env[atom]

        def cast(atom, val: Val, dtype: np.dtype) -> Any:
            if dtype_of(val.x) == dtype:
                return val.x
            narrowing = val.const and is_float(dtype) and dtype.itemsize < dtype_of(val.x).itemsize
            if isinstance(atom, Literal):
                return saturate(atom.val, dtype) if narrowing else np.asarray(atom.val, dtype)
            # A value is cast to a given dtype at most once per trace, also when two variables
            # hold it (merged duplicate equations): keyed by the array, which the entry keeps alive.
            key = (id(val.x), dtype, narrowing)
            if key not in casts:
                casts[key] = (val.x, saturate(val.x, dtype) if narrowing else (
                    internals.staged_cast(dtype)(val.x) if self._stage_now else jax.lax.convert_element_type(val.x, dtype)))
            return casts[key][1]

        seen: dict[tuple, list[Val]] = {}
        demand, self._demand = self._demand, (
            float32_demand(jaxpr, self.rules) if self.rules.promote == "demand" else frozenset())
        try:
            return self._eval(jaxpr, env, seen, read, cast, prefix)
        finally:
            self._demand = demand

    def _eval(self, jaxpr, env, seen, read, cast, prefix) -> list[Val]:
        for eqn in internals.equations(jaxpr):
            comps = prefix + internals.scope_names(eqn)
            handler = control_flow.handler_for(eqn)
            key = None if handler is not None else _repeat_key(eqn, comps)
            if key is not None and key in seen:
                for v, o in zip(eqn.outvars, seen[key]):
                    env[v] = o
                continue
            vals = [read(a) for a in eqn.invars]
            with internals.equation_context(eqn):
                if handler is not None:
                    outs = handler(self, eqn, vals, comps)
                else:
                    self._stage_now = self._staged and self._repeats(eqn)
                    outs = self.first_order(eqn, vals, comps, cast)
                    const = _all_const(vals)
                    outs = [o._replace(const=const) for o in outs]
            if key is not None:
                seen[key] = outs
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(a) for a in jaxpr.outvars]

    def _repeats(self, eqn) -> bool:
        if self._repeated_fn is None:
            return True
        if self._repeated is None:
            self._repeated = self._repeated_fn()
        return id(eqn) in self._repeated

    def _rule_scope(self, rule: str):
        """Names the deciding rule in the ops' name stack, for ``precision_report`` (explain mode only)."""
        return jax.named_scope(f"jaxmp.rule={rule}") if (self.explain and rule) else contextlib.nullcontext()

    def bind(self, eqn, args: Sequence[Any], params: dict | None = None, rule: str = "",
             staged: bool = True) -> list[Any]:
        """Binds ``eqn``'s primitive on ``args`` (inside the eqn's name stack and context).

        ``staged`` (see `jaxmp.engine._internals.bind`) applies while the jaxpr being run
        has operands of a transformation (grad, vmap) and the op repeats in the program: a
        one-off op would pay the jit call and JAX's per-op caches for nothing. It is turned
        off for the ops run as traced: collectives, kernels and primitives the rules do not know.
        """
        params = eqn.params if params is None else params
        with self._rule_scope(rule):
            return internals.bind(eqn, args, params, staged=staged and self._stage_now)

    # -- first-order ops ---------------------------------------------------------------------

    def first_order(self, eqn, vals: list[Val], comps: tuple[str, ...], cast) -> list[Val]:
        name = eqn.primitive.name
        region = self.region(comps)
        traced = [np_dtype(a.aval.dtype) if hasattr(a.aval, "dtype") else None for a in eqn.invars]
        floats = [i for i, v in enumerate(vals) if is_float(dtype_of(v.x))]
        if name == "convert_element_type":
            return self._convert(eqn, vals, traced)
        if not floats or name in PASSTHROUGH_OPS:
            outs = self.bind(eqn, [v.x for v in vals], rule="follow", staged=bool(floats))
            strong = any(v.strong for v in vals)
            return [Val(o, strong and is_float(dtype_of(o))) for o in outs]
        opaque = internals.sub_jaxprs(eqn) and name not in COMBINER_OPS
        if opaque and region != "keep" and name not in internals.OPAQUE_NAMES:
            raise NotImplementedError(
                f"jaxmp.autocast cannot enter the higher-order primitive {name!r} (jax {jax.__version__}): it "
                "enters jit, scan, while, cond, remat, custom_jvp/custom_vjp and shard_map, and runs kernels "
                f"({', '.join(sorted(internals.OPAQUE_NAMES))}) as traced. Call autocast inside it instead "
                "(e.g. jax.pmap(jaxmp.autocast(f))), or mark the call with jaxmp.autocast_region('keep').")
        if name in COLLECTIVE_OPS and region != "keep":
            args = [cast(a, v, traced[i]) if i in floats and is_float(traced[i]) else v.x
                    for i, (a, v) in enumerate(zip(eqn.invars, vals))]
            strong = any(vals[i].strong for i in floats)
            return [Val(o, strong and is_float(dtype_of(o)) and dtype_of(o).itemsize >= 4)
                    for o in self.bind(eqn, args, rule="as traced", staged=False)]
        if region == "keep" or opaque or name in COMBINER_OPS or not self._known(name) or _complex(eqn):
            args = [cast(a, v, traced[i]) if i in floats and is_float(traced[i]) else v.x
                    for i, (a, v) in enumerate(zip(eqn.invars, vals))]
            return [Val(o) for o in self.bind(eqn, args, rule="as traced", staged=False)]
        if region is not None:
            return self._run_in(eqn, vals, floats, np.dtype(region), cast, "region " + np.dtype(region).name)
        if name in self.rules.half_ops:
            return self._half(eqn, vals, floats, traced, cast, comps)
        if name in self.rules.float32_ops or (name == "mul" and _squares(eqn, vals, self.rules)):
            target = widest([F32] + [dtype_of(vals[i].x) for i in floats])
            return self._run_in(eqn, vals, floats, target, cast, "float32 list")
        return self._follow(eqn, vals, floats, cast)

    def _known(self, name: str) -> bool:
        return name in self.follow_ops or name in self.rules.half_ops or name in self.rules.float32_ops

    def _run_in(self, eqn, vals, floats, dtype: np.dtype, cast, rule: str) -> list[Val]:
        args = [cast(a, v, dtype) if i in floats else v.x for i, (a, v) in enumerate(zip(eqn.invars, vals))]
        params = eqn.params
        if "preferred_element_type" in params and params["preferred_element_type"] is not None \
                and is_float(params["preferred_element_type"]):
            params = {**params, "preferred_element_type": dtype}
        outs = self.bind(eqn, args, params, rule=rule)
        strong = dtype.itemsize >= 4
        return [Val(o, strong and is_float(dtype_of(o))) for o in outs]

    def _half(self, eqn, vals, floats, traced, cast, comps=()) -> list[Val]:
        user_half = {traced[i] for i in floats if traced[i] is not None and is_float(traced[i])
                     and traced[i].itemsize < 4}
        if len(user_half) == 1:
            op_dtype = next(iter(user_half))
        elif user_half:  # bf16 meeting fp16: the type with float32's range, never the one that overflows
            op_dtype = np.dtype(jnp.bfloat16)
        else:
            op_dtype = self.config.compute_dtype
        args = [cast(a, v, op_dtype) if i in floats else v.x for i, (a, v) in enumerate(zip(eqn.invars, vals))]
        params = eqn.params
        if "preferred_element_type" in params:
            if not _chosen(params["preferred_element_type"], [traced[i] for i in floats]):
                out = F32 if self.rules.matmul_output == "float32" else op_dtype
                params = {**params, "preferred_element_type": out}
        recipe = self.matmul_recipe(comps)
        if recipe is not None and eqn.primitive.name == "dot_general" and len(floats) == 2:
            return [Val(self._fp8_dot(eqn, args, params, recipe))]
        if recipe is not None and eqn.primitive.name == "conv_general_dilated" and len(floats) == 2:
            return [Val(self._fp8_conv(args, params, recipe))]
        return [Val(o) for o in self.bind(eqn, args, params, rule="half list")]

    def _fp8_dot(self, eqn, args, params, recipe) -> Any:
        with self._rule_scope(fp8_recipes.describe(recipe)):
            return fp8.fp8_dot_general(args[0], args[1], params["dimension_numbers"], recipe,
                                       preferred_element_type=params.get("preferred_element_type"))

    def _fp8_conv(self, args, params, recipe) -> Any:
        # What the Flax door's Conv layers run: fp8_conv_general_dilated, which gives a block recipe
        # per-tensor scaling in its fp8 formats (a convolution's window has no contraction axis to
        # block along); labelled with the recipe that actually runs.
        with self._rule_scope(fp8_recipes.describe(fp8_recipes.conv_recipe(recipe))):
            kwargs = {k: v for k, v in params.items() if k != "out_sharding"}  # as _fp8_dot: not an fp8 op's
            return fp8.fp8_conv_general_dilated(args[0], args[1], recipe=recipe, **kwargs)

    def _follow(self, eqn, vals, floats, cast) -> list[Val]:
        dts = [dtype_of(vals[i].x) for i in floats]
        # Python scalars (weak) and plain float32 scalars (``* 0.5``, a scalar parameter) never
        # decide, as a 0-dim tensor does not in torch; strong scalars (a mean) still do.
        arrays = [i for i in floats if not vals[i].weak]
        decisive = [i for i in arrays if vals[i].strong or np.ndim(vals[i].x) > 0
                    or all(np.ndim(vals[j].x) == 0 for j in arrays)] or arrays or floats
        strong = [i for i in decisive if vals[i].strong]
        name = eqn.primitive.name
        if name == "dynamic_update_slice" and 0 in floats and not strong:
            # Writing into a buffer keeps the buffer's dtype (a float32 KV cache or history is not
            # rounded as a whole by a half update), as ``buf.at[i].set(h)`` does; a float32-list
            # result written into a half buffer promotes it instead (the strong rule below).
            target = dtype_of(vals[0].x)
        elif self.rules.promote == "widest" or name == "concatenate" or (
                self.rules.promote == "demand" and any(v in self._demand for v in eqn.outvars)):
            # torch.autocast's "promote" ops: joining a float32 array to a half one keeps float32.
            target = widest([dtype_of(vals[i].x) for i in decisive])
        elif strong:
            target = widest([dtype_of(vals[i].x) for i in decisive])
        else:
            halves = [dtype_of(vals[i].x) for i in decisive if dtype_of(vals[i].x).itemsize < 4]
            if halves:  # two different half types: float32, never the narrower range
                target = halves[0] if len(set(halves)) == 1 else F32
            else:
                target = widest([dtype_of(vals[i].x) for i in decisive])
        del dts
        args = [cast(a, v, target) if i in floats else v.x for i, (a, v) in enumerate(zip(eqn.invars, vals))]
        outs = self.bind(eqn, args, rule="follow")
        is_strong = bool(strong) and target.itemsize >= 4
        return [Val(o, is_strong and is_float(dtype_of(o))) for o in outs]

    def _convert(self, eqn, vals, traced) -> list[Val]:
        val, src = vals[0], traced[0]
        new = np.dtype(eqn.params["new_dtype"]) if eqn.params["new_dtype"] is not None else None
        cur = dtype_of(val.x)
        if new is None or not is_float(new) or not is_float(cur) or src is None or not is_float(src):
            out = self.bind(eqn, [val.x], rule="as traced")[0]
            weak = bool(eqn.params.get("weak_type", False))
            # Integers or booleans made float32 (a mask, positions): float32 data of the program's own.
            made = new is not None and is_float(new) and new.itemsize >= 4 and src is not None and not is_float(src) \
                and bool(self.rules.float32_ops)
            return [Val(out, made and not weak, weak)]
        if new == src:  # only the weak type changes: the value keeps its (interpreted) dtype
            return [Val(val.x, val.strong, bool(eqn.params.get("weak_type", False)))]
        # An explicit cast in the traced program is the user's choice: kept. An upcast of a
        # half value to float32 marks the result as deliberately float32 (strong).
        out = self.bind(eqn, [val.x], rule="user cast")[0]
        return [Val(out, new.itemsize >= 4, False)]


def float32_demand(jaxpr: Any, rules) -> frozenset:
    """The variables of ``jaxpr`` whose values are needed in float32 (``promote="demand"``).

    A value is needed in float32 when it flows, through ops that follow their inputs, into a
    float32-list op, an output of the jaxpr, or an op the rules do not type (a loop, a call, a
    collective, a kernel): there rounding it to half would lose what float32 keeps. A value
    whose every use is a half-list op (a matmul operand) is not: it is cast to half there anyway.

    Args:
      jaxpr: an open jaxpr.
      rules: the `jaxmp.AutocastRules` (its op lists).

    Returns:
      A frozenset of the jaxpr's variables.
    """
    demand = {v for v in jaxpr.outvars if not internals.is_literal(v)}
    follow = FOLLOW_OPS - rules.half_ops - rules.float32_ops
    for eqn in reversed(internals.equations(jaxpr)):
        name = eqn.primitive.name
        if name in rules.half_ops and not internals.sub_jaxprs(eqn):
            continue
        if name in follow or name == "convert_element_type":
            if not any(v in demand for v in eqn.outvars):
                continue
        demand.update(v for v in eqn.invars if not internals.is_literal(v))
    return frozenset(demand)


def op_signature(eqn) -> tuple | None:
    """(primitive, parameters, operand types) of a first-order equation; None if unhashable."""
    key = (eqn.primitive, internals.params_key(eqn.params), tuple(a.aval for a in eqn.invars))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def repeated_ops(jaxpr: Any) -> frozenset:
    """The equations of ``jaxpr`` and the jaxprs nested in it whose op (`op_signature`)
    occurs more than once there (a model's layers: the ops worth binding staged under ``grad``).

    Args:
      jaxpr: an open jaxpr; the ids are valid while it lives.

    Returns:
      The ``id`` of each such equation.
    """
    by_signature: dict[tuple, list[int]] = {}
    todo = [jaxpr]
    while todo:
        for eqn in internals.equations(todo.pop()):
            subs = internals.sub_jaxprs(eqn)
            if subs:
                todo.extend(internals.open_jaxpr(j) for j in subs)
                continue
            sig = None if eqn.effects else op_signature(eqn)
            if sig is not None:
                by_signature.setdefault(sig, []).append(id(eqn))
    return frozenset(i for ids in by_signature.values() if len(ids) > 1 for i in ids)


#: Never merged although they declare no effects: ``rng_uniform`` draws anew on every call, and
#: a repeated ``optimization_barrier`` is there on purpose.
_NEVER_MERGED = _ops.having("never_merged")


def _repeat_key(eqn, comps: tuple[str, ...]) -> tuple | None:
    """What makes ``eqn`` the same computation as an earlier equation, or None if it may not merge.

    Operands are compared by variable identity (literals by type, dtype and value), parameters by
    type and value, so two equations with equal keys compute the same values under the same rules.
    """
    if eqn.effects or eqn.primitive.name in _NEVER_MERGED:
        return None
    operands = tuple(("literal", type(a.val), str(getattr(a.aval, "dtype", "")), a.val)
                     if internals.is_literal(a) else a for a in eqn.invars)
    key = (eqn.primitive, comps, operands, eqn.ctx, internals.params_key(eqn.params))
    try:
        hash(key)
    except TypeError:  # an unhashable parameter (an array, a callable's closure): never merged
        return None
    return key


def _all_const(vals: Sequence[Val]) -> bool:
    """An op's result is a constant when its floating operands are (a mask does not count)."""
    floats = [v for v in vals if is_float(dtype_of(v.x))]
    return all(v.const for v in (floats or vals))


def _squares(eqn, vals: Sequence[Val], rules) -> bool:
    """``x * x`` is ``x ** 2`` (norms, RMSNorm, variances): on the float32 list with ``integer_pow``.

    The operands are compared as values, not only as variables: ``(x @ w) * (x @ w)`` traces two
    matmuls, which the engine merges into one (`_repeat_key`), so the ``mul`` then reads
    the same value twice and is a square as much as ``h * h`` is.
    """
    a, b = eqn.invars
    if internals.is_literal(a) or internals.is_literal(b) or "integer_pow" not in rules.float32_ops:
        return False
    return a is b or vals[0].x is vals[1].x


def _complex(eqn) -> bool:
    """Whether an operand or result of ``eqn`` is complex: such an op runs as traced.

    There is no half complex type, so a complex matmul or product runs in complex64 whatever
    autocast does with its real operands: rounding a real float32 operand to half first would
    cost accuracy and save nothing (``(w_re + 1j * w_im) @ x`` would read ``x`` in bf16).
    """
    return any(is_complex(getattr(v.aval, "dtype", None)) for v in (*eqn.invars, *eqn.outvars))


def _chosen(pet: Any, operands: Sequence[Any]) -> bool:
    """Whether a matmul's traced ``preferred_element_type`` is a choice of the program, kept.

    ``jnp.matmul``/``einsum``/``dot`` always fill it in with the promoted type of their
    operands, so a ``pet`` equal to that type (float32 for bf16 x float32, a float32 scan state
    meeting a half weight) is JAX's promotion, not a choice, and the op returns the compute
    dtype like any half-list op. A ``pet`` other than the promoted type is a choice: float32
    from two half operands (``jax.nn.dot_product_attention``'s logits), or a narrower output.
    """
    if pet is None or not is_float(np_dtype(pet)):
        return False
    dtypes = [d for d in operands if d is not None and is_float(d)]
    return bool(dtypes) and np.dtype(pet) != widest(dtypes)  # widest: the promoted float type
