"""Statements the docs make about the code, checked against the code: the architecture page's
fp8 and rule-system sentences, the design page's defaults, the version floor of getting
started, what CI runs (docs/autocast.md, README), and that design references resolve."""

import re
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest
from tests._support._markdown import README, ROOT, page

import jaxmp
from jaxmp import fp8


def test_architecture_fp8_statement_holds():
    text = " ".join(page("architecture.md").read_text().split())
    assert "not yet in the presets" not in text
    assert "used by the presets (`O2-fp8`, `O2-fp8-current`), by autocast (`AutocastRules.fp8_matmuls`)" in text
    assert "and by the Flax path (the fp8 layers of `jaxmp/flax/fp8.py`, which the `O2-fp8` presets install)" in text
    # The presets carry the recipes ...
    assert type(jaxmp.get_recipe("O2-fp8").fp8) is fp8.DelayedScaling
    assert type(jaxmp.get_recipe("O2-fp8-current").fp8) is fp8.CurrentScaling
    # ... autocast takes current scaling ...
    assert jaxmp.AutocastRules(fp8_matmuls=fp8.CurrentScaling()).fp8_matmuls == fp8.CurrentScaling()
    # ... and the Flax path installs the fp8 layers, with their state in its own collection.
    nn = pytest.importorskip("flax.linen")
    import jax

    model = jaxmp.flax.mixed_precision(nn.Dense(4), "O2-fp8")
    variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    assert fp8._state.FP8_COLLECTION in variables and "input_scale" in str(jax.tree_util.tree_structure(variables))


def test_architecture_statement_about_flax_rules_matches_the_code():
    """The page says both front doors take one rule object whose class and path rules compile to the
    engine's ``ModuleRules``; that must be what the code does."""
    nn = pytest.importorskip("flax.linen")
    from jaxmp.engine._config import flax_config, resolve_config
    import jaxmp.flax
    from jaxmp.engine._module_rules import ModuleRules

    text = " ".join(page("architecture.md").read_text().split())
    says_one_system = ("Module rules are one system: both front doors take a `jaxmp.AutocastRules`, whose "
                       "class and path rules compile to `jaxmp.engine._module_rules.ModuleRules`") in text
    policy = jaxmp.get_policy("O1-bf16")
    flax_rules = flax_config(policy, jaxmp.flax.default_rules("O1")).modules
    autocast_rules = resolve_config("O1-bf16", jaxmp.AutocastRules().with_class(nn.LayerNorm, "float32")).modules
    one_system = isinstance(flax_rules, ModuleRules) and isinstance(autocast_rules, ModuleRules)
    assert says_one_system and one_system, (
        "docs/architecture.md's sentence about the one rule object no longer matches "
        f"the code (the Flax door's rules compile to {type(flax_rules).__name__}, class rules to "
        f"{type(autocast_rules).__name__})")
    # ... and both run the ops inside a LayerNorm in float32 (the Flax rule also casts its params).
    assert flax_rules.rule_at(("norm",), nn.LayerNorm).region == "float32"
    assert autocast_rules.rule_at(("norm",), nn.LayerNorm).region == "float32"


def test_design_page_defaults_are_the_codes():
    text = " ".join(page("design.md").read_text().split())
    ls = jaxmp.DynamicLossScale()
    assert float(ls.loss_scale) == 2.0**15 and "| dynamic scale: initial | 2**15" in text
    assert float(jaxmp.make_loss_scale("torch").loss_scale) == 2.0**16 and "`\"torch\"` gives 2**16" in text
    assert (ls.factor, ls.period) == (2.0, 2000) and "x2 after 2000 consecutive finite steps" in text
    assert ls.backoff_factor == 0.5 and "x0.5 and skip the step" in text
    assert (ls.min_loss_scale, ls.max_loss_scale) == (1.0, 2.0**24) and "1.0 / 2**24" in text
    assert ls.loss_scale.dtype == jnp.float32 and jaxmp.make_loss_scale(3.0).loss_scale.dtype == jnp.float32
    for name in ("O1-bf16", "O2-bf16", "mixed_bfloat16"):
        assert jaxmp.get_recipe(name).loss_scale == "none", name
    assert "none (no-op) in the bf16 presets" in text
    half = {cc: jaxmp.recommended_policy(platform="gpu", compute_capability=cc).recipe.policy.compute_dtype
            for cc in ("8.0", "7.0")}
    assert half == {"8.0": np.dtype(jnp.bfloat16), "7.0": np.dtype(jnp.float16)}
    assert jaxmp.recommended_policy(platform="cpu").recipe.policy.compute_dtype == np.float32
    assert "bf16 on TPU and GPUs of compute capability >= 8.0; fp16 on 7.x; float32 on CPU" in text


def test_design_references_point_at_the_in_repo_design_page():
    assert page("design.md").is_file()
    roots = [ROOT / "jaxmp", ROOT / "docs", ROOT / "tests", ROOT / "benchmarks", ROOT / "experiments"]
    files = [README] + [p for r in roots for p in r.rglob("*") if p.suffix in (".py", ".md") and "results" not in p.parts]
    stale = [str(p.relative_to(ROOT)) for p in files if p.name != "test_claims.py" and "DESIGN.md" in p.read_text()]
    assert not stale, f"these name DESIGN.md, which is not in the repository (the design page is docs/design.md): {stale}"


