"""The experiments' model trained through jaxmp.autocast (engine="autocast"): it reaches O0's
accuracy on the main job's dataset, as the Flax path does. CI size: O1-fp16 only, one seed, 250 steps
(the recorded 3-seed run in experiments/recorded/cpu_autocast covers O1, O2-bf16 and O2-fp16).

``compare`` runs in this process (as tests/experiments/test_fp8.py does): the command line and
its printed table are tested by test_compare.py, and a second process would only add its start-up
(importing TensorFlow for the metric writers, ~10 CPU-seconds)."""

import pytest

from experiments import configs as configs_lib

pytestmark = pytest.mark.slow  # end-to-end: run by .ci/run and `pytest -m slow`


@pytest.mark.standard_promotion(reason="optax.adamw's bias correction: Python float ** int32 count")
def test_autocast_engine_trains_to_o0_accuracy(tmp_path):
    from experiments import compare

    config = configs_lib.get_config("cpu")
    config.num_epochs, config.progress_bar, config.engine = 2.0, False, "autocast"  # 250 steps
    out = compare.compare(config, str(tmp_path), policies=["O0", "O1-fp16"], num_seeds=1, isolate="false",
                          plots=False, config_name="cpu")
    rows = {r["policy"]: r for r in out["rows"]}
    assert all(r["steps"] == 250 for r in rows.values()), rows
    o0 = rows["O0"]["val_accuracy"]
    assert o0 >= 0.85, rows
    for p in ("O1-fp16",):
        assert abs(rows[p]["val_accuracy"] - o0) <= 0.015, (p, rows[p]["val_accuracy"], o0)
    assert rows["O1-fp16"]["loss_scaling"] == "dynamic" and rows["O1-fp16"]["skipped_steps"] == 0
