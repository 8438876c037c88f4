"""benchmarks/fidelity.py (lean recipes against float32 masters): its dry run, the LM's offline text and
batches (benchmarks/_lm.py), the ulp arithmetic, and experiments' ``lean_recipe`` config field."""

from __future__ import annotations

import json
import socket

import jax.numpy as jnp

import jaxmp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import _lm, fidelity


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_lm_text_is_stdlib_docstrings_deterministic_and_offline(no_network):
    a, b = _lm.load_text(), _lm.load_text()
    assert a.sha256 == b.sha256 and np.array_equal(a.train, b.train) and np.array_equal(a.eval, b.eval)
    assert a.num_chars == len(a.train) + len(a.eval) > 100_000
    assert len(a.eval) == a.num_chars - int(a.num_chars * (1 - _lm.EVAL_FRACTION))
    # The first module's docstring comes first, as the source file has it.
    import argparse

    assert _lm.decode(a.train[:200]) == argparse.__doc__.strip()[:200]
    assert "standard-library modules" in a.source and "argparse" in a.source
    assert a.train.max() < len(_lm.VOCAB)
    # The order of the modules is the order of the text.
    swapped = _lm.load_text(("textwrap", "argparse"))
    assert _lm.decode(swapped.train[:40]) != _lm.decode(a.train[:40])


def test_lm_encoding_maps_unknown_characters_to_question_mark():
    assert _lm.decode(_lm.encode("ab\nZ~ ")) == "ab\nZ~ "
    assert _lm.decode(_lm.encode("é\t€")) == "???"
    assert len(_lm.VOCAB) == 96 and _lm.encode("\n")[0] == 0


def test_lm_batches_depend_on_seed_and_step_only_and_predict_the_next_character():
    ids = np.arange(1000) % 96
    b1 = _lm.train_batch(ids, step=7, batch_size=4, context=16, seed=3)
    b2 = _lm.train_batch(ids, step=7, batch_size=4, context=16, seed=3)
    assert np.array_equal(b1["inputs"], b2["inputs"]) and np.array_equal(b1["label"], b2["label"])
    assert not np.array_equal(b1["inputs"], _lm.train_batch(ids, 8, 4, 16, 3)["inputs"])
    assert not np.array_equal(b1["inputs"], _lm.train_batch(ids, 7, 4, 16, 4)["inputs"])
    assert b1["inputs"].shape == (4, 16) and b1["inputs"].dtype == np.int32
    assert np.array_equal(b1["label"][:, :-1], b1["inputs"][:, 1:])
    evals = list(_lm.eval_batches(ids[:100], batch_size=2, context=16))
    windows = np.concatenate([e["inputs"] for e in evals])
    assert windows.shape == (6, 16)                              # (100 - 1) // 16 consecutive windows
    assert np.array_equal(windows.ravel(), ids[:96])
    assert len(list(_lm.eval_batches(ids, 4, 16, max_windows=5))) == 2


def test_bf16_ulp_is_the_spacing_of_bfloat16():
    x = np.array([1.0, 0.75, -3.0, 1e-3, 0.0], np.float32)
    ulp = fidelity.bf16_ulp(x)
    assert ulp[:3].tolist() == [2.0**-7, 2.0**-8, 2.0**-6] and ulp[4] == 0
    for v, u in zip(x[:4], ulp[:4]):
        b = np.abs(v).astype(ml_dtypes.bfloat16)
        assert float(np.nextafter(b, np.array(np.inf, ml_dtypes.bfloat16))) - float(b) == u
    r = fidelity.update_ulp_ratios([np.ones(3)], [np.array([1.0, 1 + 2.0**-9, 1 - 2.0**-6])], [np.ones(3)])
    assert r.tolist() == [0.0, 0.25, 2.0]
    stats = fidelity.TailStats()
    stats.add(r)
    assert stats.result(1, 1, 0.1, 0.0)["fraction_below_half_ulp"] == pytest.approx(2 / 3)


def test_experiments_lean_recipe_is_validated_against_the_policy():
    from experiments import configs
    from experiments.program import lean_optimizer
    from experiments.validation import UserError, validate_config

    c = configs.get_config("cpu")
    c.lean_recipe = "bf16-sr"
    plan = validate_config(c, policy="O2-bf16", num_train_examples=16000)
    assert plan.lean_recipe == "bf16-sr" and plan.master_weights is False
    c.lean_recipe = ""
    assert validate_config(c, policy="O2-bf16", num_train_examples=16000).master_weights is True
    c.lean_recipe = "bf16-sr"
    with pytest.raises(UserError, match="keeps bfloat16 params, but policy O2-fp16 stores float16"):
        validate_config(c, policy="O2-fp16")
    c.lean_recipe = "bf16"
    with pytest.raises(UserError, match=r"lean_recipe='bf16' is invalid: choose one of .*'bf16-nearest'"):
        validate_config(c, policy="O2-bf16")
    import optax

    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = lean_optimizer(optax.sgd(1e-4), "bf16-nearest", seed=0)
    updates, _ = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, tx.init(params), params)
    assert float(jnp.abs(updates["w"]).max()) == 0.0              # below half an ulp: dropped


