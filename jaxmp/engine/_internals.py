"""The one seam between the engine and JAX's internals.

Every access to what JAX changes between releases (the parameters a ``custom_jvp``/``custom_vjp``/
``shard_map``/``jit`` is rebuilt from, jit-keyed config states, tracer kinds) lives here behind a
named adapter; reading jaxprs, and the one control-flow dispatcher (`primitive_kind`, `bodies`:
which parameters hold a construct's sub-jaxprs), are `jaxmp._jaxpr`'s, re-exported here. A
missing parameter raises `JaxInternalsError` naming it and the JAX version.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp import _jaxpr, _ops
# Jaxpr reading is jaxmp._jaxpr's (the layer under the engine reads jaxprs too); the engine finds
# it here, beside the adapters that are the engine's alone.
from jaxmp._jaxpr import (Literal, equation_context, equations, is_literal, open_jaxpr, scope_names,  # noqa: F401
                          sub_jaxprs)
# The control-flow dispatcher and its parameter adapters are the reader's too (diagnostics and
# the engine enter the same constructs): re-exported for the engine.
from jaxmp._jaxpr import (LOOPS, JaxInternalsError, _missing, bodies, call_jaxpr, dispatch, param,  # noqa: F401
                          primitive_kind, scan_counts, while_parts)

#: The running JAX version as a tuple of ints, e.g. ``(0, 10, 2)``.
JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


# -- config states that are part of jit's cache key ----------------------------------------

def jit_key_state(name: str, default: Any, help: str, kind: str = "object") -> Any:
    """A JAX config state that is part of ``jax.jit``'s cache key (a trace under it is cached apart).

    Args:
      name: the state's name.
      default: its value outside any ``with state(value)`` block.
      help: a description.
      kind: ``"object"`` (any hashable value) or ``"bool"``.

    Returns:
      The state object: ``state.value`` reads it, ``with state(v):`` sets it.
    """
    from jax._src import config as jax_config

    make = jax_config.bool_state if kind == "bool" else jax_config.string_or_object_state
    return make(name=name, default=default, help=help, include_in_jit_key=True, include_in_trace_context=True)


# -- binding ---------------------------------------------------------------------------------

def params_key(params: dict) -> tuple:
    """An equation's parameters as a tuple that compares by type and value (hashable when they are).

    Args:
      params: the parameters, as found in a jaxpr.

    Returns:
      ``((name, type, value), ...)`` sorted by name.
    """
    return tuple((k, type(v), v) for k, v in sorted(params.items()))


def bind(eqn, args, params: dict, staged: bool = False) -> list[Any]:
    """Binds ``eqn``'s primitive on ``args`` with ``params`` (as found in a jaxpr); a list of outputs.

    Args:
      eqn: the equation whose primitive is bound.
      args: the operands.
      params: its parameters.
      staged: bind through a one-op ``jax.jit(..., inline=True)`` function, the same one for
        every equal (primitive, parameters), when the equation allows it (no effects, no
        sub-jaxprs, hashable parameters). Under ``grad`` and ``vmap`` JAX then linearizes or
        batches each distinct op once per process (its caches are keyed on the jitted
        function's jaxpr) instead of once per equation: ``jnp`` functions are jitted for the
        same reason. The staged program is the same: an inline jit leaves no call behind. Only
        worth it under a transformation (`transformed`): a plain staging trace pays the
        jit call and gains nothing.

    Returns:
      The outputs, a list.
    """
    if staged and not eqn.effects and not sub_jaxprs(eqn):
        try:
            fn = _staged_primitive(eqn.primitive, params_key(params))
        except TypeError:  # an unhashable parameter: bound directly
            fn = None
        if fn is not None:
            return list(fn(*args))
    return _jaxpr.bind(eqn, args, params)


# A memo of a pure function (primitive, parameters) -> jitted one-op function; bounded, and
# holding no arrays (parameters with arrays are unhashable and never reach it).
@functools.lru_cache(maxsize=4096)
def _staged_primitive(prim, key: tuple) -> Callable:
    return jax.jit(functools.partial(_jaxpr.bind_primitive, prim, {k: v for k, _, v in key}), inline=True)


@functools.lru_cache(maxsize=64)
def staged_cast(dtype) -> Callable:
    """``lax.convert_element_type(x, dtype)`` as a cached inline jit (see `bind`'s ``staged``).

    Args:
      dtype: the target dtype (hashable: a NumPy dtype).

    Returns:
      A function of one array.
    """
    return jax.jit(functools.partial(jax.lax.convert_element_type, new_dtype=dtype), inline=True)


# -- primitives ------------------------------------------------------------------------------

#: Primitives that call a closed jaxpr once, inline (``pjit``/``jit``, ``closed_call``,
#: ``core_call``, and ``eval_jaxpr`` which replaced ``closed_call`` in jax 0.12): the op
#: catalogue's ``call`` class (jaxmp/_ops.py).
CALL_NAMES = _ops.of_class("call")
REMAT_NAMES = _ops.of_class("remat")

#: Kernels the engine cannot look into: they run as traced (operands in their traced dtypes).
OPAQUE_NAMES = _ops.of_class("opaque")


def _specified(sharding) -> bool:
    return sharding is not None and type(sharding).__name__ not in ("UnspecifiedValue", "AUTO")


def jit_wrapper(eqn, fn: Callable) -> Callable | None:
    """``jax.jit(fn)`` with a nested ``jit`` equation's shardings, donation and name, or None
    when it has none of them to keep (then the engine inlines it, as XLA would).

    Args:
      eqn: a ``jit``/``pjit`` equation.
      fn: the function of the equation's operands that re-evaluates its body.

    Returns:
      The jitted function, or None.
    """
    p = eqn.params
    ins, outs = tuple(p.get("in_shardings", ())), tuple(p.get("out_shardings", ()))
    donated = tuple(p.get("donated_invars", ()))
    if not (any(map(_specified, ins)) or any(map(_specified, outs)) or any(donated)):
        return None
    def body(*xs):
        return tuple(fn(*xs))

    body.__name__ = body.__qualname__ = str(p.get("name", "jit"))
    return jax.jit(body, in_shardings=tuple(s if _specified(s) else None for s in ins) or None,
                   out_shardings=tuple(s if _specified(s) else None for s in outs) or None,
                   donate_argnums=tuple(i for i, d in enumerate(donated) if d),
                   keep_unused=bool(p.get("keep_unused", False)))


def _bound_consts(jaxpr, consts) -> tuple[Any, list]:
    """A rule thunk's (jaxpr, consts) with ``jaxpr.constvars`` naming ``consts``, as the engine
    binds them. From jax 0.11 a jaxpr's constvars are its leading inputs that carry values, and a
    freshly traced rule returns them as plain inputs with the values beside (JAX's ``eval_jaxpr``
    binds ``[*consts, *args]`` to all the inputs): attach them. Up to 0.10 they are constvars."""
    consts = list(consts)
    if len(jaxpr.constvars) != len(consts) and hasattr(jaxpr, "with_consts"):
        jaxpr = jaxpr.with_consts(consts)
    return jaxpr, consts


def custom_jvp_parts(eqn) -> tuple[Any, int, Any]:
    """(primal closed jaxpr, number of consts, jvp jaxpr thunk) of a ``custom_jvp_call``."""
    return param(eqn, "call_jaxpr"), param(eqn, "num_consts"), param(eqn, "jvp_jaxpr_fun")


def custom_symbolic_zeros(eqn) -> bool:
    """Whether a ``custom_jvp_call``/``custom_vjp_call``'s rules take symbolic zeros
    (``symbolic_zeros=True``): a jvp rule then sees ``SymbolicZero`` tangents, a bwd rule
    ``SymbolicZero`` cotangents, where the float32 program has them."""
    return bool(param(eqn, "symbolic_zeros"))


def custom_jvp_rule(jvp_fun, zeros: Sequence[bool]) -> tuple[Any, list, list]:
    """(jaxpr, consts, which outputs have symbolic-zero tangents) of a custom_jvp rule.

    Args:
      jvp_fun: the equation's ``jvp_jaxpr_fun`` (see `custom_jvp_parts`).
      zeros: one flag per input after the consts: whether its tangent is a symbolic zero (all
        False for a rule without ``symbolic_zeros``: JAX instantiates its zero tangents, see
        `custom_symbolic_zeros`).

    Returns:
      The rule's jaxpr, of the primals and then the non-zero tangents, to the primal outputs and
      then the non-zero output tangents; its consts; one flag per output.
    """
    jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*map(bool, zeros))
    return (*_bound_consts(jaxpr, consts), list(out_zeros))


def custom_vjp_parts(eqn) -> tuple[Any, int, Any, Any, Any]:
    """(primal closed jaxpr, consts, fwd thunk, bwd, out_trees thunk) of a ``custom_vjp_call``."""
    return (param(eqn, "call_jaxpr"), param(eqn, "num_consts"), param(eqn, "fwd_jaxpr_thunk"),
            param(eqn, "bwd"), param(eqn, "out_trees"))


def custom_vjp_fwd(fwd_thunk, out_trees, perturbed: Sequence[bool]) -> tuple[Any, list, Any, list]:
    """(fwd jaxpr, consts, residual tree, input forwards) of a custom_vjp's forward rule.

    Args:
      fwd_thunk: the equation's ``fwd_jaxpr_thunk`` (see `custom_vjp_parts`).
      out_trees: its ``out_trees``.
      perturbed: one flag per input after the consts: whether it is differentiated. A rule with
        ``symbolic_zeros=True`` reads them (``CustomVJPPrimal.perturbed``; Equinox's
        ``filter_custom_vjp`` asserts them), so they must be the real ones.

    Returns:
      The forward jaxpr (inputs after the consts, to the residuals not forwarded from inputs and
      then the primal outputs), its consts, the residuals' tree, and per residual the input it
      forwards (an index counting the consts) or None.
    """
    fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*map(bool, perturbed))
    # Read right after the call: tracing the rule (re)fills the store for these flags.
    _, res_tree, input_fwds = out_trees()
    return (*_bound_consts(fwd_jaxpr, fwd_consts), res_tree, input_fwds)


def closed_over_perturbed() -> Exception:
    """The error JAX raises when a custom_vjp function is differentiated with respect to a value it
    closes over (its rule has no cotangent for it): the engine raises the same, where JAX would."""
    from jax._src.interpreters import ad

    return ad.CustomVJPException()


def custom_vjp_bwd_cotangents(out) -> Any:
    """The cotangents a flattened custom_vjp bwd returned: jax 0.11 pairs them with its logs."""
    if len(out) == 2 and isinstance(out[0], (list, tuple)) and (out[1] is None or isinstance(out[1], dict)):
        return out[0]
    return out


def is_zero(x: Any) -> bool:
    """Whether ``x`` is a symbolic zero: JAX's internal ``ad_util.Zero`` or the ``SymbolicZero``
    that rules with ``symbolic_zeros=True`` see and return."""
    from jax._src.ad_util import Zero

    return isinstance(x, (Zero, jax.custom_derivatives.SymbolicZero))


def instantiate_zero(x: Any) -> Any:
    """A symbolic zero (see `is_zero`) as a zeros array (a NumPy one for ``float0``, the tangent
    type of integer values, which JAX arrays cannot hold); anything else unchanged."""
    if is_zero(x):
        if x.aval.dtype == jax.dtypes.float0:
            return np.zeros(x.aval.shape, jax.dtypes.float0)
        return jax.numpy.zeros(x.aval.shape, x.aval.dtype)
    return x


def symbolic_zero(x: Any) -> Any:
    """The ``SymbolicZero`` tangent of the primal value ``x`` (what a rule with
    ``symbolic_zeros=True`` returns for a zero tangent or cotangent)."""
    return jax.custom_derivatives.SymbolicZero(typeof(x).to_tangent_aval())


def symbolic_zero_of(aval: Any) -> Any:
    """The ``SymbolicZero`` of a tangent or cotangent type ``aval`` (a ``ShapedArray``)."""
    return jax.custom_derivatives.SymbolicZero(aval)


def shard_map_parts(eqn) -> dict:
    """The arguments to re-create a ``shard_map`` equation with `jax.shard_map`."""
    p = eqn.params
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    if axes is None:
        raise _missing("manual_axes", "the 'shard_map' primitive")
    return dict(jaxpr=param(eqn, "jaxpr"), mesh=param(eqn, "mesh"), in_specs=tuple(param(eqn, "in_specs")),
                out_specs=list(param(eqn, "out_specs")), check_vma=p.get("check_vma", p.get("check_rep", True)),
                axis_names=set(axes))


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a JAX tracer (a value of an enclosing trace)."""
    return isinstance(x, jax.core.Tracer)


def staging() -> bool:
    """Whether the current trace stages a program out (``jit``, ``make_jaxpr``, a loop body),
    possibly under ``grad``/``vmap`` on top; False when ops run eagerly (an eager ``grad`` too).

    Returns:
      True under a staging trace (JAX's ``unsafe_am_i_under_a_jit``; False on a JAX without it,
      which keeps the engine's program one jitted call).
    """
    from jax._src import core

    under_jit = getattr(core, "unsafe_am_i_under_a_jit", None)
    return bool(under_jit()) if under_jit is not None else False


def transformed(xs) -> bool:
    """Whether any of ``xs`` is a tracer of a transformation (``grad``, ``jvp``, ``vmap``...),
    not only of staging (``jit``, ``make_jaxpr``, a loop body being traced).

    Args:
      xs: values (arrays, tracers, constants).

    Returns:
      True if any is such a tracer.
    """
    from jax._src.interpreters import partial_eval as pe

    return any(isinstance(x, jax.core.Tracer) and not isinstance(x, pe.DynamicJaxprTracer) for x in xs)


def trace_of(xs) -> Any:
    """The trace the first tracer among ``xs`` belongs to (a weak-referenceable key), or None.

    Args:
      xs: values (arrays, tracers).

    Returns:
      The JAX trace object, or None when no value is a tracer (eager values).
    """
    for x in xs:
        if isinstance(x, jax.core.Tracer):
            return getattr(x, "_trace", None)
    return None


def typeof(x: Any) -> Any:
    """The abstract value (shape, dtype, weak type) of an array or tracer."""
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def all_primitive_names() -> frozenset[str]:
    """The names of the primitives this JAX defines (a walk of ``jax._src.lax`` and friends)."""
    from jax._src import core
    import jax._src.lax as lax_pkg

    modules = [m.name for m in pkgutil.walk_packages(lax_pkg.__path__, "jax._src.lax.")]
    modules += ["jax._src.ad_util", "jax._src.ad_checkpoint", "jax._src.custom_derivatives",
                "jax._src.pjit", "jax._src.shard_map", "jax._src.dispatch", "jax._src.core"]
    names: set[str] = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:  # optional backends (e.g. GPU-only modules) may not import here
            continue
        names.update(v.name for v in vars(module).values() if isinstance(v, core.Primitive))
    return frozenset(names)



def all_gather_invariant(x: Any, axis_name: Any, *, tiled: bool = False) -> Any:
    """``jax.lax.all_gather`` whose result is typed as the same on every device of ``axis_name``
    (what a ``psum`` returns; the plain gather's is typed as varying), or None where this JAX has
    no such gather. JAX 0.10-0.12 spell it ``all_gather(..., to="invarying")`` (0.10 and 0.11 also
    privately as ``all_gather_invariant``, which 0.12 dropped)."""
    public: Any = getattr(jax.lax, "all_gather_invariant", None)
    if public is not None:
        return public(x, axis_name, tiled=tiled)
    if "to" in inspect.signature(jax.lax.all_gather).parameters:
        return jax.lax.all_gather(x, axis_name, tiled=tiled, to="invarying")
    try:
        from jax._src.lax.parallel import all_gather_invariant as gather
    except ImportError:
        return None
    return gather(x, axis_name, tiled=tiled)