def test_getting_started_states_pyprojects_jax_floor():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"jax>=([\d.]+)", d).group(1) for d in deps if d.startswith("jax>="))
    stated = re.findall(r"\bjax>=([\d.]+)", page("getting-started.md").read_text())
    assert stated and set(stated) == {floor}


def test_what_ci_runs_is_the_version_matrix_the_pages_name():
    from jaxmp.engine import _tested as tested

    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run loops over .ci/matrix.py's rows (read from jaxmp/engine/_tested.py), one venv each.
    assert re.search(r'done < <\("\$PY" \.ci/matrix\.py --extra\)', ci) and "own venv" in ci
    assert "jaxmp/engine/_tested.py" in (ROOT / ".ci" / "matrix.py").read_text()
    assert len(tested.MATRIX) > 1  # a matrix, not one version
    autocast = " ".join(page("autocast.md").read_text().split())
    assert "The versions CI runs are the rows of `jaxmp/engine/_tested.py`" in autocast
    assert "each in its own virtual environment" in autocast and "runs against" not in autocast
    # The README names the rows themselves.
    readme = " ".join(README.read_text().split())
    named = re.search(r"\(`jaxmp/engine/_tested\.py`: (.*?), each in its own venv\)", readme).group(1)
    versions = re.findall(r"(\d+\.\d+(?:\.\d+)+)", named)
    pythons = re.findall(r"Python (\d+\.\d+)", named)
    assert versions == [j for _, j in tested.MATRIX] and set(pythons) == {p for p, _ in tested.MATRIX}


def test_ci_builds_and_checks_the_distributions():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'"\$PY" -m build --outdir "\$dist" \.', ci)
    assert re.search(r'"\$PY" -m twine check --strict "\$dist"/\*', ci)
    assert ci.index("-m build") < ci.index("tests, default tier")  # before the tests: a broken package fails early
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = re.search(r'pip install --quiet -e "\.\[([\w,]+)\]"', ci).group(1).split(",")
    needed = {name.split(">")[0] for extra in installed for name in extras[extra]}
    assert {"build", "twine"} <= needed, "CI installs no extra that brings build and twine"


#: A plain-text pointer from a docstring to a section of a page: ``docs/<page>.md#<anchor>``.
DOC_POINTER = re.compile(r"docs/([\w/-]+\.md)(?:#([\w-]+))?")


def _anchors(path) -> set[str]:
    """The ids mkdocs gives the headings of a page (Python-Markdown's toc slugify, as mkdocs.yml uses)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no '#' comments of code blocks
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _docstring_pointers() -> list[tuple[str, str, str | None]]:
    import ast

    out = []
    for path in sorted((ROOT / "jaxmp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            doc = ast.get_docstring(node) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                 ast.AsyncFunctionDef)) else None
            for name, anchor in DOC_POINTER.findall(doc or ""):
                out.append((f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", name, anchor or None))
    return out


def test_docstring_pointers_to_the_docs_resolve():
    # Docstrings keep their summary, arguments and example; the reasoning lives on a page, named by
    # a plain-text "See docs/<page>.md#<section>" that must name a page and a heading that exist.
    pointers = _docstring_pointers()
    assert sum(1 for _, name, _ in pointers if name == "design.md") >= 5
    broken = [f"{where}: docs/{name}" + (f"#{anchor}" if anchor else "") for where, name, anchor in pointers
              if not (ROOT / "docs" / name).is_file() or (anchor and anchor not in _anchors(ROOT / "docs" / name))]
    assert not broken, "docstrings point at pages or sections that do not exist:\n" + "\n".join(broken)


def test_the_pointer_check_sees_a_missing_section(tmp_path):
    page_ = tmp_path / "p.md"
    page_.write_text("# Top\n\n## Loss scales\n\n```python\n# not a heading\n```\n\n### Under `jaxmp.autocast`\n")
    assert _anchors(page_) == {"top", "loss-scales", "under-jaxmpautocast"}
    assert DOC_POINTER.findall("See docs/design.md#loss-scaling.") == [("design.md", "loss-scaling")]


def test_autocast_pages_op_lists_name_every_op_of_the_catalogue_classes():
    """docs/autocast.md's table of the default lists names every half-list and float32-list op of
    the op catalogue (jaxmp/_ops.py), and no other (``igamma(c)`` and Bessel stand for two each)."""
    from jaxmp import _ops

    rows = {}
    for line in page("autocast.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1] in ("half (compute dtype)", "float32"):
            rows[cells[1]] = set(re.findall(r"`([a-z0-9_]+)(?:\(c\))?`", cells[2]))
            if "Bessel" in cells[2]:
                rows[cells[1]] |= {"bessel_i0e", "bessel_i1e"}
            if "`igamma(c)`" in cells[2]:
                rows[cells[1]] |= {"igammac"}
    half, float32 = rows["half (compute dtype)"], rows["float32"]
    assert _ops.of_class("half") == half
    assert _ops.of_class("float32") == float32
