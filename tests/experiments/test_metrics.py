"""Metrics: a run writes TensorBoard event files (clu.metric_writers) that TensorBoard's own
reader reads back with the expected tags, beside history.jsonl and results.json; progress is
plain periodic lines when not on a terminal."""

import io
import json
import pytest

from experiments import configs as configs_lib
from experiments import train
from experiments.progress import Progress

TAGS = {"loss", "accuracy", "loss_scale", "skipped_steps", "step_time", "throughput", "val_loss", "val_accuracy"}


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_event_files_read_back_with_expected_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    c = configs_lib.get_config("cpu")
    c.policy, c.num_train_steps, c.log_every_steps, c.eval_every_steps = "O1", 40, 10, 20
    c.checkpoint_every_steps, c.progress_bar = 40, False
    r = train.train_and_evaluate(c, str(tmp_path))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    # TF2 summaries are stored as tensors; the TB reader lists them under "tensors".
    tags = set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])
    assert TAGS <= tags, tags
    steps = [e.step for e in acc.Tensors("loss")]
    assert steps == [10, 20, 30, 40]
    import numpy as np
    from tensorboard.util import tensor_util

    scale = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("loss_scale")]
    assert scale[-1] == r["final_loss_scale"]
    last_acc = float(tensor_util.make_ndarray(acc.Tensors("val_accuracy")[-1].tensor_proto))
    assert np.isclose(last_acc, r["val_accuracy"])
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == steps and all(h["throughput"] > 0 for h in history)
    assert json.loads((tmp_path / "results.json").read_text())["steps"] == 40


def test_progress_without_terminal_prints_plain_lines_with_eta():
    out = io.StringIO()
    with Progress(10, "demo", stream=out, interval_s=0) as p:
        for _ in range(10):
            p.update(1, loss=0.5)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("demo: 1/10 (10%)") and "ETA" in lines[0] and "loss 0.5" in lines[0]
    assert lines[-1].endswith("(done)") and "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    quiet = io.StringIO()
    with Progress(10, "demo", stream=quiet, enabled=False) as p:
        p.update(10)
    assert quiet.getvalue() == ""
