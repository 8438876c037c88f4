"""Reruns, clashes and write failures in one workdir (issue 25, items 2, 9, 10, 11):

* a finished run -- completed, or stopped because it diverged -- is read back, never retrained,
  and a rerun of compare leaves its result files byte-identical;
* every config value that changes what a run computes is recorded with the checkpoint: resuming,
  or reading back a finished run, under another value is refused, naming the field, both values
  and how to start fresh;
* a workdir is locked while a run uses it (a second process is refused, naming the holder, and
  nothing of the first is touched; the kernel drops the lock of a killed run), and a run that dies
  before its first checkpoint leaves the workdir reusable;
* a full disk while saving is a clear error naming the workdir and the space the last checkpoint
  took (exit 1, no traceback, never 134); older steps stay intact and the resume is bit-exact.

Tiny runs: 20 steps on a 2,000-example MNIST-1D.
"""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from experiments import checkpoint as ckpt_lib
from experiments import configs as configs_lib
from experiments import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 20
FLAGS = ["--config=cpu", f"--config.num_train_steps={STEPS}", "--config.checkpoint_every_steps=10",
         "--config.eval_every_steps=10", "--config.log_every_steps=5", "--config.progress_bar=false",
         "--config.mnist1d_num_samples=2000"]


def _config(**over):
    c = configs_lib.get_config("cpu")
    c.num_train_steps, c.checkpoint_every_steps, c.eval_every_steps, c.log_every_steps = STEPS, 10, 10, 5
    c.progress_bar, c.mnist1d_num_samples, c.keep_checkpoints = False, 2000, 3
    for k, v in over.items():
        c[k] = v
    return c


def _diverging(**over):
    """O2-fp16 from loss scale 2**24 with no skipped step allowed: stops ("diverged") at step 5."""
    return _config(policy="O2-fp16", loss_scale="dynamic", dynamic_scale_init=2.0**24, max_consecutive_skips=0,
                   **over)


def _train(config, wd, **kw):
    from experiments import train

    return train.train_and_evaluate(config, str(wd), **kw)


def _files(wd):
    """Every file under ``wd`` with its bytes (the lock file aside: its holder changes)."""
    out = {}
    for root, _, names in os.walk(wd):
        for n in names:
            p = os.path.join(root, n)
            if n != workdir_lock.LOCK_NAME:
                out[os.path.relpath(p, wd)] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A completed 20-step O0 run (checkpoints at 10 and 20)."""
    wd = tmp_path_factory.mktemp("finished") / "run"
    r = _train(_config(), wd)
    assert r["steps"] == STEPS and not r["diverged"]
    return wd


# ---- item 2: a finished run is read back, never retrained ----


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_diverged_run_is_read_back_not_retrained(tmp_path):
    wd = tmp_path / "run"
    first = _train(_diverging(), wd)
    assert first["diverged"] and first["steps"] == 5, (first["diverged"], first["steps"])
    before = _files(wd)
    again = _train(_diverging(), wd)
    assert again["reused"] is True
    assert again["steps"] == 5 and again["skipped_steps"] == first["skipped_steps"]
    assert again["history"] == first["history"]
    assert _files(wd) == before  # no new checkpoint, history or results


@pytest.mark.slow  # reads back the `finished` run: ~10 s of training for the module's first user
def test_completed_run_is_read_back_not_retrained(finished, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    before = _files(wd)
    r = _train(_config(), wd)
    assert r["reused"] is True and r["steps"] == STEPS
    assert _files(wd) == before


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_compare_rerun_leaves_results_unchanged(tmp_path):
    from experiments import compare

    def run():
        return compare.compare(_diverging(), str(tmp_path), policies=["O0", "O2-fp16"], num_seeds=1, isolate="false",
                               plots=False, scale_demo=False)

    first = run()
    assert [r["steps"] for r in first["runs"]] == [STEPS, 5]
    files = {n: (tmp_path / n).read_bytes() for n in ("results.json", "results.csv", "results.md")}
    again = run()
    assert [r["steps"] for r in again["runs"]] == [STEPS, 5]
    for n, data in files.items():
        assert (tmp_path / n).read_bytes() == data, n


# ---- item 9: every result-changing setting is recorded and checked ----

CHANGES = [("base_learning_rate", 0.5), ("weight_decay", 0.1), ("label_smoothing", 0.1), ("warmup_epochs", 0.0),
           ("lr_schedule", "linear"), ("mnist1d_num_samples", 3000), ("grad_clip_norm", 1.0),
           ("max_consecutive_skips", 5)]


@pytest.mark.parametrize("field,value", CHANGES, ids=[c[0] for c in CHANGES])
def test_every_result_changing_setting_is_in_what_a_checkpoint_records(field, value):
    """The default tier's half of the refusal below (no training): each field is recorded."""
    from experiments import train
    from experiments.validation import validate_config

    def settings(config):
        return train.run_settings(config, validate_config(config, num_train_examples=config.mnist1d_num_samples))

    before, after = settings(_config()), settings(_config(**{field: value}))
    assert before[field] == _config()[field] and after[field] == value
    assert {k for k in before if before[k] != after.get(k)} >= {field}


