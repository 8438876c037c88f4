"""The public signatures say what each parameter takes: no parameter is typed plain ``Any``.

The API reference (mkdocstrings/griffe) shows each parameter's annotation as written in the source,
so a parameter annotated ``Any`` reads "Any" on the site even where it takes a dtype, a policy or
an optax state. Every callable named in a public ``__all__`` (functions, classes' constructors and
public methods) is checked here; an annotation must also name something its module can resolve
(an import, or an ``if TYPE_CHECKING:`` import griffe reads), since under
``from __future__ import annotations`` a misspelt name would otherwise pass silently.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import sys
import types
import typing

import pytest

NAMESPACES = ("jaxmp", "jaxmp.parallel", "jaxmp.flax", "jaxmp.fp8", "jaxmp.lean", "jaxmp.diagnostics", "jaxmp.engine")

#: Parameters that take any value at all, each with the reason. ``**kwargs`` forwarded untouched to
#: another function are allowed by rule (see `_allowed`) rather than listed here.
ALLOWED_ANY: dict[str, str] = {}


def _callables():
    """(public name, callable, module whose namespace its annotations are read in), each object once."""
    seen: set[int] = set()
    for ns in NAMESPACES:
        module = importlib.import_module(ns)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                if not obj.__module__.startswith("jaxmp"):
                    continue
                yield f"{ns}.{name}", obj, obj.__module__
                for attr, member in vars(obj).items():
                    func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                    if not attr.startswith("_") and inspect.isfunction(func):
                        yield f"{ns}.{name}.{attr}", func, obj.__module__
            elif callable(obj):
                yield f"{ns}.{name}", obj, getattr(obj, "__module__", ns)


def _fields(cls: type) -> list[inspect.Parameter]:
    """A NamedTuple's or dataclass's fields as parameters: a NamedTuple's generated ``__new__`` carries
    no annotations, but the API reference shows the field types from the class body."""
    annotations = inspect.get_annotations(cls)
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
            for name, annotation in annotations.items() if "ClassVar" not in str(annotation)]


def _annotated_parameters():
    for qualname, obj, module in _callables():
        try:
            params = list(inspect.signature(obj).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: no Python signature to read
            params = []
        if inspect.isclass(obj):
            params += [f for f in _fields(obj) if f.name not in {p.name for p in params}]
        for param in params:
            if param.name in ("self", "cls") or param.annotation is inspect.Parameter.empty:
                continue
            if isinstance(param.annotation, typing.ForwardRef):  # a NamedTuple's fields under postponed annotations
                param = param.replace(annotation=param.annotation.__forward_arg__)
            yield qualname, param, module


def _is_plain_any(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "_name", None) or repr(annotation)
    return text.replace(" ", "") in ("Any", "typing.Any", "Any|None", "None|Any", "Optional[Any]")


def _allowed(qualname: str, param: inspect.Parameter) -> bool:
    # ``**kwargs`` passed on to another API (jax.distributed.initialize, a model's __call__) take
    # whatever that API takes: Any is the true type there.
    return param.kind is inspect.Parameter.VAR_KEYWORD or f"{qualname}({param.name})" in ALLOWED_ANY


def test_no_public_parameter_is_typed_plain_any():
    found = [f"{q}({p.name}: {p.annotation})" for q, p, _ in _annotated_parameters()
             if _is_plain_any(p.annotation) and not _allowed(q, p)]
    assert not found, (
        f"{len(found)} public parameters typed Any; give the real type (jax.typing.DTypeLike, jax.Array, "
        "optax.Params / optax.OptState, jaxmp._typing.PyTree / PolicyLike / LossScaleLike / AxisName, ...) "
        "or add the parameter to ALLOWED_ANY with the reason:\n" + "\n".join(found))


def test_every_parameter_is_checked():
    # Guards the test above against checking nothing (an __all__ read wrong, a signature not found).
    params = list(_annotated_parameters())
    names = {f"{q}({p.name})" for q, p, _ in params}
    assert len(params) > 300, len(params)
    assert {"jaxmp.loss_scaling(loss_scale)", "jaxmp.Policy(compute_dtype)", "jaxmp.parallel.shard_batch(batch)",
            "jaxmp.flax.TrainState(opt_state)", "jaxmp.lean.stochastic_round(key)",
            "jaxmp.Recipe(fp8)", "jaxmp.LossScalingState(inner_state)"} <= names


@functools.cache
def _type_checking_names(module_name: str) -> frozenset[str]:
    """Names bound by the ``if TYPE_CHECKING:`` imports of a module (griffe resolves them too)."""
    source = inspect.getsource(sys.modules[module_name])
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return frozenset(names)


def _unresolved(annotation: str, module_name: str) -> list[str]:
    """The names in ``annotation`` its module cannot resolve (``jax.typing.DTypeLike`` checked to the leaf)."""
    scope = vars(sys.modules[module_name])
    missing = []
    for node in ast.walk(ast.parse(annotation, mode="eval")):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in scope:
                value = scope[base.id]
                for attr in reversed(chain):
                    if not hasattr(value, attr):
                        missing.append(ast.unparse(node))
                        break
                    value = getattr(value, attr)
        elif isinstance(node, ast.Name):
            if not (node.id in scope or hasattr(builtins, node.id) or node.id in _type_checking_names(module_name)):
                missing.append(node.id)
    return missing


def test_public_annotations_name_things_that_exist():
    bad = [f"{q}({p.name}: {p.annotation}) in {m}: {missing}" for q, p, m in _annotated_parameters()
           if isinstance(p.annotation, str) and (missing := _unresolved(p.annotation, m))]
    assert not bad, "annotations naming nothing their module imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("annotation, plain", [("Any", True), ("Any | None", True), ("PyTree", False),
                                               ("dict[str, Any]", False), ("Callable[..., Any]", False)])
def test_plain_any_detection(annotation, plain):
    assert _is_plain_any(annotation) is plain


def test_unresolved_names_are_found():
    assert _unresolved("optax.NoSuchAlias | Bogus | None", "jaxmp._scaling._transform") == ["optax.NoSuchAlias", "Bogus"]
    assert _unresolved("jax.typing.DTypeLike | LossScaleLike", "jaxmp._scaling._transform") == []
