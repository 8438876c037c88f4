"""Every docstring example in jaxmp runs: each one imports what it uses (no hidden globals).

No module is excluded: the core modules, the op-level autocast engine (``jaxmp/engine/``) and the
Flax integration (``jaxmp/flax/``: ``mixed_precision``, linen, nnx, overrides, casting, attention)
all take part. A new module's examples join the run automatically.
"""

import doctest
import importlib
import pkgutil

import pytest
from tests._support._static_examples import missing_names

import jaxmp

EXCLUDED: set[str] = set()  # modules whose examples are not run (none)

#: Examples that run under standard dtype promotion (all others run under strict, as the rest of
#: the suite): their failure under strict is inside third-party code they call, named here.
_ADAM = "optax.adam: bias correction is a Python float ** int32 count"
STANDARD_PROMOTION = {
    "jaxmp.flax.nnx.MixedPrecision": _ADAM,
    "jaxmp.flax._train_state.TrainState": _ADAM,
    "jaxmp.lean._bf16.bf16_moments": _ADAM,
    "jaxmp.lean._quantized.quantized_moments": _ADAM,
    "jaxmp.parallel._sharding.make_sharded_train_step": _ADAM,
    "jaxmp._scaling._transform.loss_scaling": _ADAM,
}


def _modules():
    names = ["jaxmp"] + [m.name for m in pkgutil.walk_packages(jaxmp.__path__, "jaxmp.")]
    return [n for n in names if n not in EXCLUDED]


def _examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    cases = []
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name, globs={}):
            if test.examples and test.name.startswith(name):
                reason = STANDARD_PROMOTION.get(test.name)
                marks = [pytest.mark.standard_promotion(reason=reason)] if reason else []
                cases.append(pytest.param(test, id=test.name, marks=marks))
    return cases


EXAMPLES = _examples()


def test_the_run_covers_the_core_modules():
    covered = {p.values[0].name.rsplit(".", 1)[0] for p in EXAMPLES} | {p.values[0].name for p in EXAMPLES}
    for module in ("jaxmp._dtypes", "jaxmp._precision._presets", "jaxmp._scaling._loss_scale", "jaxmp._scaling._transform",
                   "jaxmp._scaling._opt_state",
                   "jaxmp._scaling._skip", "jaxmp._scaling._grad", "jaxmp._precision._platform", "jaxmp.flax.linen", "jaxmp.flax.nnx",
                   "jaxmp.flax._overrides", "jaxmp.flax._attention"):
        assert any(c.startswith(module + ".") for c in covered), module
    assert "jaxmp.flax.mixed_precision" in covered
    assert len(EXAMPLES) >= 110


def test_every_docstring_example_parses_and_its_jaxmp_names_exist():
    """The default tier's check of the examples (the slow tier runs them, below)."""
    missing = {p.values[0].name: m for p in EXAMPLES
               if (m := missing_names("\n".join(e.source for e in p.values[0].examples)))}
    assert not missing, f"docstring examples naming what does not exist: {missing}"


# Running every example compiles ~70 small programs (~35 s on 2 cores): the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("test", EXAMPLES)
def test_docstring_example_runs(test):
    test.globs = {}  # nothing hidden: the example imports what it uses
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda s: None)
    results = runner.summarize(verbose=False)
    if results.failed:
        out = []
        doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE).run(
            test, out=out.append, clear_globs=False)
        pytest.fail("".join(out))


def test_every_docstring_example_shows_its_output():
    """An example with no expected output can only fail by raising: each one shows a result
    (a value, a printed line or an exception) that the run above checks."""
    silent = [p.values[0].name for p in EXAMPLES if not any(e.want.strip() or e.exc_msg for e in p.values[0].examples)]
    assert not silent, f"docstring examples that show no output: {silent}"
    # The check sees what it should: an example with only statements counts as silent.
    probe = doctest.DocTestParser().get_examples(">>> x = 1\n>>> y = x + 1\n")
    assert probe and not any(e.want.strip() or e.exc_msg for e in probe)


def _unused_imports(test) -> list[str]:
    """The names an example imports and never uses (``import jaxmp.flax`` counts as used with ``jaxmp``)."""
    import ast

    tree = ast.parse("\n".join(e.source for e in test.examples))
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname or a.name.split(".")[0]: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            bound.update({a.asname or a.name: a.name for a in node.names})
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return sorted(name for name in bound if name not in used)


#: Examples allowed to import more than they use: none. The list only shrinks.
UNUSED_IMPORTS_KNOWN: set[str] = set()


def test_every_docstring_example_imports_only_what_it_uses():
    found = {p.values[0].name: _unused_imports(p.values[0]) for p in EXAMPLES}
    extra = {name: unused for name, unused in found.items() if unused and name not in UNUSED_IMPORTS_KNOWN}
    assert not extra, f"docstring examples importing names they never use: {extra}"
    # The check sees an unused import.
    probe = doctest.DocTestParser().get_doctest(">>> import jax, numpy as np\n>>> np.ones(1).shape\n(1,)\n",
                                                {}, "probe", None, 0)
    assert _unused_imports(probe) == ["jax"]
