"""The engine function: trace a function once per input signature, then re-evaluate it under the rules.

The public entry points that build one (``jaxmp.autocast``, ``engine_function``) are in
`jaxmp.engine._autocast_fn`; `build` is autocast without the canary they start.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable

import jax
import numpy as np
from jaxmp.engine import _config
from jaxmp.engine import _internals as internals, _unscaled as unscaled
from jaxmp.engine._attention import route_attention
from jaxmp.engine._interpreter import Interpreter, repeated_ops
from jaxmp.engine._values import Val, dtype_of, is_float, saturate
from jaxmp.engine._modules import apply_module_rules, recording_classes
from jaxmp.engine._rules import AutocastRules, marker
from jaxmp._dtypes import cast_floating

_CACHE_SIZE = 64

# The traced programs of every autocast function built from the same function object and
# settings, shared: ``jaxmp.autocast(f)`` rebuilt inside an eager loop would otherwise trace and
# compile again on every call (about 2 s a step for a 4-layer MLP on CPU, against 5 ms). Keyed
# on the function's identity and held weakly, as ``jax.jit``'s cache is: the entry goes when the
# function does, and the programs never reference the function itself.
_SHARED: dict[int, tuple[Any, dict]] = {}


def _shared_programs(fn: Callable, key: Any) -> collections.OrderedDict:
    """The program cache for ``(fn, key)``, shared by every autocast function built from them."""
    try:
        hash(key)
        entry = _SHARED.get(id(fn))
        if entry is None or entry[0]() is not fn:
            ident = id(fn)
            # A bound method or any object that takes no weak reference gets a cache of its own.
            ref = weakref.ref(fn, lambda _, ident=ident: _SHARED.pop(ident, None))
            entry = _SHARED[ident] = (ref, {})
    except TypeError:
        return collections.OrderedDict()
    return entry[1].setdefault(key, collections.OrderedDict())

#: While True (see `explaining`), each op carries the rule that chose its dtype. A jit
#: cache key, so a step traced for a report is never reused by training.
_EXPLAIN = internals.jit_key_state(
    "jaxmp_autocast_explain", False,
    "autocast wraps each op in a jaxmp.rule=<rule> name scope (for jaxmp.precision_report).", kind="bool")


@contextlib.contextmanager
def explaining():
    """While active, autocast wraps each op it emits in a ``jaxmp.rule=<rule>`` name scope.

    [`jaxmp.precision_report`][jaxmp.diagnostics._precision_report.precision_report] traces under it; `jaxmp.diagnostics._autocast_ops`
    reads the scopes back.

    Yields:
      Nothing.
    """
    with _EXPLAIN(True):
        yield


def explain_enabled() -> bool:
    """Whether `explaining` is active (ops outside the engine label themselves then, e.g. fp8 layers).

    Returns:
      True while [`jaxmp.precision_report`][jaxmp.diagnostics._precision_report.precision_report] traces a step.
    """
    return bool(_EXPLAIN.value)


#: While True (see `debugger_tracing`), jaxmp's own train steps run the loss they wrap without a
#: ``shard_map``: the debugger evaluates a program op by op and runs a ``shard_map`` as one op, so
#: the float32 shadow of a step called inside a traced function would otherwise be the policy run
#: itself. A jit cache key, so a step traced for the debugger is never reused by training.
_DEBUGGER = internals.jit_key_state(
    "jaxmp_debugger_trace", False,
    "jaxmp's train steps run their loss on the global batch, outside any shard_map (the precision debugger traces).",
    kind="bool")


@contextlib.contextmanager
def debugger_tracing():
    """While active, jaxmp's sharded train steps differentiate their loss on the global batch.

    The precision debugger (`jaxmp.diagnostics._evaluate.trace`) traces under it, so a function
    that calls ``make_sharded_train_step``'s step has every op of the loss in its program, as the
    step's own ``loss_view`` has.

    Yields:
      Nothing.
    """
    with _DEBUGGER(True):
        yield


def debugger_tracing_enabled() -> bool:
    """Whether `debugger_tracing` is active.

    Returns:
      True while the precision debugger traces a function.
    """
    return bool(_DEBUGGER.value)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(eq=False)
class _Program:
    """One traced signature: the jaxpr, the output tree, and a jitted runner for eager calls."""

    closed: Any
    out_tree: Any
    config: _config.AutocastConfig
    has_tracer_consts: bool
    cast_outputs: bool = True
    label: str = "an autocast function"  # names the function in warnings

    def __post_init__(self):
        self.jitted = jax.jit(self.call)
        self._weights = None
        self._repeated = None

    def weights(self) -> list[bool]:
        """Which inputs are weights (cast on entry under O2): every use is a half-list op."""
        if self._weights is None:
            self._weights = weight_mask(self.closed.jaxpr, self.config)
        return self._weights

    def repeated(self) -> frozenset:
        """The equations whose op occurs more than once in the program (bound staged under grad/vmap)."""
        if self._repeated is None:
            self._repeated = repeated_ops(self.closed.jaxpr)
        return self._repeated

    def run(self, *xs):
        interp = Interpreter(self.config, explain=_EXPLAIN.value, repeated=self.repeated)
        consts = self.closed.consts
        if self.config.compute_dtype == np.float16:
            # Differentiating a float16 program outside jaxmp.value_and_grad warns (no loss scale):
            # through its arguments, or through closed-over values of an outer trace (params).
            outer = [i for i, c in enumerate(consts) if internals.is_tracer(c)]
            watched = unscaled.watch([*xs, *(consts[i] for i in outer)], self.label)
            xs, consts = watched[:len(xs)], list(consts)
            for i, c in zip(outer, watched[len(xs):]):
                consts[i] = c
        outs = interp.run(self.closed.jaxpr, consts, [_argument(x) for x in xs])
        if self.config.rules.scope_rules or self.config.rules.matmul_formats:
            _warn_unmatched_scopes(self.config.rules, interp.scopes_seen(), self.label)
        return [o.x for o in outs]

    def call(self, *xs):
        """The program with the policy's input and output casts: one computation, so that a
        call run eagerly (``jitted``) and one staged into a caller's ``jit`` round alike."""
        if self.config.cast_inputs:
            # O2: weights (every use a half-list op) are cast once here; running statistics,
            # biases and other state enter as passed, so a stored float32 statistic stays float32.
            cast = self.weights() if self.config.cast_inputs == "weights" else [True] * len(xs)
            xs = [_cast_input(x, self.config.compute_dtype) if c else x for x, c in zip(xs, cast)]
        with jax.named_scope(marker("keep", f"autocast({self.config.name})")):
            outs = self.run(*xs)
        if self.cast_outputs:
            outs = [cast_floating(o, self.config.output_dtype) if is_float(getattr(o, "dtype", None)) else o
                    for o in outs]
        return outs


