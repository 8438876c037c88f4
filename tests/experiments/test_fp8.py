"""The main job under O2-fp8 (delayed scaling, emulated on CPU): it trains to O2-bf16's accuracy,
its checkpoints hold the fp8 state (verified by the manifest like every other array), and a run
resumed from a checkpoint ends bitwise equal to the uninterrupted run.

CI size: one seed, a 500-step schedule (``--config.num_epochs=4``), O2-bf16 and O2-fp8 only; the
recorded 3-seed, 1000-step run (experiments/recorded/cpu_fp8) adds O2-fp8-current. At 500 steps
the three seeds we measured put O2-fp8 0.1 point above to 0.6 point below O2-bf16 (at 250 steps
one seed was 1.6 points below), so the issue's 1-point bound is asserted at 500 steps.
"""

import json
import os
import shutil

import numpy as np
import pytest

from experiments import checkpoint as ckpt_lib
from experiments import configs as configs_lib
from experiments import drills

pytestmark = pytest.mark.slow  # end-to-end: run by .ci/run and `pytest -m slow`

STEPS = 500


def _config():
    c = configs_lib.get_config("cpu_fp8")
    c.num_epochs = 4.0  # 125 steps per epoch at batch 128: 500 steps
    c.progress_bar = False
    return c


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """``compare`` in this process (no subprocess start-up): O2-bf16 and O2-fp8, seed 0."""
    from experiments import compare

    workdir = tmp_path_factory.mktemp("fp8_compare")
    out = compare.compare(_config(), str(workdir), policies=["O2-bf16", "O2-fp8"], num_seeds=1, isolate="false",
                          plots=False, config_name="cpu_fp8")
    return workdir, out


def test_o2_fp8_trains_to_o2_bf16_accuracy(comparison):
    _, out = comparison
    rows = {r["policy"]: r for r in out["rows"]}
    assert list(rows) == ["O2-bf16", "O2-fp8"]
    for r in rows.values():
        assert r["steps"] == STEPS and r["skipped_steps"] == 0 and r["loss_scaling"] == "none"
    assert rows["O2-fp8"]["dtypes"] == "p=bf16,c=bf16,o=f32 + fp8 delayed"
    bf16, f8 = rows["O2-bf16"]["val_accuracy"], rows["O2-fp8"]["val_accuracy"]
    assert bf16 >= 0.95, rows  # it trained (chance is 10%)
    assert abs(f8 - bf16) <= 0.01, (f8, bf16)


def test_o2_fp8_checkpoint_holds_the_updated_fp8_state_and_the_manifest_covers_it(comparison):
    workdir, _ = comparison
    run = os.path.join(workdir, "runs", "O2-fp8_seed0")
    step, state = ckpt_lib.load_state(run)  # checks every array against the manifest's SHA-256
    assert step == STEPS
    meta = state["model_state"]["fp8_meta"]
    assert sorted(meta) == ["Conv_0", "Conv_1", "Conv_2", "Dense_0"]  # every conv and dense of cnn1d
    for layer, ops in meta.items():
        (leaves,) = ops.values()
        for tensor in ("input", "kernel", "output_grad"):
            history, scale = leaves[f"{tensor}_amax_history"], leaves[f"{tensor}_scale"]
            assert history.dtype == scale.dtype == np.float32 and history.shape == (1024,)
            # One amax recorded per step (the history is 1024 long), and the scale moved off 1.
            assert np.count_nonzero(history) == STEPS, (layer, tensor)
            assert np.isfinite(scale) and scale > 1, (layer, tensor, scale)
    # The saved manifest lists each of the 4 x 6 fp8 arrays, and the shard records hold their
    # checksums (load_state above verified them), so damage to the fp8 state is found like damage
    # to the params.
    step_dir = os.path.join(run, "checkpoints", str(step))
    with open(os.path.join(step_dir, "manifest", "metadata")) as f:
        manifest = json.load(f)
    fp8_arrays = [a for a in manifest["arrays"] if "fp8_meta" in a["path"]]
    assert len(fp8_arrays) == 4 * 6 and all(a["dtype"] == "float32" for a in fp8_arrays)
    records = ckpt_lib.read_shard_records(step_dir, manifest, step)
    assert all(len(records[a["key"]]) >= 1 and all(len(r["sha256"]) == 64 for r in records[a["key"]])
               for a in fp8_arrays)
    # The bf16 run has no fp8 state at all.
    _, bf16_state = ckpt_lib.load_state(os.path.join(workdir, "runs", "O2-bf16_seed0"))
    assert "fp8_meta" not in bf16_state["model_state"]


