"""The locator's fix: code that runs as printed, in the spelling of the door the step came through.

`locate_non_finite` names an op; this module turns its module into an override and measures it.
`Step` is how the located step runs: under ``jaxmp.autocast`` (name scopes: a scope rule for the
module's path; NNX and Equinox models, which emit none: a class rule; plain JAX: a named scope
the user adds), through the Flax door (Linen or NNX ``jaxmp.flax.mixed_precision``: a path rule
in the door's spelling) or on its own casts (written, not measured). `Step.unit` is what to
keep in float32 for a module path, `Step.code` the override for a list of them and
`Step.runner` the step with the override applied, which the locator re-runs: where the first
inf goes then is the fix's measured effect. See docs/debugging.md#a-culprit-for-every-skipped-step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import textwrap
from typing import Any, Callable, Sequence

from jaxmp.diagnostics._fix_code import _FIT, door_path, module_class_at, param_prefix, rules_code

_F32 = "'float32'"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One module to keep in float32: ``kind`` ``"scope"`` (a scope path), ``"class"`` (a module
    class), ``"param"`` (the ops that read a parameter of that path), ``"door"`` (a door path) or
    ``"own"`` (a module of code that casts by itself); ``name`` is its path as the rule spells it."""

    kind: str
    name: str
    cls: type | None = None

    def __str__(self) -> str:
        return self.name


def doors() -> Any:
    """`jaxmp.flax._overrides.watch_doors`, or a context that records nothing when Flax was never imported."""
    overrides = sys.modules.get("jaxmp.flax._overrides")
    if overrides is None:
        return contextlib.nullcontext([])
    return overrides.watch_doors()


