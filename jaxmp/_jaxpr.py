"""The one jaxpr reader: equations, sub-jaxprs, name stacks, source lines and re-binding.

Every module that reads a traced program, and the test helpers, read it through this module;
only this module imports ``jax.extend.core`` or touches a name stack (tests/cross/test_architecture.py
checks it). It gives `equations`, `sub_jaxprs`, `walk` (every equation, nested ones included, as
an `Equation`), `bind`, and the one control-flow dispatcher: `primitive_kind`, `KIND_RUNS` (how
each kind runs its bodies), `dispatch` (a walk's handler for an equation) and `bodies` (which
parameters of a ``scan``/``while``/``cond``/call/... hold its sub-jaxprs, and how their inputs map
onto the equation's operands). See docs/architecture.md#the-jaxpr-reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, NamedTuple, TypeVar

import jax
from jax.extend import core as _core

from jaxmp import _ops

#: JAX's jaxpr classes, for ``isinstance`` checks and annotations elsewhere.
Jaxpr = _core.Jaxpr
ClosedJaxpr = _core.ClosedJaxpr
Literal = _core.Literal
Var = _core.Var
Primitive = _core.Primitive

_H = TypeVar("_H")


def is_jaxpr(x: Any) -> bool:
    """Whether ``x`` is a jaxpr, open (``Jaxpr``) or closed (``ClosedJaxpr``)."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def open_jaxpr(x: Any) -> Any:
    """The open jaxpr of ``x`` (a ``ClosedJaxpr``'s ``.jaxpr``; a ``Jaxpr`` itself).

    Args:
      x: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      The ``Jaxpr``.

    Raises:
      TypeError: ``x`` is neither.
    """
    if isinstance(x, ClosedJaxpr):
        return x.jaxpr
    if isinstance(x, Jaxpr):
        return x
    raise TypeError(f"expected a Jaxpr or ClosedJaxpr (from jax.make_jaxpr), got {type(x).__name__}")


def is_literal(atom: Any) -> bool:
    """Whether an operand is a literal constant (its value is ``atom.val``), not a variable."""
    return isinstance(atom, Literal)


def is_var(atom: Any) -> bool:
    """Whether an operand is a variable (a binder of the jaxpr), not a literal."""
    return isinstance(atom, Var)


def equations(jaxpr: Any) -> list:
    """The equations of one jaxpr (open or closed), in program order, nested ones not entered.
    """
    return open_jaxpr(jaxpr).eqns


def one_equation_program(eqn: Any) -> tuple[Any, list]:
    """``(jaxpr, inputs)``: ``eqn`` alone as an open jaxpr over its distinct variable inputs (for
    ``jax.core.eval_jaxpr``), so one op of a program can be re-run under its own context."""
    import warnings

    from jax.extend import core as jcore

    ins = list(dict.fromkeys(v for v in eqn.invars if not is_literal(v)))
    with warnings.catch_warnings():  # a one-op program needs no debug info (JAX asks for it)
        warnings.simplefilter("ignore", DeprecationWarning)
        return jcore.Jaxpr([], ins, list(eqn.outvars), [eqn]), ins


def sub_jaxprs(eqn: Any, opened: bool = False) -> list:
    """The jaxprs among ``eqn``'s parameters (a call's body, scan/while bodies, cond branches...).

    Args:
      eqn: an equation.
      opened: give each as an open ``Jaxpr`` (else as found: open or closed).

    Returns:
      A list, in parameter order.
    """
    out = []
    for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, (Jaxpr, ClosedJaxpr)):
                out.append(open_jaxpr(v) if opened else v)
    return out


def primitive_objects(*names: str) -> tuple:
    """Primitive objects by their ``jax.extend.core.primitives`` names (those this JAX has)."""
    return tuple(getattr(_core.primitives, n) for n in names if hasattr(_core.primitives, n))


# -- control flow: the one dispatcher ---------------------------------------------------------

class JaxInternalsError(RuntimeError):
    """A JAX internal jaxmp relies on is missing or changed shape in this JAX release."""


def _missing(what: str, where: str) -> JaxInternalsError:
    return JaxInternalsError(
        f"jaxmp.autocast: {where} has no {what!r} in jax {jax.__version__}; this JAX release changed an "
        "internal the engine reads. Please report it with your JAX version; `python -m jaxmp.selfcheck` "
        "shows which constructs still hold.")


