"""Kill -9 a run after a checkpoint, start it again in the same workdir: on CPU it ends
bit-identical to an uninterrupted run (params, fp32 master params, optimizer moments, loss
scale and its counters, BatchNorm statistics, step)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from experiments.checkpoint import load_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=experiments/configs/cpu.py", "--config.policy=O2-fp16", "--config.num_train_steps=200",
        "--config.checkpoint_every_steps=40", "--config.eval_every_steps=50", "--config.progress_bar=false"]


def _main(workdir, **kw):
    return subprocess.Popen([sys.executable, "-m", "experiments.main", *ARGS, f"--workdir={workdir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_sigkill_and_resume_is_bit_identical(tmp_path):
    ref, cut = tmp_path / "uninterrupted", tmp_path / "killed"
    proc = _main(ref)
    assert proc.wait(timeout=180) == 0, proc.stdout.read()[-3000:]

    proc = _main(cut)
    deadline = time.time() + 180
    while not (cut / "checkpoints" / "40").is_dir():  # orbax renames a finished checkpoint into place
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    steps = sorted(int(d) for d in os.listdir(cut / "checkpoints") if d.isdigit())
    assert steps and steps[-1] < 200, f"the run finished before it was killed: {steps}"

    proc = _main(cut)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed from {cut / 'checkpoints'} at step {steps[-1]}" in out

    (sa, a), (sb, b) = load_state(ref), load_state(cut)
    assert sa == sb == 200
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb] and len(la) > 20
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)
    # The checkpoint holds the mixed-precision state: half params and their fp32 masters.
    dtypes = {jax.tree_util.keystr(p): np.asarray(x).dtype for p, x in la}
    assert any("params" in k and "Conv" in k and d == np.float16 for k, d in dtypes.items())
    assert any("master_params" in k and d == np.float32 for k, d in dtypes.items())
    assert any("loss_scale" in k for k in dtypes)
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (ref, cut))
    assert ra["val_accuracy"] == rb["val_accuracy"] and ra["final_loss_scale"] == rb["final_loss_scale"]
    assert [h["step"] for h in rb["history"]] == [h["step"] for h in ra["history"]]