@dataclasses.dataclass(frozen=True)
class Step:
    """How the located step runs, and every module path of its program.

    Attributes:
      fn: the function located (a jaxmp step's loss already).
      args, kwargs: its inputs.
      policy: the autocast policy (``policy=``), or None.
      rules: the `jaxmp.AutocastRules` autocast ran with, or None (the policy's).
      door: the Flax door (a Linen or NNX ``MixedPrecision``) the step ran through, or None.
      paths: the module paths of the program's ops.
      preset: the autocast preset of the program's half dtype (for code that casts by itself).
      target: what the code wraps in ``jaxmp.autocast``: ``"fn"`` (the function located, run with
        ``policy=``), or ``"fn.__wrapped__"`` when ``fn`` is a ``jaxmp.autocast`` function already.
    """

    fn: Callable
    args: tuple
    kwargs: dict
    policy: Any
    rules: Any
    door: Any
    paths: frozenset
    preset: str = "O1-fp16"
    target: str = "fn"

    # -- what to keep in float32 -------------------------------------------------------------

    def unit(self, path: str, from_param: bool) -> Unit | None:
        """What keeps the module at ``path`` in float32 (None: no module, the top level)."""
        if not path:
            return None
        if self.policy is None:
            if self.door is not None:
                rel = self._door_path(path)
                return Unit("door", rel) if rel else None
            return Unit("own", path)
        if not from_param:
            return Unit("scope", self._shortest_scope(path))
        cls = module_class_at(self.args[0], path) if self.args else None
        return Unit("class", path, cls) if cls is not None else Unit("param", path)

    def _door_path(self, path: str) -> str:
        if _is_linen(self.door):
            return door_path(path)
        # an NNX door handed in as the model: its parameters sit under `.model`
        return path[len("model/"):] if path.startswith("model/") else path

    def _shortest_scope(self, path: str) -> str:
        """The fewest scopes, ending at ``path``'s last, that name no other module of the program."""
        parts = path.split("/")
        for n in range(1, len(parts) + 1):
            pattern = "/".join(parts[-n:])
            if not any(_names_other(q, pattern, path) for q in self.paths):
                return pattern
        return path

    # -- the override as code ------------------------------------------------------------------

    def code(self, units: Sequence[Unit]) -> str:
        """The override keeping ``units`` in float32, as code to paste (None entries skipped)."""
        units = [u for u in units if u is not None]
        if self.policy is None:
            return self._door_code(units) if self.door is not None else own_code(units, self.args, self.preset)
        notes, rules = [], self._base_rules()
        for u in units:
            if u.kind == "class":
                notes += _comment(f"{u.name!r} emits no name scope (NNX, Equinox): a class rule, every "
                                  f"{u.cls.__name__} in float32")
                rules = rules.with_class(u.cls, "float32")
            else:
                name = u.name.rsplit("/", 1)[-1] if u.kind == "param" else u.name
                if u.kind == "param":
                    where = param_prefix(self.args[0], u.name)
                    notes += [f"# the ops that read params{where} carry no name scope: put them in one,",
                              f"#     with jax.named_scope({name!r}):",
                              f"#         ...  # the lines that use params{where}",
                              "# (or decorate those lines' function with @jaxmp.float32_region)"]
                rules = rules.with_scope(name, "float32")
        call = f"fn = jaxmp.autocast({self.target}, {_spelled(self.policy)!r}, rules=rules)"
        return "\n".join([*self._target_note(), *notes, rules_code(rules, None), call])

    def _target_note(self) -> list[str]:
        if self.target == "fn":
            return []
        return _comment("fn: your jaxmp.autocast function; the rule goes on the function it wraps, "
                        f"{self.target}")

    def _base_rules(self):
        if self.rules is not None:
            return self.rules
        from jaxmp.engine._seams import resolve_config

        # promote=None: the code passes the same policy, which gives the preset's promotion back
        return dataclasses.replace(resolve_config(self.policy, None).rules, promote=None)

    def _door_code(self, units: Sequence[Unit]) -> str:
        inner = "model.module" if _is_linen(self.door) else "model.model"
        preset = door_preset(self.door)
        paths = "".join(f".with_path({u.name!r}, {_F32})" for u in units)
        if preset is not None:
            head = [f"rules = jaxmp.flax.default_rules({preset!r}){paths}",
                    f"model = jaxmp.flax.mixed_precision({inner}, {preset!r}, rules=rules)"]
        else:  # rules of the user's own: the door's, plus the path rules
            head = [f"rules = model.rules{paths}",
                    f"model = jaxmp.flax.mixed_precision({inner}, model.policy, rules=rules)"]
        return "\n".join(["# model: your jaxmp.flax.mixed_precision model; the door's path rule:", *head])

    def bfloat16_code(self) -> str | None:
        """The same step in bfloat16 (float32's range), as code, or None when the policy has no bf16 twin."""
        if self.policy is not None:
            twin = _bf16_twin(self.policy)
            rules = "" if self.rules is None else ", rules=rules"
            return None if twin is None else f"fn = jaxmp.autocast({self.target}, {twin!r}{rules})"
        if self.door is None:
            return None
        twin = _bf16_twin(door_preset(self.door))
        inner = "model.module" if _is_linen(self.door) else "model.model"
        return None if twin is None else f"model = jaxmp.flax.mixed_precision({inner}, {twin!r})"

    # -- the override applied ------------------------------------------------------------------

    def runner(self, units: Sequence[Unit]) -> tuple[Callable, Any] | None:
        """``(function to locate, context to trace it in)`` with the override applied, or None (not measurable)."""
        units = [u for u in units if u is not None]
        if self.policy is None:
            if self.door is None:
                return None
            rules = self.door.rules
            for u in units:
                rules = rules.with_path(u.name, "float32")
            overrides = sys.modules["jaxmp.flax._overrides"]
            return self.fn, lambda: overrides.watch_doors(((self.door, rules),))
        from jaxmp.diagnostics._fix_code import with_param_scope
        from jaxmp.engine._seams import autocast

        target, rules = self.fn, self._base_rules()
        for u in units:
            if u.kind == "class":
                rules = rules.with_class(u.cls, "float32")
                continue
            name = u.name.rsplit("/", 1)[-1] if u.kind == "param" else u.name
            if u.kind == "param":
                if self.kwargs:
                    return None  # the scope is put around ops of a positional program
                target = with_param_scope(target, self.args, u.name, name)
            rules = rules.with_scope(name, "float32")
        return autocast(target, self.policy, rules=rules), contextlib.nullcontext


