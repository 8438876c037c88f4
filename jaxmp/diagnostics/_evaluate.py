"""Re-evaluating a traced program op by op, with a hook per op and a state carried through loops.

Every op gets a `Site` (primitive, module path, backward or not, the autocast rule in explain
mode, source line); the re-run is one ``jax.jit``. See
docs/architecture.md#re-evaluating-a-step-the-precision-debugger.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp import _jaxpr, _ops
from jaxmp._jaxpr import BRANCHES, INLINE, LOOPS, MAPPED, dispatch, primitive_kind
from jaxmp.diagnostics import _format
from jaxmp.diagnostics._find_ops import source_of
from jaxmp.engine._seams import internals
from jaxmp.engine._seams import MARKER

_RULE = "jaxmp.rule="


@dataclasses.dataclass(frozen=True)
class Site:
    """One first-order op of the program, where it is and who chose its dtype.

    Attributes:
      index: its position in the (pre-order) walk of the program.
      eqn: the equation.
      primitive: the primitive's name.
      path: the module path: name scopes without autocast's marker and rule scopes, joined by ``/``.
      backward: the op belongs to a gradient (its name stack has a ``transpose`` transformation).
      rule: the autocast rule that chose its dtype (explain mode), ``""`` outside autocast.
      region: the innermost ``jaxmp[...]`` region marker around it, ``""`` if none.
      context: the enclosing loops, e.g. ``"scan x10"``.
      from_param: ``path`` is named after the parameter the op reads (NNX, Equinox: no instance
        scope), so no scope rule can match it.
    """

    index: int
    eqn: Any
    primitive: str
    path: str
    backward: bool
    rule: str
    region: str
    context: str
    from_param: bool = False

    @property
    def source(self) -> str:
        """``file:line (function)`` of the user code that emitted the op (read lazily: it walks a traceback)."""
        return source_of(self.eqn)

    @property
    def in_dtypes(self) -> tuple[str, ...]:
        return tuple(_short(a) for a in self.eqn.invars)

    @property
    def out_dtypes(self) -> tuple[str, ...]:
        return tuple(_short(a) for a in self.eqn.outvars)

    @property
    def half(self) -> bool:
        """Whether a floating operand or result of the op is half precision (it rounds)."""
        return any(_format.is_low_precision(d) for d in _dtypes(self.eqn.invars) + _dtypes(self.eqn.outvars))


def _dtypes(atoms) -> list:
    out = []
    for a in atoms:
        dtype = getattr(getattr(a, "aval", None), "dtype", None)
        if dtype is not None and _format.is_floating(dtype):
            out.append(dtype)
    return out


def _short(atom) -> str:
    dtype = getattr(getattr(atom, "aval", None), "dtype", None)
    if dtype is None:
        return "?"
    try:
        return _format.short_dtype(dtype)
    except TypeError:
        return str(dtype)


@dataclasses.dataclass(frozen=True)
class _Where:
    scopes: tuple[str, ...] = ()
    backward: bool = False
    context: tuple[str, ...] = ()


def _where(eqn, outer: _Where) -> _Where:
    stack = _jaxpr.stack_of(eqn)
    transforms = {i.name for i in stack if i.kind == "transform"}
    return _Where(outer.scopes + tuple(i.name for i in stack if i.kind == "scope"), outer.backward or "transpose" in transforms,
                  outer.context)


def _site(index: int, eqn, where: _Where) -> Site:
    rules = [s[len(_RULE):] for s in where.scopes if s.startswith(_RULE)]
    markers = [s for s in where.scopes if MARKER.match(s)]
    path = "/".join(s for s in where.scopes if not s.startswith(_RULE) and not MARKER.match(s))
    rule = next((r for r in rules if "fp8" in r), rules[-1] if rules else "")
    return Site(index, eqn, eqn.primitive.name, path, where.backward, rule, markers[-1] if markers else "",
                " > ".join(where.context))


def _inner(eqn, maps: bool = False) -> list[tuple[Any, str]]:
    """The jaxprs this evaluator enters for ``eqn`` with a context label ("" for inlined calls).

    ``maps``: also the per-device bodies of ``shard_map`` and ``pmap`` (the static walks of
    strict mode: the evaluator itself runs a mapped program as one op).
    """
    if primitive_kind(eqn) in MAPPED and not maps:
        return []
    return [(body.jaxpr, body.label) for body in _jaxpr.bodies(eqn)]


#: Ops whose result is still "the parameter" (its cast, its copy) for naming what reads it.
_CARRIES_PARAM = _ops.having("carries_param")
_PARAM_LEAVES = frozenset({"kernel", "bias", "weight", "scale", "embedding", "value", "w", "b", "raw_value"})


def module_of(keypath: str) -> str:
    """``"[0][0]['params']['sched']['kernel']"`` or ``"[0][0].sched.kernel.value"`` -> ``"sched"``."""
    parts = [p for p in re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", keypath)]
    names = [a or b or (f"[{c}]" if c else "") for a, b, c in parts]
    names = [n for n in names if n]
    while names and names[0].startswith("["):  # the argument's position (a bare data array: no module)
        names = names[1:]
    while names and names[-1] in _PARAM_LEAVES:
        names = names[:-1]
    if names and names[0] == "params":  # Linen's collection name
        names = names[1:]
    return "/".join(n.strip("[]") if n.startswith("[") else n for n in names)


def _unnamed(path: str) -> bool:
    """No instance name in ``path``: empty, or only class scopes (Equinox's ``eqx.nn.Linear``, NNX's
    ``Linear``, which the parameter's path replaces: ``sched`` says which of the model's Linears it is)."""
    # A class name: Equinox's dotted ``eqx.nn.Linear``, or the bare ``Linear`` that the Flax
    # NNX door's per-call scope is (instance names are attribute names, lower case).
    return all("." in part or part[:1].isupper() for part in path.split("/")) if path else True


class Sites:
    """Every first-order op of a program, numbered in one pre-order walk (entered constructs nested).

    Args:
      jaxpr: the program (an open jaxpr).
      leaf_paths: the key paths of its inputs (names the ops of modules without a scope).
      maps: enter ``shard_map`` and ``pmap`` bodies (static walks only: `evaluate` cannot).
    """

    def __init__(self, jaxpr, leaf_paths: Sequence[str] | None = None, maps: bool = False):
        self.sites: list[Site] = []
        self._maps = maps
        self._ids: dict[tuple, int] = {}
        # Frameworks that emit no name scope per module instance (Flax NNX; Equinox names the class,
        # not the attribute) still say which parameter an op reads: a site without an instance
        # path is named after the module of the parameter it consumes (``.sched.kernel`` -> ``sched``).
        origin = {}
        if leaf_paths is not None and len(leaf_paths) == len(jaxpr.invars):
            origin = {v: m for v, m in zip(jaxpr.invars, map(module_of, leaf_paths)) if m}
        self._walk(jaxpr, _Where(), (), origin)

    def _walk(self, jaxpr, where: _Where, key: tuple, origin: dict) -> None:
        for eqn in _jaxpr.equations(jaxpr):
            w = _where(eqn, where)
            inner = _inner(eqn, self._maps)
            from_param = next((origin[a] for a in eqn.invars if not _jaxpr.is_literal(a) and a in origin), "")
            if inner:
                for body in _jaxpr.bodies(eqn):
                    j, label = body.jaxpr, body.label
                    ctx = w.context + ((label,) if label else ())
                    # A body's inputs are the operands the dispatcher binds them to.
                    outer = [eqn.invars[i] for i in body.operands]
                    sub = {b: origin[a] for b, a in zip(j.invars, outer)
                           if not _jaxpr.is_literal(a) and a in origin}
                    self._walk(j, dataclasses.replace(w, context=ctx), key + (id(eqn), label), sub)
                    if not label and len(j.outvars) == len(eqn.outvars):  # an inlined call passes them on
                        origin.update({o: sub[r] for o, r in zip(eqn.outvars, j.outvars)
                                       if not _jaxpr.is_literal(r) and r in sub})
                continue
            self._ids[key + (id(eqn),)] = len(self.sites)
            site = _site(len(self.sites), eqn, w)
            if from_param and _unnamed(site.path):
                site = dataclasses.replace(site, path=from_param, from_param=True)
            self.sites.append(site)
            if from_param and eqn.primitive.name in _CARRIES_PARAM:
                origin.update({o: from_param for o in eqn.outvars})

    def __len__(self) -> int:
        return len(self.sites)

    def index(self, eqn, key: tuple) -> int:
        return self._ids[key + (id(eqn),)]


class Hooks:
    """What an evaluation does with values; subclasses say how values look and what each op records.

    A *value* is whatever the subclass keeps per variable (an array; a pair of arrays); it must be
    a pytree of arrays with the variable's leading axis, so that ``lax.scan`` can slice it.
    """

    def lift(self, x: Any, aval: Any) -> Any:
        """The value of a concrete array (an argument or a closed-over constant)."""
        return x

    def literal(self, atom) -> Any:
        return self.lift(np.asarray(atom.val, atom.aval.dtype), atom.aval)

    def index(self, value: Any) -> Any:
        """The integer or boolean array that a ``cond`` branch index or ``while`` predicate is."""
        return value

    def first_order(self, site: Site, eqn, ins: list, state: Any) -> tuple[list, Any]:
        """Runs one op; returns its output values and the new state."""
        raise NotImplementedError

    def barrier(self, values: list) -> list:
        """Values entering a ``while`` loop (reverse-mode differentiation cannot cross one)."""
        return values

    def flush(self, state: Any) -> Any:
        """Folds what the ops since the last flush recorded into ``state`` (before a loop, at a body's end)."""
        return state


def bind(eqn, args: Sequence[Any], params: dict | None = None) -> list:
    """Binds ``eqn``'s primitive on ``args`` with its (or the given) parameters."""
    return internals.bind(eqn, list(args), eqn.params if params is None else params)


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any], state: Any, hooks: Hooks, sites: Sites,
             key: tuple = ()) -> tuple[list, Any]:
    """Evaluates ``jaxpr`` on hook values; returns the output values and the final state.

    Args:
      jaxpr: an open jaxpr (the program, or a body inside it).
      consts: values of its constvars.
      args: values of its invars.
      state: the hook's state (a pytree of arrays with a fixed structure).
      hooks: the `Hooks`.
      sites: the `Sites` of the whole program.
      key: where ``jaxpr`` sits in the program (internal: the enclosing equations).

    Returns:
      ``(outputs, state)``.
    """
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a

    def read(atom):
        return hooks.literal(atom) if _jaxpr.is_literal(atom) else env[atom]

    for eqn in _jaxpr.equations(jaxpr):
        ins = [read(a) for a in eqn.invars]
        found = dispatch(eqn, _ENTER) if _inner(eqn) else None
        if found is None:
            outs, state = hooks.first_order(sites.sites[sites.index(eqn, key)], eqn, ins, state)
        else:
            kind, enter = found
            if kind in LOOPS | BRANCHES:
                state = hooks.flush(state)
            outs, state = enter(eqn, ins, state, hooks, sites, key + (id(eqn),))
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(a) for a in jaxpr.outvars], hooks.flush(state)