def test_o2_fp8_resume_is_bitwise_equal_to_the_uninterrupted_run(comparison, tmp_path):
    from experiments import train

    workdir, out = comparison
    full = os.path.join(workdir, "runs", "O2-fp8_seed0")
    # The run as a process killed after its step-250 checkpoint left it: only that step on disk.
    cut = tmp_path / "resumed"
    shutil.copytree(os.path.join(full, "checkpoints", "250"), cut / "checkpoints" / "250")
    r = train.train_and_evaluate(_config(), str(cut), policy="O2-fp8", seed=0)
    assert r["resumed_from"] == 250 and r["steps_this_run"] == STEPS - 250
    assert drills.states_equal(ckpt_lib.load_state(str(cut), STEPS)[1], ckpt_lib.load_state(full, STEPS)[1])
    (uninterrupted,) = [x for x in out["runs"] if x["policy"] == "O2-fp8"]
    assert r["val_accuracy"] == uninterrupted["val_accuracy"]


def test_the_fp8_tables_in_the_readmes_are_the_recorded_results():
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    recorded = os.path.join(root, "experiments", "recorded", "cpu_fp8")
    with open(os.path.join(recorded, "results.json")) as f:
        data = json.load(f)
    assert data["meta"]["seeds"] == [0, 1, 2] and [r["steps"] for r in data["rows"]] == [1000] * 3
    want = {r["policy"]: f"{100 * r['val_accuracy']:.2f}% ± {100 * r['val_accuracy_std']:.2f}" for r in data["rows"]}
    seeds = {p: " / ".join(f"{100 * r['val_accuracy']:.2f}" for r in sorted(data["runs"], key=lambda r: r["seed"])
                           if r["policy"] == p) for p in want}
    for readme in (os.path.join(recorded, "README.md"), os.path.join(root, "experiments", "README.md")):
        text = open(readme).read()
        command = re.sub(r" *\\\n *", " ", text)  # a command reflowed with backslashes reads as one line
        assert "--config=experiments/configs/cpu_fp8.py --workdir=/tmp/jaxmp_fp8 --seeds=3" in command, readme
        for policy, acc in want.items():
            row = re.search(rf"^\| {re.escape(policy)}[ (][^|]*\| ([^|]*) \|(?: ([^|]*) \|)?$", text, flags=re.M)
            assert row and row.group(1) == acc, (readme, policy, row and row.group(0), acc)
            if row.group(2) is not None:
                assert row.group(2) == seeds[policy], (readme, policy, row.group(2), seeds[policy])


def test_the_block_presets_rows_are_labelled_with_their_format():
    from experiments.train import dtypes_label

    labels = {p: dtypes_label(p) for p in ("O2-fp8-current", "O2-mxfp8", "O2-fp8-rowwise", "O2-nvfp4")}
    assert labels["O2-fp8-current"].endswith("+ fp8 current")
    assert labels["O2-mxfp8"].endswith("+ float8_e4m3fn 1x32 blocks")
    assert labels["O2-fp8-rowwise"].endswith("+ float8_e4m3fn row blocks")
    assert labels["O2-nvfp4"].endswith("+ float4_e2m1fn 1x16 blocks")
    assert len(set(labels.values())) == 4  # every row tells its format