def param(eqn: Any, name: str) -> Any:
    """``eqn.params[name]``, or a `JaxInternalsError` naming the parameter and JAX version."""
    try:
        return eqn.params[name]
    except KeyError:
        raise _missing(name, f"the {eqn.primitive.name!r} primitive") from None


def primitive_kind(eqn: Any) -> str | None:
    """Which control-flow construct ``eqn`` is (its class in the op catalogue, `jaxmp._ops`):
    ``"call"``, ``"remat"``, ``"scan"``, ``"while"``, ``"cond"``, ``"custom_jvp"``,
    ``"custom_vjp"``, ``"shard_map"``, ``"pmap"``, or None (first order)."""
    return _ops.control_flow_kind(eqn.primitive.name)


#: How each control-flow kind runs its bodies: the one table the walks that enter them read (the
#: engine's handlers, the debugger's evaluator, the op finder's FLOP count, `per_element_inputs`).
#: ``"inline"``: one body run once on the operands, its outputs the equation's; ``"loop"``: a body
#: run ``length`` times (scan) or an unknown number of times (while); ``"branch"``: one body of
#: several (cond); ``"mapped"``: a per-device body (shard_map, pmap). Its kinds are the catalogue's
#: control-flow classes (`jaxmp._ops.CONTROL_FLOW`).
KIND_RUNS: dict[str, str] = {
    "call": "inline", "remat": "inline", "custom_jvp": "inline", "custom_vjp": "inline",
    "scan": "loop", "while": "loop", "cond": "branch", "shard_map": "mapped", "pmap": "mapped",
}
INLINE = frozenset(k for k, runs in KIND_RUNS.items() if runs == "inline")
LOOPS = frozenset(k for k, runs in KIND_RUNS.items() if runs == "loop")
BRANCHES = frozenset(k for k, runs in KIND_RUNS.items() if runs == "branch")
MAPPED = frozenset(k for k, runs in KIND_RUNS.items() if runs == "mapped")


def dispatch(eqn: Any, handlers: Mapping[str, _H]) -> tuple[str, _H] | None:
    """The kind of a control-flow equation and the handler a walk keeps for it, or None.

    The one dispatch of the walks that enter control flow: each keeps a table ``{kind: handler}``
    of the kinds it enters (the engine enters all but ``pmap``; the evaluator no mapped body).

    Args:
      eqn: an equation.
      handlers: the walk's table, keyed by kinds of `KIND_RUNS`.

    Returns:
      ``(kind, handler)``, or None for a first-order equation or a kind the table leaves out.

    Example:
      >>> import jax
      >>> import jaxmp
      >>> def f(x):
      ...     return jax.lax.cond(x > 0, lambda: x, lambda: -x)
      >>> eqn = jax.make_jaxpr(f)(1.0).jaxpr.eqns[-1]
      >>> jaxmp._jaxpr.dispatch(eqn, {"cond": "enter the branches"})
      ('cond', 'enter the branches')
    """
    kind = primitive_kind(eqn)
    if kind is None or kind not in handlers:
        return None
    return kind, handlers[kind]


def call_jaxpr(eqn: Any) -> tuple[Any, list]:
    """(open jaxpr, consts) of a call-like equation (``jit``, ``closed_call``, ``eval_jaxpr`` ...)."""
    for name in ("jaxpr", "call_jaxpr"):
        if name in eqn.params:
            found = eqn.params[name]
            return open_jaxpr(found), list(getattr(found, "consts", ()))
    raise _missing("jaxpr", f"the call primitive {eqn.primitive.name!r}")


