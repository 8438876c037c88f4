"""The documentation site: every page's Python runs, every page is in the navigation, the pages
that quote a command's output quote what it prints, and the architecture page names every module."""

import contextlib
import io
import re
import runpy

import pytest
from tests._support._markdown import DOCS, ROOT, SKIP_MARKER, is_skipped, page, pages, python_blocks, run_page, runnable_blocks
from tests._support._static_examples import missing_names

RUNNABLE = [p for p in pages() if runnable_blocks(p)]


def _nav_files(nav) -> list[str]:
    files = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files.extend(_nav_files(value) if isinstance(value, list) else [value])
    return files


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")  # installed with mkdocs (the docs extra)
    # mkdocs.yml uses no custom YAML tags, so the safe loader reads it.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _linen_trained(ns, tmp_path):
    assert int(ns["state"].step) >= 3  # the TrainState counted its applied steps


def _diagnostics_printed(ns, tmp_path):
    out = " ".join("".join(ns["__outputs__"]).split())  # the reports wrap their lines at 88
    assert "precision:" in out and "100.0% low precision" in out and "suggested static scale 2^" in out
    assert (tmp_path / "gradient_stats.png").stat().st_size > 10_000


def _imagenet_recipe(ns, tmp_path):
    """migrating/flax-dynamic-scale.md's pmap recipe: the NaN step is skipped exactly, the BatchNorm
    statistics agree across replicas, and the sharded step computes the pmap step's loss."""
    import jax
    import numpy as np

    from jaxmp._scaling._opt_state import find_loss_scaling_state

    def same(a, b):
        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    (first_before, first_after, first_loss), (before, after, nan_loss), (_, _, last_loss) = ns["history"]
    assert jax.device_count() == 8 and np.isnan(nan_loss) and np.isfinite(first_loss) and np.isfinite(last_loss)
    assert not np.asarray(ns["jaxmp"].scaling_stats(after.opt_state)["last_step_finite"]).any()
    inner = lambda s: find_loss_scaling_state(s.opt_state).inner_state   # noqa: E731
    assert same(before.params, after.params) and same(inner(before), inner(after))
    assert same(before.batch_stats, after.batch_stats)
    assert not same(first_before.batch_stats, first_after.batch_stats)  # an applied step moves them
    for state in (first_after, ns["pstate"]):
        for leaf in jax.tree.leaves(state.batch_stats):
            leaf = np.asarray(leaf)
            assert all(np.array_equal(leaf[0], leaf[i]) for i in range(leaf.shape[0]))
    assert np.isclose(float(ns["s_metrics"]["loss"]), first_loss, rtol=1e-5)


# What some pages' code must have done, beyond running without an error.
CHECKS = {"guides/flax-linen.md": _linen_trained, "diagnostics.md": _diagnostics_printed,
          "migrating/flax-dynamic-scale.md": _imagenet_recipe}
# Pages that need an optional extra (CI installs them: .ci/run).
REQUIRES = {"guides/equinox.md": "equinox", "guides/haiku.md": "haiku"}
# Every page's examples run in the slow tier (`pytest -m slow`, run by .ci/run): running the
# documentation is end to end (pages build and train models; ~50 s of compilation in all), and the
# README's test command stays within its few minutes. The default tier keeps the cheap checks of the
# same blocks: each one parses and every jaxmp name it imports exists (test_page_imports_resolve).
#: Pages whose examples run under standard dtype promotion (the rest under strict, as the suite):
#: what fails under strict is inside the third-party code they call.
STANDARD_PROMOTION_PAGES = {
    **{name: "optax.adam: bias correction is a Python float ** int32 count"
       for name in ("concepts.md", "debugging.md", "design.md", "fp8.md", "getting-started.md", "guides/equinox.md",
                    "index.md", "guides/sharded-flax.md", "guides/checkpointing.md",
                    "guides/flax-linen.md", "guides/flax-nnx.md", "guides/haiku.md", "guides/plain-jax.md",
                    "lean-recipes.md", "migrating/jmp.md", "parallel.md", "precision-search.md")},
    "diagnostics.md": "flax.linen.avg_pool divides a float16 sum by an int32 window size",
}


def _page_marks(path):
    name = str(path.relative_to(DOCS))
    marks = [pytest.mark.slow]
    if name in STANDARD_PROMOTION_PAGES:
        marks.append(pytest.mark.standard_promotion(reason=STANDARD_PROMOTION_PAGES[name]))
    return marks


@pytest.mark.parametrize("path", [pytest.param(p, marks=_page_marks(p)) for p in RUNNABLE],
                         ids=[str(p.relative_to(DOCS)) for p in RUNNABLE])
def test_page_examples_run(path, tmp_path, monkeypatch):
    name = str(path.relative_to(DOCS))
    if name in REQUIRES:
        pytest.importorskip(REQUIRES[name], reason=f"{name} needs the {REQUIRES[name]} extra")
    monkeypatch.chdir(tmp_path)  # pages that write files write them here
    namespace = run_page(path)
    check = CHECKS.get(name)
    if check is not None:
        check(namespace, tmp_path)


@pytest.mark.parametrize("path", RUNNABLE, ids=[str(p.relative_to(DOCS)) for p in RUNNABLE])
def test_page_imports_resolve(path):
    """The default tier's check of a page's code (the slow tier runs it): it parses, and every name
    it takes from jaxmp, experiments or benchmarks exists."""
    missing = missing_names("\n".join(runnable_blocks(path)))
    assert not missing, missing