def _names_other(other: str, pattern: str, path: str) -> bool:
    """Whether the scope ``pattern`` (``a/b``) matches a module of path ``other`` that is not ``path``'s own."""
    parts, n = other.split("/"), pattern.count("/") + 1
    for j in range(n - 1, len(parts)):
        if "/".join(parts[j - n + 1:j + 1]) == pattern and "/".join(parts[:j + 1]) != path:
            return True
    return False


def _is_linen(door: Any) -> bool:
    return hasattr(door, "module") and not hasattr(door, "model")


def _comment(text: str) -> list[str]:
    return textwrap.wrap("# " + text, _FIT, subsequent_indent="# ", break_long_words=False)


def _spelled(policy: Any) -> str:
    return policy if isinstance(policy, str) else str(policy)


def door_preset(door: Any) -> str | None:
    """The preset whose Flax door is ``door`` (its policy and rules are the preset's own), or None."""
    from jaxmp._precision._presets import PRESET_NAMES

    # A door was met, so the Flax door's module is loaded: looked up, not imported (diagnostics
    # sits below jaxmp.flax).
    resolve_rules = sys.modules["jaxmp.flax._overrides"].resolve_rules
    # the names that say their half dtype first: 'O1' is float16 on one machine, bfloat16 on another
    for name in sorted(PRESET_NAMES, key=lambda n: not n.endswith(("-fp16", "-bf16"))):
        try:
            policy, rules = resolve_rules(name)
        except Exception:  # a preset this machine cannot run (fp8 hardware): not the door's
            continue
        if policy == door.policy and rules == door.rules:
            return name
    return None


def _bf16_twin(policy: Any) -> str | None:
    from jaxmp._precision._presets import PRESET_NAMES

    if not isinstance(policy, str):
        return None
    twin = policy.replace("fp16", "bf16").replace("mixed_float16", "mixed_bfloat16")
    return twin if twin != policy and twin in PRESET_NAMES else None


def own_code(units: Sequence[Unit], args: Sequence[Any], preset: str) -> str:
    """Code that casts by itself (``Policy.cast_to_compute``, layers with a half ``dtype``): leave the
    module out of the casts, or run the step under ``jaxmp.autocast`` with it in a float32 named scope."""
    lines = []
    for u in units:
        where = param_prefix(args[0], u.name) if args else f"[{u.name.split('/')[0]!r}]"
        lines += [*_comment(f"your own casts (Policy.cast_to_compute, a half dtype=): leave {u.name!r} out of "
                            "them, its parameters and its input, e.g."),
                  "#     half = policy.cast_to_compute(params)",
                  f"#     half{where} = params{where}"]
    names = [u.name.rsplit("/", 1)[-1] for u in units]
    rules = "jaxmp.AutocastRules()" + "".join(f".with_scope({n!r}, {_F32})" for n in names)
    lines += ["# or drop your casts and run fn under jaxmp.autocast, the lines that use",
              *[f"# params{param_prefix(args[0], u.name) if args else ''} inside `with jax.named_scope({n!r}):` "
                "(or in a function" for u, n in zip(units, names)],
              "# decorated with @jaxmp.float32_region):",
              f"rules = {rules}",
              f"fn = jaxmp.autocast(fn, {preset!r}, rules=rules)"]
    return "\n".join(lines)


def describe(found: Any) -> str:
    """One clause for where a re-run's first inf/NaN is (a `NonFiniteCulprit`)."""
    mags = ", ".join(f"{m:.3g}" for m in found.input_absmax) or "-"
    return (f"{found.primitive} in {found.path or '(top level)'} ({'backward' if found.backward else 'forward'}, "
            f"inputs max|x| {mags}, {found.out_dtypes[0] if found.out_dtypes else '?'} max {found.dtype_max:.5g})")
