"""The public surface: a budget per namespace, old names gone (no compatibility layer), jmp
interop, dataclass pytrees, composable transforms."""

import dataclasses
import importlib
import importlib.util
import pathlib
import re
import types
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.parallel
from jaxmp._scaling._transform import MasterWeightsState, master_weights, unscale_and_skip

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The most names each namespace's ``__all__`` may hold (at 0a46f1b: 61, 28, 27, 16, 15, 14, 12;
#: 173 in all). A name joins only if a guide uses it or users catch, annotate or isinstance it;
#: raising a budget is a decision to make in review, not a number to bump.
BUDGETS = {
    "jaxmp": 43,  # 39 names and 4 subpackages; 11 of the names are jmp's API, kept for `import jaxmp as jmp`
    # +2 for per-layer FSDP: scan_layers, gather_params; +1 Checkpointer (issue 60: checkpoints that refuse damaged bytes)
    "jaxmp.parallel": 24,
    "jaxmp.flax": 12,  # 3 of them the subpackages linen, nnx, fp8
    "jaxmp.lean": 14,  # +2 for 8-bit/4-bit moments (issue 52): quantized_moments, QuantizedMomentsState
    "jaxmp.diagnostics": 17,  # +6: the precision debugger (issue 40); +1 block_report (issue 53, docs/fp8.md uses it)
    "jaxmp.fp8": 9,
    "jaxmp.engine": 3,
    # The door modules (issue 61): each declares its __all__; before, a star import handed out 89 names
    # beyond these 12 (its imports and machinery, e.g. jaxmp.flax.nnx.steps, install_nnx_fp8).
    "jaxmp.flax.linen": 1,
    "jaxmp.flax.nnx": 7,
    "jaxmp.flax.fp8": 4,
}


@pytest.mark.parametrize("namespace", sorted(BUDGETS))
def test_each_namespace_stays_within_its_budget(namespace):
    module = importlib.import_module(namespace)
    names = module.__all__
    assert len(names) == len(set(names)), f"{namespace}.__all__ repeats a name"
    assert len(names) <= BUDGETS[namespace], (
        f"{namespace}.__all__ has {len(names)} names, over its budget of {BUDGETS[namespace]}: a new public "
        "name needs a guide that uses it (or is a type users catch/annotate), and a budget raised in review")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no public name is itself a deprecated path
        for name in names:
            assert getattr(module, name) is not None, f"{namespace}.{name}"
    # 110, +2 for per-layer FSDP (issue 41), +6 for the debugger (issue 40), +2 quantized moments (issue 52),
    # +1 block_report (issue 53), +1 Checkpointer (issue 60), +12 the door modules' own __all__ (issue 61: counted, not new)
    assert sum(len(importlib.import_module(n).__all__) for n in BUDGETS) <= 132


DOOR_MODULES = ("jaxmp.flax.linen", "jaxmp.flax.nnx", "jaxmp.flax.fp8")


@pytest.mark.parametrize("namespace", DOOR_MODULES)
def test_a_door_module_exports_only_what_it_defines_for_users(namespace):
    """A star import of a door module hands out its ``__all__`` and nothing else (no imported helper,
    no module, no machinery), and each of those names is defined in that module."""
    module = importlib.import_module(namespace)
    assert hasattr(module, "__all__"), f"{namespace} declares no __all__, so every import in it is public"
    star: dict = {}
    exec(f"from {namespace} import *", star)
    assert set(star) - {"__builtins__"} == set(module.__all__)
    for name in module.__all__:
        assert getattr(module, name).__module__ == namespace, f"{namespace}.{name} is a re-export"
    assert "store_params" in jaxmp.flax.nnx.__all__ and "steps" not in jaxmp.flax.nnx.__all__  # the scan sees names


def _prose() -> str:
    """What a user reads and copies: the README, the guides (not the API pages) and the experiments."""
    files = [ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "api" not in p.parts),
             *(ROOT / "experiments").rglob("*.py"), *(ROOT / "experiments").rglob("*.md")]
    return "\n".join(f.read_text() for f in files)


