"""benchmarks/precision_search.py (issue 62's table): its quick mode on the VAE, the committed
result and docs table, and the vendored flax examples being the sdist's files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import precision_search as ps

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "precision_search.json"

#: sha256 of each vendored file as the flax 0.12.8 sdist ships it (flax-0.12.8/examples/...).
VENDORED = {
    "benchmarks/_vendored/flax_lm1b_models.py": "9090c0bf0aefa9853d609514b26e31c9f6e461b4d2f5d6a09411d4c20bc5ae82",
    "benchmarks/_vendored/flax_vae_models.py": "82e4f8fbd2e07edb66395ef095d3fd16d03be1b191c14d3d722cc27ab1dae05e",
}


@pytest.mark.parametrize("path", sorted(VENDORED))
def test_vendored_file_is_the_sdists_but_for_its_header(path):
    """The vendoring note (from its leading '#' line to the ``ruff: noqa`` line) removed, the file is
    byte for byte flax 0.12.8's: the models were not edited."""
    lines = (ROOT / path).read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("# Vendored verbatim from google/flax"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# ruff: noqa"))
    assert lines[start - 1] == "#\n" and start < end
    original = "".join(lines[:start - 1] + lines[end + 1:])
    assert hashlib.sha256(original.encode()).hexdigest() == VENDORED[path]


def _check_model(name: str, model: dict) -> None:
    """What every model's entry must hold, quick or full."""
    vs, f32 = model["variants"], np.asarray(model["variants"]["float32"]["final"])
    assert model["search"]["gave_up"] or set(vs) == set(ps.VARIANTS), (name, sorted(vs))
    assert model["float32_spread"] == pytest.approx(f32.max() - f32.min())
    for v, row in vs.items():
        assert len(row["final"]) == len(ps.SEEDS) and np.all(np.isfinite(row["final"])), (name, v)
        assert sum(row["shares"].values()) == pytest.approx(1.0), (name, v, row["shares"])
        assert row["bits"] == pytest.approx(sum(ps.BITS[r] * s for r, s in row["shares"].items()))
        # within: the mean's distance to float32's mean at most float32's seed spread
        assert row["within"] == (abs(np.mean(row["final"]) - f32.mean()) <= model["float32_spread"]), (name, v)
        if v in ps.PRESETS or v == "float32":
            assert row["shares"][v] == 1.0
    if "chosen" in vs:
        # the rules rebuilt from the modules' rungs are the rules the search printed
        namespace = {"jaxmp": __import__("jaxmp"), "loss_fn": lambda *a: 0.0}
        exec(model["rules_code"], namespace)  # noqa: S102 - the printed code is what a user pastes: run it as such
        assert ps.rules_from_modules(model["modules"], model["policy"]) == namespace["rules"]
        flops = sum(m["flops"] for m in model["modules"]) + model["unscoped_flops"]
        for rung, share in vs["chosen"]["shares"].items():
            at = sum(m["flops"] for m in model["modules"] if m["rung"] == rung)
            at += model["unscoped_flops"] if rung == model["policy"] else 0
            assert share == pytest.approx(at / flops), (name, rung)


# 3.5 to 13 minutes on 2 shared cores (searches and trains 5 variants x 3 seeds): the slow tier.
@pytest.mark.slow
def test_quick_run_on_the_vae_reports_every_variant_and_reproduces(tmp_path):
    """The script's quick mode on google/flax's VAE: every variant on 3 seeds, shares summing to 1,
    and the chosen rules rebuilt from the JSON train seed 0 to the very loss it recorded."""
    import jax

    import jaxmp
    from benchmarks import _search_models

    out = tmp_path / "ps.json"
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction mixes a float and an int32 count
        result = ps.main(["--quick", "--quiet", "--models", "flax_vae", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == json.loads(json.dumps(result["results"]))
    model = written["results"]["models"]["flax_vae"]
    assert written["config"]["ladder"] == ["O2-bf16", "float32"] and not model["search"]["gave_up"]
    _check_model("flax_vae", model)
    assert model["search"]["cost_steps"] >= 3 * written["config"]["search_steps"]
    table = ps.table(written)
    assert all(f"| flax_vae | {v} |" in table for v in ps.VARIANTS)
    task = _search_models.task("flax_vae", quick=True)
    rules = ps.rules_from_modules(model["modules"], model["policy"])
    with jax.numpy_dtype_promotion("standard"):
        final, _ = ps._trainer(jaxmp.autocast(task.loss, model["policy"], rules=rules), task, 3)(0)
    assert final == model["variants"]["chosen"]["final"][0]


@pytest.mark.skipif(not RESULT.exists(), reason="no committed precision_search.json")
def test_committed_table_is_whole_and_the_docs_show_it():
    result = json.loads(RESULT.read_text())
    models = result["results"]["models"]
    assert not result["dry_run"] and len(models) >= 1
    for name, model in models.items():
        _check_model(name, model)
        assert model["verdict"] == ps.verdict(model)
    assert ps.table(result) in (ROOT / "docs" / "precision-search.md").read_text()