def scan_counts(eqn: Any) -> tuple[int, int]:
    """(number of consts, number of carries) of a ``scan`` equation."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    if "ft_in" in p:
        consts, carry, _ = p["ft_in"].unpack()
        return len(consts), len(carry)
    raise _missing("num_consts", "the 'scan' primitive")


def while_parts(eqn: Any) -> tuple[Any, Any, int, int]:
    """(cond closed jaxpr, body closed jaxpr, cond consts, body consts) of a ``while`` equation."""
    return (param(eqn, "cond_jaxpr"), param(eqn, "body_jaxpr"), param(eqn, "cond_nconsts"),
            param(eqn, "body_nconsts"))


class Body(NamedTuple):
    """One sub-jaxpr a control-flow equation runs (see `bodies`).

    Attributes:
      jaxpr: the open jaxpr.
      consts: the values of its constvars (a closed jaxpr's consts; empty for an open one).
      operands: per input of ``jaxpr``, the position among the equation's operands it is bound to
        (a scanned input gets one slice of it per iteration).
      carries: the positions among ``jaxpr``'s inputs that are loop carries (``scan``, ``while``).
      label: where it runs, as the diagnostics print it: ``""`` (a call, inlined), ``"scan x10"``,
        ``"while"``, ``"cond branch 0/2"``, ``"shard_map"``, ``"pmap"``.
      trips: how many times it runs per run of the equation (a scan's length; None: a while
        loop's, unknown; 1 otherwise, a cond branch at most once).
    """

    jaxpr: Any
    consts: list
    operands: tuple[int, ...]
    carries: frozenset[int]
    label: str
    trips: int | None


def _body(closed: Any, operands, label: str = "", trips: int | None = 1, carries=()) -> Body:
    return Body(open_jaxpr(closed), list(getattr(closed, "consts", ())), tuple(operands), frozenset(carries),
                label, trips)


def bodies(eqn: Any) -> list[Body]:
    """The sub-jaxprs of a control-flow equation (`primitive_kind`), with how their inputs map onto
    its operands: the one table of which parameters hold them. Empty for a first-order equation
    (a combiner's jaxpr, say, is not control flow: `sub_jaxprs` lists every jaxpr parameter).

    Args:
      eqn: an equation.

    Returns:
      A list of `Body`, in the order JAX runs them (a ``while``: cond, then body; a ``cond``:
      branch 0, 1 ...).

    Raises:
      JaxInternalsError: a parameter the construct had is missing in this JAX release.
    """
    kind = primitive_kind(eqn)
    n = len(eqn.invars)
    if kind == "call":
        jaxpr, consts = call_jaxpr(eqn)
        return [Body(jaxpr, consts, tuple(range(n)), frozenset(), "", 1)]
    if kind in ("remat", "shard_map"):
        return [_body(param(eqn, "jaxpr"), range(n), "shard_map" if kind == "shard_map" else "")]
    if kind == "pmap":
        return [_body(param(eqn, "call_jaxpr"), range(n), "pmap")]
    if kind in ("custom_jvp", "custom_vjp"):
        return [_body(param(eqn, "call_jaxpr"), range(n))]
    if kind == "scan":
        nc, ncarry = scan_counts(eqn)
        length = param(eqn, "length")
        return [_body(param(eqn, "jaxpr"), range(n), f"scan x{length}", int(length), range(nc, nc + ncarry))]
    if kind == "while":
        cj, bj, cn, bn = while_parts(eqn)
        carry = range(cn + bn, n)
        return [_body(cj, [*range(cn), *carry], "while", None, range(cn, cn + len(carry))),
                _body(bj, [*range(cn, cn + bn), *carry], "while", None, range(bn, bn + len(carry)))]
    if kind == "cond":
        branches = param(eqn, "branches")
        return [_body(b, range(1, n), f"cond branch {i}/{len(branches)}") for i, b in enumerate(branches)]
    return []


# -- per-element dependencies ------------------------------------------------------------

def per_element_inputs(closed: Any) -> list[frozenset[int] | None]:
    """For each output of a jaxpr: the inputs it reads element by element, or None.

    An output is per element when each of its elements is computed from the same element of each
    non-scalar input it reads, and from scalar inputs, through ops of the catalogue's
    ``per_element`` fact, broadcasts of scalars, and any op on scalars alone; calls, remat and
    custom-derivative calls are entered. Such an output can be computed a slice at a time from
    the same slices of its inputs (jaxmp.lean's chunked update relies on it). Anything else (a
    reduction, a reshape, a matmul, a loop over arrays, a constant array) makes it None.

    Args:
      closed: a ``Jaxpr`` or ``ClosedJaxpr`` (``jax.make_jaxpr``'s).

    Returns:
      One entry per output: the positions (in ``invars``) it reads, or None.
    """
    jaxpr = open_jaxpr(closed)
    seeds = [("scalar" if _shape_of(v) == () else "elem", frozenset({i})) for i, v in enumerate(jaxpr.invars)]
    return [None if out is None else out[1] for out in _per_element(jaxpr, seeds)]


def _shape_of(atom: Any) -> tuple | None:
    return tuple(getattr(getattr(atom, "aval", None), "shape", None) or ()) if hasattr(atom, "aval") else None


def _per_element(jaxpr: Any, seeds: list) -> list:
    # A value is ("scalar", inputs), ("elem", inputs) or None (not per element).
    env: dict = dict(zip(jaxpr.invars, seeds))
    for v in jaxpr.constvars:
        env[v] = ("scalar", frozenset()) if _shape_of(v) == () else None
    per_element = _ops.having("per_element")

    def read(atom):
        if not is_var(atom):
            return ("scalar", frozenset()) if _shape_of(atom) == () else None
        return env.get(atom)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs_scalar = all(_shape_of(v) == () for v in eqn.outvars)
        deps = frozenset().union(*(x[1] for x in ins if x is not None))
        if primitive_kind(eqn) in INLINE:
            body = bodies(eqn)[0]
            if len(body.jaxpr.outvars) == len(eqn.outvars) and len(body.operands) == len(body.jaxpr.invars):
                outs = _per_element(body.jaxpr, [ins[i] for i in body.operands])
                env.update(zip(eqn.outvars, outs))
                continue
            outs = [None] * len(eqn.outvars)
        elif all(x is not None and x[0] == "scalar" for x in ins) and outs_scalar:
            outs = [("scalar", deps)] * len(eqn.outvars)   # any op on scalars alone
        elif any(x is None for x in ins):
            outs = [None] * len(eqn.outvars)
        elif eqn.primitive.name == "broadcast_in_dim":
            outs = [("elem", deps) if all(x[0] == "scalar" for x in ins) else None]
        elif eqn.primitive.name in per_element:
            shape = _shape_of(eqn.outvars[0])
            same = all(x[0] == "scalar" or _shape_of(v) == shape for v, x in zip(eqn.invars, ins))
            outs = [("elem", deps) if same else None] * len(eqn.outvars)
        else:
            outs = [None] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


# -- name stacks -----------------------------------------------------------------------------

class StackItem(NamedTuple):
    """One entry of a name stack: a ``jax.named_scope`` (``kind="scope"``) or a transformation
    JAX applied (``kind="transform"``: ``jvp``, ``transpose``, ``vmap`` ...)."""

    kind: str
    name: str


def stack_of(eqn: Any) -> tuple[StackItem, ...]:
    """``eqn``'s own name stack as data, outermost first (relative to an enclosing equation)."""
    return _stack_items(eqn.source_info.name_stack)


def current_stack() -> tuple[StackItem, ...]:
    """The name stack of the code being traced now (its module path while autocast re-binds an
    equation: `equation_context`), as data, outermost first."""
    from jax._src import source_info_util

    return _stack_items(source_info_util.current_name_stack())


def _stack_items(stack: Any) -> tuple[StackItem, ...]:
    items = getattr(stack, "stack", None)
    if items is None:  # an older form: a string
        text = str(stack)
        return tuple(StackItem("scope", c) for c in text.split("/") if c) if text else ()
    return tuple(StackItem("transform" if type(i).__name__ == "Transform" else "scope", i.name) for i in items)


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` names around ``eqn``, outermost first, read structurally.

    JAX records transformations in the name stack too and prints them around the scopes they
    apply to (``jvp(jaxmp[float32]:head)``, ``transpose(...)``, ``vmap(...)``). A rule keyed on a
    scope must hold whatever transformation ran inside the region, so only the scopes count.
    """
    return tuple(i.name for i in stack_of(eqn) if i.kind == "scope")


def render(stack: tuple[StackItem, ...]) -> str:
    """A name stack as JAX prints it: scopes joined by ``/``, a transformation wrapping the scope
    after it (``a/jvp(b)``). For display only: read `StackItem`s, never this text."""
    parts: list[str] = []
    for item in reversed(stack):
        if item.kind == "scope":
            parts.append(item.name)
        elif parts:
            parts[-1] = f"{item.name}({parts[-1]})"
        else:
            parts.append(f"{item.name}()")
    return "/".join(reversed(parts))


# -- source lines ----------------------------------------------------------------------------

def user_frames(eqn: Any) -> list:
    """The user's frames of the traceback that emitted ``eqn``, innermost first (each with
    ``file_name``, ``start_line``, ``start_column``, ``function_name``); empty when unknown."""
    from jax._src import source_info_util

    traceback = getattr(eqn.source_info, "traceback", None)
    return list(source_info_util.user_frames(traceback)) if traceback is not None else []


def source_line(eqn: Any) -> str:
    """``file:line`` of the innermost user frame that emitted ``eqn`` (``""`` when unknown)."""
    frames = user_frames(eqn)
    return f"{frames[0].file_name}:{frames[0].start_line}" if frames else ""


# -- the recursive walk ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Equation:
    """One equation met by `walk`, with where it sits.

    Attributes:
      eqn: JAX's equation (its ``invars``/``outvars`` are the operands for data-flow walks).
      stack: the full name stack: the enclosing equations' stacks, then its own.
      parent: the equation whose sub-jaxpr holds it (None at the top).
      depth: how many equations enclose it.
    """

    eqn: Any
    stack: tuple[StackItem, ...] = ()
    parent: "Equation | None" = None
    depth: int = 0

    @property
    def primitive(self) -> str:
        """The primitive's name (``"dot_general"``, ``"scan"``, ``"pjit"``...)."""
        return self.eqn.primitive.name

    @property
    def params(self) -> dict:
        return self.eqn.params

    @property
    def invars(self) -> list:
        return self.eqn.invars

    @property
    def outvars(self) -> list:
        return self.eqn.outvars

    @property
    def in_avals(self) -> tuple:
        return tuple(a.aval for a in self.eqn.invars)

    @property
    def out_avals(self) -> tuple:
        return tuple(a.aval for a in self.eqn.outvars)

    @property
    def scopes(self) -> tuple[str, ...]:
        """The module path: the named scopes of the full stack, outermost first."""
        return tuple(i.name for i in self.stack if i.kind == "scope")

    @property
    def transforms(self) -> tuple[str, ...]:
        """The transformations in the full stack (``"jvp"``, ``"transpose"``...), outermost first."""
        return tuple(i.name for i in self.stack if i.kind == "transform")

    @property
    def name(self) -> str:
        """The full stack as JAX prints it (display only)."""
        return render(self.stack)

    @property
    def source(self) -> str:
        """``file:line`` of the user code that emitted it (read lazily: it walks a traceback)."""
        return source_line(self.eqn)


def walk(jaxpr: Any, stack: tuple[StackItem, ...] = ()) -> Iterator[Equation]:
    """Every equation of ``jaxpr`` and, after each, those of its sub-jaxprs (pre-order): ``pjit``
    bodies, ``cond`` branches, ``scan``/``while`` bodies, ``custom_jvp``/``custom_vjp`` primals,
    ``remat``, ``shard_map``.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      stack: a name stack to put in front of every equation's (the caller's context).

    Returns:
      An iterator of `Equation`.
    """
    yield from _walk(open_jaxpr(jaxpr), tuple(stack), None, 0)


def _walk(jaxpr, stack, parent, depth) -> Iterator[Equation]:
    for eqn in jaxpr.eqns:
        here = Equation(eqn, stack + stack_of(eqn), parent, depth)
        yield here
        for sub in sub_jaxprs(eqn, opened=True):
            yield from _walk(sub, here.stack, here, depth + 1)


# -- binding ---------------------------------------------------------------------------------

def bind(eqn: Any, args, params: dict | None = None) -> list:
    """Binds ``eqn``'s primitive on ``args`` with ``params`` (its own when None); a list of outputs.

    Parameters as found in a jaxpr are not always those ``bind`` takes (a call's jaxpr is a
    function there): JAX's ``get_bind_params`` converts them.

    Args:
      eqn: the equation whose primitive is bound.
      args: the operands.
      params: parameters as found in a jaxpr, or None for ``eqn.params``.

    Returns:
      The outputs, a list (one element for a single-result primitive).
    """
    return bind_primitive(eqn.primitive, eqn.params if params is None else params, *args)


def bind_primitive(prim: Any, params: dict, *args: Any) -> list:
    """Binds ``prim`` on ``args`` with ``params`` as found in a jaxpr (see `bind`); a list of outputs."""
    bound = prim.get_bind_params(params)
    if isinstance(bound, tuple):  # older JAX: (subfuns, params)
        subfuns, bound = bound
        out = prim.bind(*subfuns, *args, **bound)
    else:
        out = prim.bind(*args, **bound)
    return list(out) if prim.multiple_results else [out]


@contextlib.contextmanager
def equation_context(eqn: Any):
    """Re-binding ``eqn``'s primitive keeps its source location, name stack and context managers."""
    from jax._src import source_info_util

    stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
        yield