def test_the_import_check_sees_a_missing_name_and_a_syntax_error():
    assert missing_names("import jaxmp\njaxmp.autocast\nfrom jaxmp.flax import linen\nlinen.MixedPrecision") == []
    assert missing_names("import jaxmp as jm\njm.no_such_function(1)") == ["jaxmp.no_such_function"]
    assert missing_names("from jaxmp.flax import NoSuchName") == ["jaxmp.flax.NoSuchName"]
    assert missing_names("import jaxmp.no_such_module") == ["jaxmp.no_such_module"]
    assert missing_names("x = (") and missing_names("x = (")[0].startswith("SyntaxError")


def test_pages_with_code_are_executed():
    # The pages that teach with code must keep teaching with code that runs.
    names = {str(p.relative_to(DOCS)) for p in RUNNABLE}
    for name in ["getting-started.md", "concepts.md", "guides/flax-linen.md", "guides/flax-nnx.md",
                 "guides/equinox.md", "guides/haiku.md", "guides/plain-jax.md", "parallel.md",
                 "diagnostics.md", "migrating/jmp.md", "migrating/flax-dynamic-scale.md", "index.md",
                 "choose-your-way-in.md", "guides/sharded-flax.md", "guides/checkpointing.md"]:
        assert name in names, f"docs/{name} has no executed python block"


def test_skip_marker_is_visible_and_sparing():
    skipped = []
    for path in pages():
        for block in python_blocks(path.read_text()):
            if is_skipped(block):
                reason = block.lstrip("\n").split("\n", 1)[0][len(SKIP_MARKER):].strip()
                assert reason, f"{path.name}: a skipped block must say why after '{SKIP_MARKER}'"
                skipped.append(path.name)
    assert len(skipped) <= 6, f"too many blocks are not run by the tests: {skipped}"


def test_every_page_is_in_the_navigation():
    nav = set(_nav_files(_mkdocs_config()["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in pages()}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - on_disk == set(), "nav entries without a page"


def test_scaling_table_is_what_the_script_prints():
    text = page("parallel.md").read_text()
    documented = re.search(r"`python -m benchmarks.scaling_model` prints:\n\n```text\n(.*?)```", text, flags=re.S)
    assert documented, "parallel.md must quote the output of benchmarks/scaling_model.py"
    module = runpy.run_path(str(ROOT / "benchmarks" / "scaling_model.py"), run_name="scaling_model")
    with contextlib.redirect_stdout(io.StringIO()):
        printed = module["main"]([])
    assert documented.group(1).strip() == printed.strip()
    # The model's arithmetic on one row by hand: ResNet-50, 8 devices, fp32, no overlap.
    comm = 2 * 7 / 8 * 25.6e6 * 4 / 12.5e9 + 2 * 7 * 5e-6
    assert abs(module["efficiency"](0.268, comm, 0.0) - 0.268 / (0.268 + comm)) < 1e-12
    assert "94.9%" in printed and "not a measurement" in printed


def test_architecture_page_names_every_module():
    text = page("architecture.md").read_text()
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxmp").rglob("*.py"))
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not list: {missing}"
    listed = set(re.findall(r"`(jaxmp/[\w/]+\.py)`", text))
    gone = sorted(m for m in listed if not (ROOT / m).is_file())
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


def test_recorded_results_are_included_not_copied():
    # The experiments page shows the recorded table by including the file the run wrote.
    text = page("experiments.md").read_text()
    for recorded in sorted((ROOT / "experiments" / "recorded").glob("*/results.md")):
        assert f'--8<-- "{recorded.relative_to(ROOT).as_posix()}"' in text, f"experiments.md does not show {recorded}"
    for png in re.findall(r"\]\((recorded/[\w/.-]+\.png)\)", text):
        assert (ROOT / "experiments" / png).is_file(), png


def test_home_page_leads_with_the_readme_quick_start():
    # One way in, one source: the docs home shows the README's quick start, block for block.
    from tests._support._markdown import section
    home = page("index.md").read_text()
    assert home.index("## Quick start") < home.index("## What is inside")
    readme_blocks = python_blocks(section("Quick start"))
    assert python_blocks(section("Quick start", page("index.md"))) == readme_blocks
    assert "choose-your-way-in.md" in section("Quick start", page("index.md"))


def test_home_page_shows_every_headline_capability():
    inside = " ".join(section_text.split()) if (section_text := __import__("tests._support._markdown", fromlist=["*"]).section(
        "What is inside", page("index.md"))) else ""
    for link in ("autocast.md", "concepts.md#master-weights", "guides/flax-linen.md", "guides/flax-nnx.md",
                 "parallel.md", "guides/sharded-flax.md", "lean-recipes.md", "fp8.md", "diagnostics.md",
                 "guides/checkpointing.md", "experiments.md"):
        assert f"]({link})" in inside, link
    assert 'layout="zero"' in inside and "master_weights=True" in inside
    # Text for the project's builders lives on the design page, not on user pages.
    assert "mkdocs" not in page("index.md").read_text()
    assert "## Why the site is built with mkdocs" in page("design.md").read_text()


def test_choose_your_way_in_answers_the_questions():
    text = " ".join(page("choose-your-way-in.md").read_text().split())
    for door in ("`jaxmp.autocast(fn, \"O1\")`", "`jaxmp.flax.mixed_precision(model, \"O1\")`",
                 "`Policy.cast_to_compute`"):
        assert door in text, door
    assert "set_global_policy" in text and "no global policy" in text
    assert "prefer autocast" in text
    # The global-policy answer points at what exists.
    for name in ("float32_region", "autocast_region", "recommended_policy"):
        assert callable(getattr(__import__("jaxmp"), name)), name
