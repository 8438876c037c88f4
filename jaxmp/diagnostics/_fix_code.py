"""The spelling of a precision fix as code that runs as printed: rules, door paths, scopes.

Shared by `jaxmp.diagnostics._fix` (compare_to_float32's fix) and
`jaxmp.diagnostics._locate_fix` (the locator's), so neither imports the other's room.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from typing import Any, Callable, Sequence

import jax

from jaxmp.diagnostics import _format

#: The fix's code is printed indented by 4: lines of 84 fit a docs page's 88 columns.
_FIT = _format.WIDTH - 4


def class_name(cls: type) -> str:
    """``cls`` spelled as code: its public spelling where its package exports it (``flax.nnx.Linear``)."""
    import importlib

    name = cls.__qualname__
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):  # the shortest importable prefix that exports it
        prefix = ".".join(parts[:i])
        try:
            if getattr(importlib.import_module(prefix), name, None) is cls:
                return f"{prefix}.{name}"
        except ImportError:
            continue
    return f"{cls.__module__}.{name}"


def rules_code(rules, component: str | None, cls: type | None = None) -> str:
    """``rules`` plus a float32 rule for the module, spelled as code to paste.

    A scope rule for the name-stack ``component``; a class rule for ``cls`` when given (NNX and
    Equinox modules emit no instance scope a scope rule could match); neither: ``rules`` alone. One line when it fits 84
    columns (the fix is printed indented by 4), else one call per line.
    """
    from jaxmp.engine._seams import AutocastRules

    default = AutocastRules()
    kw = []
    if rules.float32_ops != default.float32_ops:
        kw.append("float32_ops=frozenset()" if not rules.float32_ops else
                  f"float32_ops=frozenset({sorted(rules.float32_ops)!r})")
    if rules.half_ops != default.half_ops:
        kw.append(f"half_ops=frozenset({sorted(rules.half_ops)!r})")
    if rules.promote is not None and rules.promote != default.promote:
        kw.append(f"promote={rules.promote!r}")
    if rules.matmul_output != default.matmul_output:
        kw.append(f"matmul_output={rules.matmul_output!r}")
    calls = [f"jaxmp.AutocastRules({', '.join(kw)})"]
    calls += [f".with_scope({pattern!r}, {dtype!r})" for pattern, dtype in rules.scope_rules]
    calls += [f".with_class({class_name(c)}, {dtype!r})" for c, dtype in rules.class_rules]
    calls += [_format_call(kind, key, value) for kind, key, value in rules.matmul_formats]
    if cls is not None:
        calls.append(f".with_class({class_name(cls)}, \"float32\")")
    elif component is not None:
        calls.append(f".with_scope({component!r}, \"float32\")")
    one = "rules = " + "".join(calls)
    if len(one) <= _FIT:
        return one
    return "rules = (" + ("\n         ".join(calls)) + ")"


def _format_call(kind: str, key: Any, value: Any) -> str:
    """A per-module matmul format as the ``with_*`` call that sets it (a recipe as its constructor)."""
    from jaxmp.fp8._seams import recipes

    fmt = repr(value) if isinstance(value, str) else recipes.source(value)
    where = class_name(key) if kind == "class" else repr(key)
    return f".with_{kind}({where}, {fmt})"


def module_class_at(root: Any, path: str) -> type | None:
    """The class of the module at ``path`` (``"a/b"``) inside ``root`` (an NNX or Equinox model), or None."""
    node = root
    for part in path.split("/"):
        if isinstance(node, dict) or not hasattr(node, part):
            return None  # a parameter dict or state (Linen, nnx.State): no module objects
        node = getattr(node, part)
    return type(node) if callable(node) and not isinstance(node, type) else None


def door_path(path: str) -> str:
    """``path`` relative to the model the Flax door wraps (Linen scopes start with the root's class)."""
    parts = path.split("/")
    if len(parts) > 1 and parts[0].lstrip("_")[:1].isupper():
        parts = parts[1:]
    # A trailing class scope (the door's per-call ``Dense``; Linen's instance names end in ``_N``)
    while len(parts) > 1 and re.fullmatch(r"_?[A-Z]\w*", parts[-1]) and not re.search(r"_\d+$", parts[-1]):
        parts = parts[:-1]
    return "/".join(parts)


def param_prefix(params: Any, rel: str) -> str:
    """The key path of module ``rel``'s parameters in ``params`` (``"['params']['sched']"``), or ``[...]``."""
    from jaxmp.diagnostics._evaluate import module_of

    for keypath, _ in jax.tree_util.tree_leaves_with_path(params):
        text = jax.tree_util.keystr(keypath)
        if module_of(text) == rel:
            for n in range(len(keypath) - 1, -1, -1):  # the shortest prefix that still names the module
                head = jax.tree_util.keystr(keypath[:n])
                if module_of(head) != rel:
                    return jax.tree_util.keystr(keypath[:n + 1])
            return text
    return f"[{rel.split('/')[0]!r}]"


def own_precision_code(path: str, params: Any = None) -> str:
    """The override for code that computes its own precision (the Flax door, its own casts)."""
    rel = door_path(path)
    where = param_prefix(params, rel) if params is not None else f"[{rel.split('/')[0]!r}]"
    # default_rules() (O1's rules: demand promotion), not default_rules(policy): under O2's narrow
    # promotion the float32 output of the module is rounded to half where it meets a half value,
    # and the path rule alone closed 23% of the gap on the seeded schedule instead of 98%.
    return "\n".join([
        "# Flax door (Linen or NNX): a path rule, e.g.",
        "model = jaxmp.flax.mixed_precision(",
        f"    model, policy, rules=jaxmp.flax.default_rules().with_path({rel!r}, \"float32\"))",
        *textwrap.wrap(f"your own casts (Policy.cast_to_compute, dtype=bfloat16): leave {rel!r} out of "
                       "them, its parameters and its input, e.g.", _FIT - 2,
                       initial_indent="# ", subsequent_indent="# ", break_long_words=False),
        "#     half = policy.cast_to_compute(params)",
        f"#     half{where} = params{where}"])


def with_param_scope(fn: Callable, args: Sequence[Any], path: str, name: str) -> Callable:
    """``fn`` with the ops that read module ``path``'s parameters inside ``jax.named_scope(name)``.

    What a user does to plain JAX code to give those ops a scope a rule can match, done on
    ``fn``'s program: the top-level ops that read a parameter whose key path names ``path``
    (and the casts, reshapes and broadcasts of it, as `Sites` names them) are re-bound inside the
    scope; every op keeps its own name stack.
    """
    from jaxmp._jaxpr import equations, is_literal, one_equation_program
    from jaxmp.diagnostics._evaluate import _CARRIES_PARAM, leaf_paths, module_of

    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, out_tree = closed.jaxpr, jax.tree_util.tree_structure(shapes)
    reads = {v for v, p in zip(jaxpr.invars, leaf_paths(args, {})) if module_of(p) == path}
    plan = []
    for eqn in equations(jaxpr):
        mine = any(not is_literal(v) and v in reads for v in eqn.invars)
        if mine and eqn.primitive.name in _CARRIES_PARAM:
            reads.update(eqn.outvars)
        plan.append((*one_equation_program(eqn), mine))

    def scoped(*a):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, jax.tree_util.tree_leaves(tuple(a))))
        for one, ins, mine in plan:
            with jax.named_scope(name) if mine else contextlib.nullcontext():
                outs = jax.core.eval_jaxpr(one, [], *[env[v] for v in ins])
            env.update(zip(one.outvars, outs))
        return jax.tree_util.tree_unflatten(out_tree, [v.val if is_literal(v) else env[v] for v in jaxpr.outvars])

    return scoped