def _lift_all(hooks: Hooks, body) -> list:
    return [hooks.lift(c, internals.typeof(c)) for c in body.consts]


def _inline(eqn, ins, state, hooks, sites, key):
    (body,) = _jaxpr.bodies(eqn)
    return evaluate(body.jaxpr, _lift_all(hooks, body), ins, state, hooks, sites, key + (body.label,))


def _scan(eqn, ins, state, hooks, sites, key):
    (closed,) = _jaxpr.bodies(eqn)
    nc, ncarry = internals.scan_counts(eqn)
    length = internals.param(eqn, "length")
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    body_consts = _lift_all(hooks, closed)
    label = closed.label

    def body(carry, x):
        c, st = carry
        outs, st = evaluate(closed.jaxpr, body_consts, [*consts, *c, *x], st, hooks, sites, key + (label,))
        return (outs[:ncarry], st), outs[ncarry:]

    (carry, state), ys = jax.lax.scan(body, (list(init), state), list(xs), length=length,
                                      reverse=internals.param(eqn, "reverse"))
    return [*carry, *ys], state


def _while(eqn, ins, state, hooks, sites, key):
    _, _, cn, bn = internals.while_parts(eqn)
    cj, bj = _jaxpr.bodies(eqn)
    ins = hooks.barrier(list(ins))
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    cc, bc = hooks.barrier(_lift_all(hooks, cj)), hooks.barrier(_lift_all(hooks, bj))

    def cond_fn(carry):
        c, st = carry
        outs, _ = evaluate(cj.jaxpr, cc, [*cconsts, *c], st, hooks, sites, key + (cj.label,))
        return hooks.index(outs[0])

    def body_fn(carry):
        c, st = carry
        outs, st = evaluate(bj.jaxpr, bc, [*bconsts, *c], st, hooks, sites, key + (bj.label,))
        return outs, st

    out, state = jax.lax.while_loop(cond_fn, body_fn, (list(init), state))
    return out, state