def weight_mask(jaxpr: Any, config: _config.AutocastConfig) -> list[bool]:
    """Which inputs of ``jaxpr`` are weights under ``config``: every use is a half-list op that
    runs in half (not under a float32 region or rule).

    Args:
      jaxpr: an open jaxpr, traced as the user wrote it.
      config: the `AutocastConfig` whose rules and regions decide.

    Returns:
      One flag per invar.
    """
    from jaxmp.engine._control_flow import weight_inputs

    probe = Interpreter(config)
    half = config.compute_dtype

    def runs_in_half(comps):  # a weight used in a float32 region stays float32
        region = probe.region(comps)
        return region is None or (region != "keep" and np.dtype(region) == half)

    return weight_inputs(jaxpr, config.rules.half_ops, runs_in_half)


def _argument(x) -> Val:
    """An input as the interpreter reads it.

    A weak-typed scalar is a Python number that a caller's ``jit`` traced. Called eagerly, the
    same number is a static argument, a literal of the program, and literals narrowed to half
    saturate (``finfo(float32).min`` as a mask value). It is read as a constant, so that the
    eager call and the jitted one compute the same thing.
    """
    aval = internals.typeof(x)
    weak = bool(getattr(aval, "weak_type", False))
    return Val(x, weak=weak, const=weak and not aval.shape)


def _cast_input(x, dtype):
    """An input cast to the compute dtype (O2's weights, O3's every input); a weak scalar that
    narrows saturates, as `_argument` explains."""
    if _argument(x).const and is_float(dtype_of(x)) and np.dtype(dtype).itemsize < dtype_of(x).itemsize:
        return saturate(x, np.dtype(dtype))
    return cast_floating(x, dtype)


def _check_outputs(fn: Callable, out: Any) -> None:
    """Every output leaf is an array or a number; else a TypeError naming the user's function
    (JAX's own message would name the engine's internal wrapper)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if internals.is_tracer(leaf) or isinstance(leaf, (jax.Array, bool, int, float, complex)) or _array_like(leaf):
            continue
        where = jax.tree_util.keystr(path) or "the output"
        name = _name(fn)
        code = getattr(fn, "__code__", None)
        at = f" (at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise TypeError(
            f"jaxmp.autocast: {name}{at} returned a {type(leaf).__name__} at {where}, which is not an array or a "
            "number: return only arrays and numbers from the function autocast wraps, and add other values "
            "(strings, objects) in a wrapper around the autocast call")


def _name(fn: Callable) -> str:
    """The user's function as messages name it."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _array_like(leaf: Any) -> bool:
    """A numpy array or scalar of a dtype JAX holds (numbers, bool, bfloat16, fp8, float0), not text or objects."""
    if not isinstance(leaf, (np.ndarray, np.generic)):
        return False
    dt = leaf.dtype
    return bool(jax.numpy.issubdtype(dt, jax.numpy.number) or dt == np.bool_ or dt == jax.dtypes.float0)