def test_every_public_name_is_used_by_a_guide_or_is_a_type():
    """Nothing else is public: a function or constant in an ``__all__`` appears in the guides, the
    README or the experiments; classes (caught, annotated, isinstance'd) and subpackages are exempt."""
    prose = _prose()
    unused = []
    for namespace in BUDGETS:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, (type, types.ModuleType)) or type(obj).__name__ == "UnionType":
                continue
            if not re.search(r"(?<![\w])%s\b" % re.escape(name), prose):
                unused.append(f"{namespace}.{name}")
    assert not unused, f"public names no guide, README section or experiment uses: {unused}"


def _changelog_old_places() -> list[str]:
    """The old places the CHANGELOG records: the dotted jaxmp paths in the first column of its
    tables of moves (those whose first header is ``old`` or ``old module``)."""
    olds, in_moves = set(), False
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if not line.startswith("|"):
            in_moves = False
            continue
        first = line.split("|")[1].strip()
        if first in ("old", "old module"):
            in_moves = True
        elif in_moves and re.fullmatch(r"`jaxmp(\.\w+)+`", first):
            olds.add(first.strip("`"))
    return sorted(olds)


def test_an_old_place_is_a_plain_attribute_or_module_not_found_error():
    """Nothing was released, so no name that moved has an alias: each old place the CHANGELOG
    records raises Python's own error, with no warning on the way."""
    olds = _changelog_old_places()
    assert len(olds) > 150 and "jaxmp.TrainState" in olds and "jaxmp.transform" in olds
    for old in olds:
        module, _, name = old.rpartition(".")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                namespace = importlib.import_module(module)
            except ModuleNotFoundError:
                continue  # an old module's old names go with it (jaxmp.policy.half_dtype)
            if old == "jaxmp.diagnostics.autocast_ops":
                continue  # the name of a diagnostics function, still reachable (not in __all__)
            assert name not in getattr(namespace, "__all__", ()), old
            with pytest.raises(AttributeError) as error:
                getattr(namespace, name)
            assert str(error.value) == f"module {module!r} has no attribute {name!r}", old  # no pointer, no hook
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module(old)  # nor an old module path


def test_no_module_of_jaxmp_defines_a_module_getattr_but_the_lazy_flax():
    """One ``__getattr__`` hook in the package: ``jaxmp.flax`` imported on first use."""
    hooks = [str(p.relative_to(ROOT)) for p in (ROOT / "jaxmp").rglob("*.py")
             if re.search(r"^(def __getattr__|__getattr__ *=)", p.read_text(), flags=re.M)]
    assert hooks == ["jaxmp/__init__.py"], hooks
    with pytest.raises(AttributeError, match=r"^module 'jaxmp' has no attribute 'TrainState'$"):
        jaxmp.TrainState  # noqa: B018


#: ``import jaxmp._x``, ``from jaxmp.pkg._x import y``, ``from jaxmp.pkg import _x``.
_PRIVATE_IMPORT = re.compile(r"(?:^|[\s;(])(?:from\s+jaxmp(?:\.\w+)*\._\w+(?:\.\w+)*\s+import\b"
                             r"|import\s+jaxmp(?:\.\w+)*\._\w+"
                             r"|from\s+jaxmp(?:\.\w+)*\s+import\s+\(?\s*_\w+)")


def _private_imports(text: str, doctest_only: bool = False) -> list[str]:
    lines = text.splitlines()
    if doctest_only:
        lines = [line.strip()[4:] for line in lines if line.strip().startswith((">>> ", "... "))]
    return [line.strip() for line in lines if _PRIVATE_IMPORT.search(line)]