def _cond(eqn, ins, state, hooks, sites, key):
    branches = _jaxpr.bodies(eqn)
    index, ops = ins[0], ins[1:]

    def branch(b):
        consts = _lift_all(hooks, b)

        def run(ops, st):
            return evaluate(b.jaxpr, consts, ops, st, hooks, sites, key + (b.label,))
        return run

    fns = [branch(b) for b in branches]
    idx = hooks.index(index)
    if np.dtype(idx.dtype) == np.dtype(bool):
        idx = idx.astype(np.int32)
    return jax.lax.switch(idx, fns, list(ops), state)


#: The kinds the evaluator enters (a mapped body runs as one op), read through `jaxmp._jaxpr.dispatch`.
_ENTER: dict[str, Callable] = {**dict.fromkeys(INLINE, _inline), "scan": _scan, "while": _while, "cond": _cond}


#: Compiler options of the debugger's programs: XLA may otherwise keep a half value in float32
#: inside a fusion (``xla_allow_excess_precision``), and an overflow or a rounding the program
#: asks for would not show. The debugger measures what the dtypes say.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}

#: Added where the backend accepts them: the debugger's programs run once or a few times, so
#: XLA's backend optimization (LLVM codegen; about half of a CPU compile of the instrumented
#: program) costs more than it saves. It changes code generation only, not the HLO the numbers
#: come from (``benchmarks/debugger.py`` measures the gain).
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