def _signature(leaves, dynamic):
    # A dynamic leaf is keyed by its whole abstract value, as jit keys its cache: shape, dtype
    # and weak type, and also its sharding and the shard_map axes it varies over. A program
    # traced inside shard_map (or for an explicitly sharded input) bakes these into its ops
    # and cannot be re-run for a value of another layout.
    return tuple(internals.typeof(leaf) if dyn else ("static", leaf) for leaf, dyn in zip(leaves, dynamic))


class _Autocast:
    """The callable [`autocast`][jaxmp.autocast] returns (``functools.wraps`` keeps ``fn``'s name and doc)."""

    def __init__(self, fn: Callable, config: _config.AutocastConfig, cast_outputs: bool = True,
                 cache: bool = True, given: tuple | None = None):
        # cache=False (the Flax integration): trace on every call, as module.apply does, so that
        # user interceptors and other trace-time Python effects behave as without jaxmp.
        self.fn, self.config, self.cast_outputs, self.cache = fn, config, cast_outputs, cache
        # (policy, rules) as jaxmp.autocast was given them: the locator's fix re-wraps ``fn`` with
        # them plus its rule, spelled as the user wrote them (None: not built by jaxmp.autocast)
        self.given = given
        self._programs: collections.OrderedDict = _shared_programs(fn, (config, cast_outputs)) if cache \
            else collections.OrderedDict()
        functools.update_wrapper(self, fn)

    def _trace(self, leaves, dynamic, treedef) -> _Program:
        out_tree = []

        def flat_fn(*dyn):
            it = iter(dyn)
            full = [next(it) if d else leaf for leaf, d in zip(leaves, dynamic)]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
            out = self.fn(*args, **kwargs)
            flat, tree = jax.tree_util.tree_flatten(out)
            _check_outputs(self.fn, out)
            out_tree.append(tree)
            return flat

        dyn_vals = [leaf for leaf, d in zip(leaves, dynamic) if d]
        with _config.TRACING(self.config), route_attention(), recording_classes() as seen, \
                apply_module_rules(self.config.modules, intercept=not self.config.from_flax_wrapper):
            closed = jax.make_jaxpr(flat_fn)(*dyn_vals)
        tracer_consts = any(internals.is_tracer(c) for c in closed.consts)
        label = f"{_name(self.fn)} under {self.config.name!r}"
        if self.config.rules.class_rules and not self.config.from_flax_wrapper:  # the door says its own
            _warn_unmatched_classes(self.config.rules, seen, label)
        return _Program(closed, out_tree[0], self.config, tracer_consts, self.cast_outputs, label)

    def _program(self, leaves, dynamic, treedef) -> _Program:
        if not self.cache:
            return self._trace(leaves, dynamic, treedef)
        try:
            key = (treedef, _signature(leaves, dynamic), _config.TRACING.value, _EXPLAIN.value)
            hash(key)
        except TypeError:  # an unhashable static leaf: trace every call, as jit would refuse to cache
            return self._trace(leaves, dynamic, treedef)
        program = self._programs.get(key)
        if program is None:
            program = self._trace(leaves, dynamic, treedef)
            if program.has_tracer_consts:  # closes over an outer trace's values: never reuse
                return program
            self._programs[key] = program
            if len(self._programs) > _CACHE_SIZE:
                self._programs.popitem(last=False)
        return program

    def __call__(self, *args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [_is_array(leaf) for leaf in leaves]
        program = self._program(leaves, dynamic, treedef)
        dyn_vals = [leaf for leaf, d in zip(leaves, dynamic) if d]
        # Run eagerly (an eager grad or vmap included), the cached program is one jitted call.
        # While a program is being staged out (jit, make_jaxpr) its ops are bound into the
        # caller's trace instead: under an outer grad or vmap each repeated op is then a cached
        # one-op jit (internals.bind) whose linearization or batching JAX caches, where one
        # opaque jit call would have its body redone equation by equation.
        inline = not self.cache or program.has_tracer_consts or internals.staging()
        outs = program.call(*dyn_vals) if inline else program.jitted(*dyn_vals)
        return jax.tree_util.tree_unflatten(program.out_tree, outs)


def build(fn: Callable, policy: Any = "O1", *, rules: AutocastRules | None = None) -> Callable:
    """What [`jaxmp.autocast`][jaxmp.autocast] returns, built without its once-per-process canary.

    `jaxmp.engine._contract` builds its check programs with this, so that the canary's own
    programs never start the canary again and the contract does not import the public entry
    points (`jaxmp.engine._autocast_fn`), which run it.

    Args:
      fn: the function.
      policy: as for [`jaxmp.autocast`][jaxmp.autocast].
      rules: as for [`jaxmp.autocast`][jaxmp.autocast].

    Returns:
      The autocast function.
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {type(fn).__name__}: {fn!r}")
    config = _config.resolve_config(policy, rules)
    if config.identity:
        @functools.wraps(fn)
        def identity(*args, **kwargs):
            # An O0 region nested in another autocast keeps its ops as traced: it wins there.
            with jax.named_scope(marker("keep", f"autocast({config.name})")):
                return fn(*args, **kwargs)

        return identity
    return _Autocast(fn, config, given=(policy, rules))


def autocast_given(fn: Any) -> tuple | None:
    """``(the function it wraps, policy, rules)`` as [`jaxmp.autocast`][jaxmp.autocast] was given
    them, when ``fn`` is what it returned (not the Flax door's engine function, not O0's identity),
    else None.

    The debugger's locator reads it: a fix for an autocast function re-wraps what it wraps.
    """
    if isinstance(fn, _Autocast) and fn.given is not None:
        return (fn.fn, *fn.given)
    return None


#: (function label, scope pattern) pairs already warned about: a rule that matches nothing warns once.
_WARNED_SCOPES: set = set()


def _warn_unmatched_scopes(rules: AutocastRules, seen: set, label: str) -> None:
    """A [`jaxmp.MixedPrecisionWarning`][jaxmp.MixedPrecisionWarning] for each scope rule that matches
    no name scope of the traced program, naming the closest scope paths there are (once per rule and
    function)."""
    import difflib
    import warnings

    from jaxmp._misuse import MixedPrecisionWarning
    from jaxmp.engine._rules import MARKER, scope_matches

    paths = set()
    for comps in seen:
        names = tuple(c for c in comps if not MARKER.match(c))
        paths.update("/".join(names[:k]) for k in range(1, len(names) + 1))
    patterns = [p for p, _ in rules.scope_rules] + [k for kind, k, _ in rules.matmul_formats if kind == "scope"]
    for pattern in patterns:
        key = (label, pattern)
        if key in _WARNED_SCOPES or any(scope_matches(pattern, p.rsplit("/", 1)[-1], tuple(p.split("/")[:-1]))
                                        for p in paths):
            continue
        _WARNED_SCOPES.add(key)
        close = difflib.get_close_matches(pattern, sorted(paths), n=3, cutoff=0.0)
        near = f"; the closest scope paths there are: {', '.join(map(repr, close))}" if close else (
            "; it has no name scopes: put the lines in `with jax.named_scope(name):` (or a function decorated "
            "with @jaxmp.float32_region)")
        warnings.warn(f"jaxmp.autocast({label}): the scope rule {pattern!r} matches no name scope of the traced "
                      f"function, so it does nothing{near}. Warned once per rule.", MixedPrecisionWarning,
                      stacklevel=4)


def _warn_unmatched_classes(rules: AutocastRules, seen: set, label: str) -> None:
    """A [`jaxmp.MixedPrecisionWarning`][jaxmp.MixedPrecisionWarning] for each class rule of the user's
    that no module call of the traced function matched (once per rule and function).

    The Flax door's preset class rules (passed on with `jaxmp.flax.default_rules`: most models
    use only some of those classes) are not the user's and never warn.
    """
    import sys
    import warnings

    from jaxmp._misuse import MixedPrecisionWarning

    overrides = sys.modules.get("jaxmp.flax._overrides")  # loaded only when the Flax door was imported
    for cls, dtype in rules.class_rules:
        key = (label, cls)
        if (overrides is not None and overrides.is_preset_class_rule(cls, dtype)) or key in _WARNED_SCOPES \
                or any(issubclass(c, cls) for c in seen):
            continue
        _WARNED_SCOPES.add(key)
        called = sorted({c.__name__ for c in seen})
        near = f"; the module classes it called: {', '.join(called)}" if called else ""
        warnings.warn(f"jaxmp.autocast({label}): the class rule for {cls.__name__} matches no module call of the "
                      f"traced function (no {cls.__name__} or subclass of it is called), so it does nothing{near}. "
                      "For code without modules, keep lines in float32 with `jax.named_scope` and "
                      "AutocastRules.with_scope, or @jaxmp.float32_region. Warned once per rule.",
                      MixedPrecisionWarning, stacklevel=4)