@pytest.mark.slow  # each refusal reads the trained `finished` run
@pytest.mark.parametrize("field,value", CHANGES, ids=[c[0] for c in CHANGES])
def test_finished_run_with_other_setting_is_refused(finished, tmp_path, field, value):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    before = _files(wd)
    old = _config()[field]
    with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
        _train(_config(**{field: value}), wd)
    msg = str(e.value)
    assert f"{field}: checkpoint {old!r} vs now {value!r}" in msg, msg
    assert "new --workdir" in msg and f"--config.{field}={old}" in msg, msg
    assert _files(wd) == before  # results.json still describes the run that was trained


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="the O0 resume traces optax.adam afresh when the refusals above evicted "
                                       "its program (bias correction: Python float ** int32 count)")
def test_resume_with_other_learning_rate_is_refused_and_same_settings_resume(finished, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    shutil.rmtree(wd / "checkpoints" / str(STEPS))  # as if killed after step 10's checkpoint
    os.remove(wd / "results.json")
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"base_learning_rate: checkpoint 0\.01 vs now 0\.5"):
        _train(_config(base_learning_rate=0.5), wd)
    r = _train(_config(), wd)  # the same settings resume, and results.json says which
    ref = json.loads((finished / "results.json").read_text())
    assert r["resumed_from"] == 10 and r["val_accuracy"] == ref["val_accuracy"]
    assert r["settings"]["base_learning_rate"] == 0.01 and r["settings"] == ref["settings"]


def test_the_device_count_is_free_on_a_resume_but_the_global_batch_is_not():
    saved = {"num_devices": 1, "per_device_batch_size": 128, "base_learning_rate": 0.01}
    now = {"num_devices": 4, "per_device_batch_size": 32, "base_learning_rate": 0.01}
    assert ckpt_lib.settings_diffs(saved, now, 10, "d") == {}
    assert ckpt_lib.settings_diffs(saved, {**now, "base_learning_rate": 0.5}, 10, "d") == {
        "base_learning_rate": (0.01, 0.5)}


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_a_run_saved_on_1_device_resumes_on_4_with_the_same_global_batch(finished, tmp_path, capfd):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    shutil.rmtree(wd / "checkpoints" / str(STEPS))  # as if killed after step 10's checkpoint
    os.remove(wd / "results.json")
    # 4 devices x 128 is another global batch (512): another run, refused by name.
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"global_batch_size: checkpoint 128 vs now 512"):
        _train(_config(num_devices=4), wd)
    capfd.readouterr()
    r = _train(_config(num_devices=4, per_device_batch_size=32), wd)  # 4 x 32 = 128, as saved
    assert "at step 10, from 1 onto 4 devices (same global batch 128)" in capfd.readouterr().err
    ref = json.loads((finished / "results.json").read_text())
    assert r["resumed_from"] == 10 and r["steps"] == STEPS
    # The same steps on the same examples; only the order of the gradient sum over devices differs.
    assert abs(r["val_accuracy"] - ref["val_accuracy"]) <= 0.01, (r["val_accuracy"], ref["val_accuracy"])
    assert abs(r["history"][-1]["train_loss"] - ref["history"][-1]["train_loss"]) <= 1e-3 * ref["history"][-1]["train_loss"]