def _signature(args: Sequence[Any]) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


@functools.lru_cache(maxsize=None)
def _pool():
    """Two threads that compile the debugger's programs in the background (XLA releases the GIL);
    made on first use, shared by every call."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxmp-debugger-compile")


def _compile(lowered) -> Any:
    for options in ({**COMPILER_OPTIONS, **FAST_COMPILE_OPTIONS}, COMPILER_OPTIONS):
        try:
            return lowered.compile(compiler_options=options)
        except Exception:  # noqa: BLE001 - a backend without the option: try fewer
            continue
    return lowered.compile()


class StrictJit:
    """``fn`` compiled with `COMPILER_OPTIONS` (and `FAST_COMPILE_OPTIONS`), once per input shapes.

    A drop-in for ``jax.jit(fn)`` in the debugger: the k-step comparison and the fix call the
    same program on new parameters of the same shapes, and compile it once. `prepare` starts
    the compile in a background thread, so that programs the debugger needs later compile while
    it traces or runs others.

    Args:
      fn: the function to stage (positional arguments only).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: dict = {}

    def prepare(self, *args) -> "StrictJit":
        """Lowers ``fn`` for ``args`` (arrays or ``jax.ShapeDtypeStruct``) now and compiles it in the background.

        Returns:
          ``self``; a later call with arguments of these shapes waits for the compile.
        """
        key = _signature(args)
        if key not in self.compiled:
            self.compiled[key] = _pool().submit(_compile, jax.jit(self.fn).lower(*args))
        return self

    def __call__(self, *args):
        key = _signature(args)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = _compile(jax.jit(self.fn).lower(*args))
        elif not callable(compiled):  # a background compile (`prepare`): wait for it
            compiled = self.compiled[key] = compiled.result()
        return compiled(*args)


def compile_strict(fn: Callable, *args) -> Any:
    """``StrictJit(fn)(*args)``: ``fn`` compiled for ``args`` with the debugger's options, called at once."""
    return StrictJit(fn)(*args)


def leaf_paths(args: Sequence[Any], kwargs: dict) -> list[str]:
    """The key path of every leaf of ``(args, kwargs)``, in the order of the traced program's inputs."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path((tuple(args), kwargs))]


def trace(fn: Callable, args: Sequence[Any], kwargs: dict) -> tuple[Any, Any]:
    """``fn(*args, **kwargs)`` traced in explain mode: ``(closed jaxpr, output tree)``.

    Explain mode makes `jaxmp.autocast` record the rule of every op it emits, which the
    sites read back; under `jaxmp.engine._build.debugger_tracing` a jaxmp sharded step that
    ``fn`` calls differentiates its loss outside its ``shard_map``, so its ops are in the
    program. Arguments are flattened: the jaxpr's invars are the array leaves.
    """
    from jaxmp.engine._seams import debugger_tracing, explaining

    if not callable(fn):
        raise TypeError(f"expected a callable (a loss function or a train step), got {type(fn).__name__}: {fn!r}")
    from jaxmp._misuse import loss_scaled_grad

    # The debugger's own differentiation is no user's unscaled float16 gradient: no warning for it.
    # A jaxmp step called inside ``fn`` runs its loss outside its shard_map (one op to the evaluator).
    with explaining(), loss_scaled_grad(), debugger_tracing():
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    return closed, jax.tree_util.tree_structure(shape)
