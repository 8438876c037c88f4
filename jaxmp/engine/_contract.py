"""What a user can rely on from [`jaxmp.autocast`][jaxmp.autocast], as checks that run on any install.

Each check traces a small program and reads its ops' dtypes off the jaxpr. The tests,
``python -m jaxmp.selfcheck`` and the canary (on a JAX newer than every tested one) run them.
See docs/autocast.md#what-you-can-rely-on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _jaxpr
from jaxmp.engine import _internals as internals, _tested as tested
from jaxmp._misuse import MixedPrecisionWarning

_F32, _BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)


class Check(NamedTuple):
    """One check's outcome: what was checked, whether it holds, and what was seen."""

    name: str
    holds: bool
    detail: str


def _eqns(jaxpr) -> list:
    """Every equation of a jaxpr, nested ones included."""
    return [e.eqn for e in _jaxpr.walk(jaxpr)]


def _in_dtypes(eqn) -> set:
    return {np.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}


def op_input_dtypes(fn: Callable, args: tuple, primitive: str) -> list[set]:
    """The floating input dtypes of every ``primitive`` op in ``fn``'s jaxpr (nested included).

    Args:
      fn: any traceable function.
      args: its arguments.
      primitive: a primitive name, e.g. ``"dot_general"``.

    Returns:
      One set of dtypes per op, in program order.
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [_in_dtypes(e) for e in _eqns(jaxpr) if e.primitive.name == primitive]


def carry_updates(fn: Callable, args: tuple) -> list[tuple[str, np.dtype, set]]:
    """For every float loop carry produced by an add: (op, carry dtype, the add's input dtypes).

    Args:
      fn: any traceable function.
      args: its arguments.

    Returns:
      A list of ``(primitive, carry dtype, input dtypes)``.
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    out = []
    for eqn in _eqns(jaxpr):
        if internals.primitive_kind(eqn) not in internals.LOOPS:
            continue
        loop = internals.bodies(eqn)[-1]  # the body (a while's cond comes first)
        body, ncarry = loop.jaxpr, len(loop.carries)
        producers = {o: e for e in _jaxpr.equations(body) for o in e.outvars}
        for v in body.outvars[:ncarry]:
            e = producers.get(v)
            if e is None or e.primitive.name not in ("add", "add_any"):
                continue
            dtype = np.dtype(v.aval.dtype)
            if jnp.issubdtype(dtype, jnp.floating):
                out.append((e.primitive.name, dtype, _in_dtypes(e)))
    return out


# -- the programs ---------------------------------------------------------------------------

def _region_program():
    from jaxmp.engine._regions import float32_region

    @float32_region
    def head(x, w):
        return x @ w

    return lambda w, x: jnp.sum(head(x, w) ** 2)


def _half_program():
    return lambda w, x: jnp.sum(jnp.tanh(x @ w))


def _float32_program():
    return lambda w, x: jnp.sum(jnp.exp(jnp.tanh(x @ w)))


def _scope_program():
    def f(w, x):
        with jax.named_scope("head"):
            y = x @ w
        return jnp.sum(y ** 2)

    return f


def _accumulator_program():
    def f(w, x):
        acc = jax.lax.fori_loop(0, 4, lambda i, a: a + jnp.tanh(x @ w) * 1e-3, jnp.zeros((x.shape[0], w.shape[1])))
        return jnp.sum(acc)

    return f


#: The transformations of the contract: name -> (wrap a function of (w, x) returning a scalar).
TRANSFORMS: dict[str, Callable[[Callable], Callable]] = {
    "jit": jax.jit,
    "grad": lambda f: jax.grad(f),
    "value_and_grad": lambda f: jax.value_and_grad(f),
    "vjp": lambda f: (lambda w, x: jax.vjp(f, w, x)[1](jnp.ones((), jnp.float32))),
    "jvp": lambda f: (lambda w, x: jax.jvp(f, (w, x), (w, x))),
    "linearize": lambda f: (lambda w, x: jax.linearize(f, w, x)[1](w, x)),
    "vmap": lambda f: jax.vmap(f, in_axes=(None, 0)),
    "jacrev": lambda f: jax.jacrev(f),
    "hessian": lambda f: jax.hessian(f),
    "checkpoint": lambda f: jax.checkpoint(f),
    "checkpoint(dots_saveable)": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
}


def _args(transform: str) -> tuple:
    w = jnp.full((4, 4), 0.1, jnp.float32)
    x = jnp.ones((3, 4), jnp.float32)
    if transform == "vmap":
        x = jnp.ones((2, 3, 4), jnp.float32)
    return w, x


def _composed(program: Callable, transform: str, order: str, policy: str, rules=None) -> Callable:
    from jaxmp.engine._build import build as autocast

    t = TRANSFORMS[transform]
    if order == "T(autocast(f))":
        return t(autocast(program, policy, rules=rules))
    return autocast(t(program), policy, rules=rules)


ORDERS = ("T(autocast(f))", "autocast(T(f))")
OP_CLASSES = ("half list", "float32 list", "region", "scope rule", "accumulator", "float32 gradients")


def _unwarned(fn: Callable) -> Callable:
    """The checks differentiate float16 programs with no loss scale on purpose: no warning for that."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixedPrecisionWarning)
            return fn(*args, **kwargs)

    return wrapper


@_unwarned
def check_cell(op_class: str, transform: str, order: str, policy: str = "O1-bf16") -> Check:
    """Whether one cell of the composition table holds.

    Args:
      op_class: one of `OP_CLASSES`.
      transform: one of `TRANSFORMS`.
      order: one of `ORDERS`.
      policy: the autocast preset (a half dtype; ``"O1-bf16"`` by default).

    Returns:
      A `Check`.
    """
    from jaxmp.engine._rules import AutocastRules

    from jaxmp.engine._config import resolve_config

    half = np.dtype(resolve_config(policy, None).compute_dtype)  # "O1" and "mixed_float16" name theirs implicitly
    args = _args(transform)
    name = f"{op_class} | {transform} | {order}"
    if op_class == "half list":
        seen = op_input_dtypes(_composed(_half_program(), transform, order, policy), args, "dot_general")
        ok = bool(seen) and all(s == {half} for s in seen)
    elif op_class == "float32 list":
        seen = op_input_dtypes(_composed(_float32_program(), transform, order, policy), args, "exp")
        ok = bool(seen) and all(s == {_F32} for s in seen)
    elif op_class == "region":
        seen = op_input_dtypes(_composed(_region_program(), transform, order, policy), args, "dot_general")
        ok = bool(seen) and all(s == {_F32} for s in seen)
    elif op_class == "scope rule":
        rules = AutocastRules().with_scope("head", "float32")
        seen = op_input_dtypes(_composed(_scope_program(), transform, order, policy, rules), args, "dot_general")
        ok = bool(seen) and all(s == {_F32} for s in seen)
    elif op_class == "accumulator":
        seen = carry_updates(_composed(_accumulator_program(), transform, order, policy), args)
        ok = bool(seen) and all(ins == {d} for _, d, ins in seen)
    elif op_class == "float32 gradients":
        if transform not in ("grad", "value_and_grad", "vjp", "jacrev"):
            return Check(name, True, "n/a")
        # The dtypes are fixed when the program is traced: read them off an abstract evaluation
        # (running it compiles a program per cell and checks nothing more).
        out = jax.eval_shape(_composed(_half_program(), transform, order, policy), *args)
        leaves = jax.tree_util.tree_leaves(out)
        seen = sorted({str(leaf.dtype) for leaf in leaves})
        ok = seen == ["float32"]
    else:
        raise ValueError(f"unknown op class {op_class!r}; expected one of {OP_CLASSES}")
    return Check(name, ok, str([sorted(str(d) for d in s) if isinstance(s, set) else s for s in seen][:4]))


def composition_table(policy: str = "O1-bf16") -> list[Check]:
    """Every cell: each op class under each transformation, in both orders.

    Args:
      policy: the autocast preset.

    Returns:
      A list of `Check`, one per (op class, transformation, order).
    """
    return [check_cell(c, t, o, policy) for c in OP_CLASSES for t in TRANSFORMS for o in ORDERS]


def construct_checks() -> list[Check]:
    """The behaviours that do not depend on a transformation: padding masks, O2 state, kernels.

    Returns:
      A list of `Check`.
    """
    from jaxmp.engine._build import build as autocast

    out = []

    def masked(w, x, mask):
        return jax.nn.softmax(jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min), axis=-1)

    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool)
    for policy in ("O1-bf16", "O1-fp16"):
        row = autocast(masked, policy)(jnp.full((4, 4), 0.1), jnp.ones((2, 4)), mask)[1]
        out.append(Check(f"fully masked softmax row ({policy})", bool(jnp.allclose(row, 0.25)), str(row)))

    def ema(params, stats, x):
        return 0.99 * stats + 0.01 * jnp.mean(x @ params, axis=0)

    step = jax.jit(autocast(ema, "O2-bf16"))
    stats = jnp.zeros(2)
    for _ in range(300):
        stats = step(jnp.eye(2), stats, jnp.ones((4, 2)))
    expected = 1 - 0.99 ** 300
    out.append(Check("O2 running statistic tracks float32", bool(abs(float(stats[0]) - expected) < 1e-3 * expected),
                     f"{float(stats[0]):.5f} vs {expected:.5f}"))

    out.append(_custom_vjp_check())

    norm = autocast(lambda h, w: jnp.linalg.norm(h @ w), "O1-fp16")(jnp.full((1, 64), 300.0), jnp.eye(64))
    out.append(Check("linalg.norm squares in float32 (no fp16 overflow)", bool(jnp.isfinite(norm)), str(norm)))
    return out


def _custom_vjp_check() -> Check:
    """A ``custom_vjp`` under ``autocast(grad(f))``: its forward and backward matmuls run in half."""
    from jaxmp.engine._build import build as autocast

    @jax.custom_vjp
    def scaled(x, w):
        return x @ w

    scaled.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))
    seen = op_input_dtypes(autocast(jax.grad(lambda w, x: jnp.sum(scaled(x, w))), "O1-bf16"),
                           (jnp.ones((4, 4)), jnp.ones((3, 4))), "dot_general")
    return Check("custom_vjp: forward and backward matmuls in half", bool(seen) and all(s == {_BF16} for s in seen),
                 str(seen))


def canary() -> list[Check]:
    """The few checks run once on a JAX newer than every tested one: a region under ``grad``, a
    scan accumulator, a ``custom_vjp``.

    Returns:
      The failed `Check`\\ s (empty when every rule is honoured).
    """
    checks = [check_cell("region", "grad", "autocast(T(f))"), check_cell("region", "grad", "T(autocast(f))"),
              check_cell("accumulator", "jit", "autocast(T(f))")]
    checks.append(_custom_vjp_check())   # alone: the other construct checks run programs the canary does not need
    return [c for c in checks if not c.holds]


@functools.lru_cache(maxsize=1)
def run_canary_once() -> None:
    """On an untested (newer) JAX, runs `canary` once per process and warns about failures."""
    if not tested.is_newer_than_tested(internals.JAX_VERSION):
        return
    try:
        failed = canary()
    except Exception as e:  # an internal changed shape: say so, naming the version
        warnings.warn(f"jaxmp.autocast: jax {jax.__version__} is newer than every version jaxmp is tested with "
                      f"({tested.describe()}), and its self-check failed: {type(e).__name__}: {e}. "
                      "Run `python -m jaxmp.selfcheck` for details.", RuntimeWarning, stacklevel=3)
        return
    if failed:
        warnings.warn(f"jaxmp.autocast: jax {jax.__version__} is newer than every version jaxmp is tested with "
                      f"({tested.describe()}), and these rules are not honoured on it: "
                      + "; ".join(f"{c.name} (saw {c.detail})" for c in failed)
                      + ". Run `python -m jaxmp.selfcheck` for details.", RuntimeWarning, stacklevel=3)


def render_table(checks: list[Check]) -> str:
    """The composition table as markdown: op classes as rows, transformations x orders as columns.

    Args:
      checks: the output of `composition_table`.

    Returns:
      A markdown table (``yes`` where the cell holds, ``NO`` where it does not, ``n/a``).
    """
    cells = {tuple(c.name.split(" | ")): c for c in checks}
    head = "| op class | " + " | ".join(TRANSFORMS) + " |"
    rule = "|---|" + "---|" * len(TRANSFORMS)
    lines = [head, rule]
    for op_class in OP_CLASSES:
        row = []
        for t in TRANSFORMS:
            marks = []
            for o in ORDERS:
                c = cells[(op_class, t, o)]
                marks.append("n/a" if c.detail == "n/a" else ("yes" if c.holds else "NO"))
            row.append(marks[0] if marks[0] == marks[1] else " / ".join(marks))
        lines.append(f"| {op_class} | " + " | ".join(row) + " |")
    return "\n".join(lines)