#: Private imports where users read, each with why (issue 38 follow-ups: give each a public face or
#: move the code; the list may only shrink).
PRIVATE_IMPORT_EXCEPTIONS = {
    "benchmarks/efficiency.py": ("from jaxmp._step import make_step", "measures the step builder itself"),
    "benchmarks/overhead.py": ("from jaxmp._step import make_step", "measures the step builder itself"),
    "benchmarks/flops.py": ("from jaxmp import _jaxpr", "counts FLOPs from the traced program's equations"),
    "benchmarks/_gpt2.py": ("from jaxmp.parallel._layouts import leaf_spec", "hand-written ZeRO baseline"),
    "experiments/checkpoint/_format.py": ("from jaxmp.parallel import _checksums as shared",
                                          "the per-piece checksums, one implementation with jaxmp.parallel.Checkpointer"),
    "experiments/precision_reports.py": ("from jaxmp.diagnostics import _format as jaxmp_fmt",
                                         "the diagnostics' count format, for the same table"),
}


def test_no_doctest_page_readme_experiment_or_benchmark_imports_a_private_module():
    """What users read and copy uses the public faces (the package ``__init__``s, ``jaxmp.lean``,
    ``jaxmp.flax.linen``/``nnx``/``fp8``); tests may import private modules, users' code may not."""
    found = {}
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "experiments").rglob("*.md"),
             *(ROOT / "benchmarks").rglob("*.md")]
    code = [*(ROOT / "experiments").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    for path in pages + code:
        name = str(path.relative_to(ROOT))
        allowed = PRIVATE_IMPORT_EXCEPTIONS.get(name, ("",))[0]
        if hits := [h for h in _private_imports(path.read_text()) if h != allowed]:
            found[name] = hits
    for path in (ROOT / "jaxmp").rglob("*.py"):
        if hits := _private_imports(path.read_text(), doctest_only=True):
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"private modules imported where users read: {found}"
    # The scan sees what it should.
    assert _private_imports("from jaxmp._step import make_step\nimport jaxmp.engine._rules as r\n"
                            "from jaxmp.engine import _build\nfrom jaxmp import autocast") == [
        "from jaxmp._step import make_step", "import jaxmp.engine._rules as r", "from jaxmp.engine import _build"]
    assert _private_imports("    >>> from jaxmp.parallel._layouts import leaf_spec\n    from jaxmp._x import y",
                            doctest_only=True) == ["from jaxmp.parallel._layouts import leaf_spec"]


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'$"):
        jaxmp.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'$"):
        jaxmp.engine.no_such_name  # noqa: B018


def test_test_helper_is_out_of_the_package():
    with pytest.raises(ImportError):
        import jaxmp.parallel._multiprocess_demo  # noqa: F401


def test_policy_is_a_jmp_policy_and_haiku_uses_it():
    hk = pytest.importorskip("haiku", reason="needs the haiku extra")
    policy = jaxmp.get_policy("O1-bf16")
    assert isinstance(policy, jmp.Policy)

    class MLP(hk.nets.MLP):  # a subclass, so the policy does not leak into other tests
        pass

    hk.mixed_precision.set_policy(MLP, policy)
    try:
        def forward(x):
            return MLP([4, 2])(x)

        f = hk.transform(forward)
        x = np.ones((3, 5), np.float32)
        # Traced, not run: the assertions read dtypes (eagerly, every op and random draw compiles).
        params = jax.eval_shape(f.init, jax.random.key(0), x)
        out = jax.eval_shape(lambda p: f.apply(p, None, x), params)
        # jmp's contract, executed by Haiku: params stored in the param dtype, output in the output dtype,
        # and the computation inside in bfloat16.
        assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
        assert out.dtype == jnp.float32
        jaxpr = str(jax.make_jaxpr(lambda p: f.apply(p, None, x))(params))
        assert "bf16" in jaxpr
        assert hk.mixed_precision.get_policy(MLP) is policy
    finally:
        hk.mixed_precision.clear_policy(MLP)


def test_jmp_policy_and_jaxmp_policy_agree_on_casts():
    for text in ("p=f32,c=bf16,o=f32", "half", "c=f16"):
        ours, theirs = jaxmp.get_policy(text), jmp.get_policy(text)
        assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
            theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
        # Each library reads the other's printed form back to the same dtypes.
        assert jmp.get_policy(str(ours)) == theirs and jaxmp.get_policy(str(theirs)) == ours


def test_resolve_policy_parses_once_into_typed_objects():
    from jaxmp._precision._presets import resolve_policy

    policy, recipe = resolve_policy("O2-fp16")
    assert isinstance(policy, jaxmp.Policy) and recipe.master_weights and recipe.loss_scale == "dynamic"
    policy, recipe = resolve_policy("p=f32,c=bf16")
    assert recipe is None and policy.compute_dtype == jnp.bfloat16
    policy, recipe = resolve_policy(jmp.get_policy("c=f16"))
    assert type(policy) is jaxmp.Policy and recipe is None
    with pytest.raises(ValueError, match="Unknown policy 'O9'"):
        resolve_policy("O9")


def test_loss_scales_are_registered_dataclasses_with_static_config():
    ls = jaxmp.DynamicLossScale(8.0, period=3, min_loss_scale=0.5)
    assert dataclasses.is_dataclass(ls)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2  # the scale and the counter; the configuration is static
    doubled = jax.tree_util.tree_map(lambda x: x * 2, ls)
    assert float(doubled.loss_scale) == 16.0 and doubled.period == 3 and doubled.min_loss_scale == 0.5
    assert jax.tree_util.tree_structure(jax.jit(lambda s: s)(ls)) == treedef
    assert len(jax.tree_util.tree_leaves(jaxmp.StaticLossScale(4.0))) == 1
    assert jax.tree_util.tree_leaves(jaxmp.NoOpLossScale()) == []


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_master_weights_and_unscale_and_skip_compose_into_loss_scaling():
    params = {"w": np.linspace(-1, 1, 8).astype(np.float16)}
    grads = [{"w": np.full(8, g * 8, np.float16)} for g in (0.5, np.inf, 0.25, 1e-4)]  # scaled by the static 8
    composed = unscale_and_skip(master_weights(optax.adam(1e-2)), "static:8")
    convenience = jaxmp.loss_scaling(optax.adam(1e-2), "static:8", master_weights=True)
    out = []
    for tx in (composed, convenience):
        # One compiled step per chain, called four times (eagerly, every op of the update compiles).
        step = jax.jit(lambda p, s, g, tx=tx: (lambda u, s: (jaxmp.apply_updates(p, u, s), s))(*tx.update(g, s, p)))
        p, s = params, jax.jit(tx.init)(params)
        for g in grads:
            p, s = step(p, s, g)
        out.append((p, s))
    (p1, s1), (p2, s2) = out
    assert np.array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))
    assert jax.tree_util.tree_structure(s1) == jax.tree_util.tree_structure(s2)
    assert isinstance(s1.inner_state, MasterWeightsState)
    assert int(jaxmp.scaling_stats(s1)["total_skips"]) == 1
    assert jaxmp.master_params(s1)["w"].dtype == jnp.float32


def test_master_dtype_accepts_jmp_names():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True, master_dtype="f32")
    assert jaxmp.master_params(jax.eval_shape(tx.init, {"w": jnp.ones(2, jnp.bfloat16)}))["w"].dtype == jnp.float32
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True, master_dtype="float32")
    assert jaxmp.master_params(jax.eval_shape(tx.init, {"w": jnp.ones(2, jnp.float16)}))["w"].dtype == jnp.float32
    with pytest.raises(ValueError, match="master copy in half precision"):  # a name for a half dtype: refused
        jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True, master_dtype="bf16")


def test_the_skip_decision_has_one_owner():
    import pathlib

    root = pathlib.Path(jaxmp.__file__).parent
    users = ["_scaling/_transform.py", "flax/_train_state.py", "flax/_steps.py"]
    for rel in users:
        text = (root / rel).read_text()
        assert "keep_if_finite" in text, rel
        assert "select_tree(finite" not in text, rel
    assert "apply_if_finite" in (root / "_scaling" / "_skip.py").read_text()  # says why optax's does not fit


def test_layout_helpers_were_never_top_level():
    with pytest.raises(AttributeError, match="has no attribute 'shard_state'$"):
        jaxmp.shard_state  # noqa: B018