# ---- item 10: one run per workdir ----


@pytest.mark.slow
def test_second_process_in_a_locked_workdir_is_refused_and_nothing_is_touched(finished, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    before = _files(wd)
    with workdir_lock.WorkdirLock(str(wd), what="the test's run"):
        out = subprocess.run([sys.executable, "-m", "experiments.main", *FLAGS, f"--workdir={wd}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-2000:]
    assert "Traceback" not in text and "terminate called" not in text, text[-2000:]
    assert "in use by another run" in text and f"pid {os.getpid()}" in text, text[-2000:]
    assert socket.gethostname() in text and "the test's run" in text, text[-2000:]
    assert _files(wd) == before


def test_compare_in_a_locked_workdir_is_refused(tmp_path):
    from experiments import compare

    with workdir_lock.WorkdirLock(str(tmp_path), what="the test's run"):
        with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {os.getpid()}"):
            compare.compare(_config(), str(tmp_path), policies=["O0"], num_seeds=1, isolate="false", plots=False)
    assert not (tmp_path / "runs").exists()


def test_lock_of_a_killed_run_is_released_by_the_kernel(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from experiments import workdir_lock
        workdir_lock.WorkdirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {proc.pid} on host"):
            workdir_lock.WorkdirLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with workdir_lock.WorkdirLock(str(tmp_path)):  # no stale lock
        pass


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_run_that_dies_before_its_first_checkpoint_leaves_the_workdir_reusable(tmp_path, monkeypatch):
    from experiments import train

    wd = tmp_path / "run"

    def broken(*args, **kwargs):
        raise RuntimeError("died on its first batch")

    with monkeypatch.context() as m:
        m.setattr(train, "_compile", broken)
        with pytest.raises(RuntimeError, match="first batch"):
            _train(_config(num_train_steps=10), wd)
    assert not (wd / "history.jsonl").exists()
    r = _train(_config(num_train_steps=10), wd)  # the corrected rerun, in the same workdir
    assert r["steps"] == 10 and r["resumed_from"] == 0


# ---- item 11: a full disk ----


def _enospc_at(step):
    """orbax's CheckpointManager.save, failing with ENOSPC at ``step`` after writing part of it."""
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save

    def save(self, s, *args, **kwargs):
        if s == step:
            partial = os.path.join(str(self.directory), f"{s}.orbax-checkpoint-tmp-123")
            os.makedirs(partial, exist_ok=True)
            open(os.path.join(partial, "half_written"), "wb").write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, s, *args, **kwargs)

    return save


@pytest.mark.slow  # resumes and trains the `finished` run
@pytest.mark.standard_promotion(reason="the O0 resume traces optax.adam afresh (bias correction: Python float ** int32 count)")
def test_disk_full_is_a_clear_error_and_the_resume_is_bit_exact(finished, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    wd = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(ocp.CheckpointManager, "save", _enospc_at(STEPS))
        with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
            _train(_config(), wd)
    msg = str(e.value)
    assert str(wd) in msg and "No space left on device" in msg and "ENOSPC" in msg, msg
    assert "last checkpoint (step 10) takes" in msg and "MiB" in msg and "resumes from step 10" in msg, msg
    assert sorted(os.listdir(wd / "checkpoints")) == ["10"]  # the half-written step is gone, step 10 intact
    assert not (wd / "results.json").exists()
    r = _train(_config(), wd)  # space freed: resume
    assert r["resumed_from"] == 10 and r["steps"] == STEPS
    step, state = ckpt_lib.load_state(str(wd), STEPS)
    _, want = ckpt_lib.load_state(str(finished), STEPS)
    import jax

    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # ~11 s: a fresh process compiles the step
def test_disk_full_on_the_command_line_exits_1_with_one_clear_message(tmp_path):
    wd = tmp_path / "run"
    code = textwrap.dedent(f"""
        import errno, os, runpy, sys
        import orbax.checkpoint as ocp
        real = ocp.CheckpointManager.save
        def save(self, step, *a, **k):
            if step == {STEPS}:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, step, *a, **k)
        ocp.CheckpointManager.save = save
        sys.argv = ["main.py", *{FLAGS!r}, "--workdir={wd}"]
        runpy.run_module("experiments.main", run_name="__main__")
    """)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, (out.returncode, text[-2000:])
    assert "Traceback" not in text and "terminate called" not in text, text[-2000:]
    assert f"error: could not write checkpoint step {STEPS} in {wd}: No space left on device" in text, text[-2000:]
    assert time.perf_counter() - t0 < 120


# ---- issue 37, items 19 and 20: the errno's meaning first; one message, no writer-thread tracebacks ----


def test_a_tensorstore_write_error_is_named_by_its_errno_first_with_the_cause_kept():
    # TensorStore carries the OS error in its message, not as an OSError: it used to be cut off
    # after 200 characters, and "free space" was the advice for a file-size limit.
    path = "/w/checkpoints/10.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/d/6c8312ce0883915f"
    err = ValueError(f'OUT_OF_RANGE: Error writing "params.bias/0" in OCDBT database at local file "/w/": Failed '
                     f'writing: "{path}": Failed to write 17955 bytes to file 16: File too large [os_error_code=\'27\']')
    msg = str(ckpt_lib.write_failure("/tmp/jaxmp_no_such_workdir", "checkpoint step 10", err))
    assert msg.startswith("could not write checkpoint step 10 in /tmp/jaxmp_no_such_workdir: File too large (EFBIG); "
                          "ValueError: OUT_OF_RANGE"), msg
    assert path in msg and "[os_error_code='27']" in msg  # the cause, whole
    assert "ulimit -f" in msg and "Free space" not in msg and "free space and" not in msg, msg
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    msg = str(ckpt_lib.write_failure("/tmp/jaxmp_no_such_workdir", "results.json", full))
    assert ": No space left on device (ENOSPC). No checkpoint" in msg and "Free space and run" in msg, msg


_FILE_SIZE_LIMIT = 40 * 1024  # bytes: the first checkpoint's largest file is ~50 KB


@pytest.mark.slow  # ~30 s: a fresh process trains to its first checkpoint
def test_a_write_past_the_file_size_limit_exits_1_with_one_message_naming_efbig(tmp_path):
    # A real failing write inside orbax's writer threads (RLIMIT_FSIZE, as `ulimit -f`; Python
    # ignores SIGXFSZ, so the write fails with EFBIG): the threads' tracebacks used to come first.
    import resource

    wd = tmp_path / "run"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))

    out = subprocess.run([sys.executable, "-m", "experiments.main", *FLAGS, f"--workdir={wd}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr[-3000:]
    # The run's plan line (logged at start), then the one message; nothing else.
    errors = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("O0 (loss scale")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"error: could not write checkpoint step 10 in {wd}: File too large (EFBIG); "), errors
    assert "os_error_code='27'" in errors[0] and "ulimit -f" in errors[0], errors


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_a_run_stopped_for_skips_names_the_culprit_layer(tmp_path):
    r = _train(_diverging(), tmp_path / "run")
    culprits = [h["culprit"] for h in r["history"] if "culprit" in h]
    assert r["diverged"] and len(culprits) == 1, culprits
    # O2-fp16 from scale 2**24: a float16 gradient matmul overflows, named with its layer and the model's source
    assert "dot_general in CNN1D/" in culprits[0] and "backward" in culprits[0], culprits
    assert "experiments/models" in culprits[0], culprits