def test_the_quantized_study_variants_quantize_every_leaf_with_their_rounding():
    # The MNIST-1D CNN has no leaf of 4096 elements: the presets would quantize nothing there.
    import optax

    from experiments.program import lean_optimizer
    from experiments.validation import LEAN_QUANTIZED_STUDY, lean_recipes
    from jaxmp import lean

    params = {"w": jnp.ones((8, 16), jnp.bfloat16)}
    assert set(LEAN_QUANTIZED_STUDY) <= set(lean_recipes())
    for name, (bits, stochastic) in LEAN_QUANTIZED_STUDY.items():
        state = lean_optimizer(optax.adam(1e-3), name, seed=3).init(params)
        q = jaxmp._tree.find_states(state, lean.QuantizedMomentsState)[0]
        assert q.grid.bits == bits and q.inner_state[0].mu["w"].dtype == jnp.uint8
        assert bool((q.key != 0).any()) == stochastic    # nearest moments keep no key


@pytest.mark.slow  # ~25 s: both jobs, every recipe, two seeds (the committed result's schema is checked by the default tier)
@pytest.mark.standard_promotion(reason="the main job steps optax.adamw (bias correction: Python float ** int32 count)")
def test_fidelity_dry_run_writes_the_result(tmp_path):
    out = tmp_path / "fid.json"
    result = fidelity.main(["--dry-run", "--quiet", "--recipes", "fp32-masters,bf16-nearest", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["benchmark"] == "fidelity" and on_disk["dry_run"] is True
    assert on_disk["command"].startswith("python -m benchmarks.fidelity --dry-run")
    env = on_disk["env"]
    assert env["versions"]["jax"] and env["git_commit"]["sha"] and len(env["load_average_start"]) == 3
    assert on_disk["config"]["seeds"] == [0, 1]
    for job in ("main", "lm"):
        res = on_disk["results"][job]
        for recipe in ("fp32-masters", "bf16-nearest"):
            runs = res["runs"][recipe]
            assert [r["seed"] for r in runs] == [0, 1]
            assert all(r["eval_loss"] > 0 and 0 <= r["eval_accuracy"] <= 1 for r in runs)
            s = res["summary"][recipe]["eval_loss"]
            assert s["per_seed"] == [r["eval_loss"] for r in runs] and isinstance(s["within"], bool)
            assert s["tolerance"] >= 0.01 * res["summary"]["fp32-masters"]["eval_loss"]["mean"]
        assert res["summary"]["fp32-masters"]["eval_loss"]["diff_from_reference"] == 0
        assert len(res["tail"]) == 2 and all(t["median_update_over_ulp"] > 0 for t in res["tail"])
        assert all(0 <= t["fraction_below_half_ulp"] <= 1 for t in res["tail"])
    # The main job's tail is measured by replaying the reference run: it must be that run.
    assert all(t["replay_equals_run"] for t in on_disk["results"]["main"]["tail"])
    assert result["results"]["lm"]["setup"]["text_sha256"] == _lm.load_text(max_chars=20000).sha256


def test_fidelity_help():
    assert "--dry-run" in fidelity.build_parser().format_help()


def test_docs_table_is_what_the_committed_result_prints():
    from benchmarks._common import REPO_ROOT

    result = json.loads((REPO_ROOT / "benchmarks" / "results" / "fidelity" / "fidelity_cpu.json").read_text())
    assert result["dry_run"] is False and result["config"]["seeds"] == [0, 1, 2]
    assert set(result["config"]["recipes"]) == set(fidelity.RECIPES) - set(fidelity.QUANTIZED_STUDY)
    page = (REPO_ROOT / "docs" / "lean-recipes.md").read_text()
    assert fidelity.markdown(result) in page
    # The quantized presets with every leaf quantized: their own study, against the same reference.
    study = json.loads((REPO_ROOT / "benchmarks" / "results" / "fidelity" / "fidelity_quantized_cpu.json").read_text())
    assert study["dry_run"] is False and study["config"]["seeds"] == [0, 1, 2]
    assert set(study["config"]["recipes"]) == {fidelity.REFERENCE, *fidelity.QUANTIZED_STUDY}
    assert fidelity.markdown(study) in page
    assert "python -m benchmarks.fidelity" in page and result["results"]["lm"]["setup"]["text_sha256"][:16] in page
