"""Two processes x 2 CPU devices over loopback (jax.distributed + gloo) train like one process x 4 devices,
and save and restore a verified checkpoint of a sharded state, each process checksumming its own shards."""

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest


from tests._support import _multiprocess_checkpoint as ckpt_demo
from tests._support import _multiprocess_demo as demo
from tests._support import _multiprocess_zero as zero_demo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 120
# JAX's recommended multi-host path. The pmap path runs across processes too
# (`--paths sharded,pmap`, the demo's default); it is left out here to keep the test short,
# as each path costs a compile in every process on the shared CPU cores.
PATHS = ("sharded",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "<no log>"


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)


@contextlib.contextmanager
def _two_workers(tmp_path, argv, killed=False):
    """Runs ``python <argv>`` as processes 0 and 1 of 2, with 2 CPU devices each, over loopback.

    The body of the ``with`` runs meanwhile; on leaving it, both workers must exit 0 within
    ``TIMEOUT_S`` (the failure shows the worker's log), and none is ever left behind. With
    ``killed``, each must instead have died (SIGKILL, or an error once the other one died).
    """
    port = _free_port()
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        # Replaces the 8 devices conftest gives this process: each worker drives 2.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAXMP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAXMP_NUM_PROCESSES": "2",
        "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
    })
    procs, logs = [], []
    try:
        for i in range(2):
            log = open(tmp_path / f"process_{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, *argv], env={**env, "JAXMP_PROCESS_ID": str(i)}, cwd=REPO,
                                          stdout=log, stderr=subprocess.STDOUT))
        yield
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} did not finish in {TIMEOUT_S}s:\n{_tail(tmp_path / f'process_{i}.log')}")
            if killed:
                assert rc != 0, f"process {i} was to be killed but exited 0:\n{_tail(tmp_path / f'process_{i}.log')}"
            else:
                assert rc == 0, f"process {i} exited with {rc}:\n{_tail(tmp_path / f'process_{i}.log')}"
    finally:
        # Never leave a worker behind, whatever failed above (it would hold the port and a core).
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()


@pytest.mark.slow
@pytest.mark.standard_promotion(reason='the in-process reference steps optax.adam (bias correction: Python float ** int32 count)')
def test_two_processes_with_two_devices_each_match_one_process_with_four(tmp_path):
    out = tmp_path / "out"
    with _two_workers(tmp_path, [os.path.join(REPO, "tests", "_support", "_multiprocess_demo.py"), "--out", str(out),
                                 "--paths", ",".join(PATHS)]):
        # The single-process reference on 4 of this process's 8 devices, computed meanwhile.
        reference = {path: demo.train(path, jax.devices()[:4]) for path in PATHS}

    results = [dict(np.load(out / f"process_{i}.npz")) for i in range(2)]
    for r in results:
        assert int(r["process_count"]) == 2 and int(r["device_count"]) == 4
    # Both processes hold bitwise the same params and counters (replicated across hosts).
    for k in results[0]:
        np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)
    got = results[0]
    for path in PATHS:
        ref = reference[path]
        # The NaN planted in process 1's rows made *both* processes skip that step.
        assert int(got[f"{path}/total_skips"]) == ref["total_skips"] == 1
        assert float(got[f"{path}/loss_scale"]) == ref["loss_scale"]
        assert np.isnan(got[f"{path}/loss"][demo.NAN_STEP])
        for k in ("w1", "b1", "w2", "b2"):
            # Cross-process (gloo) and in-process all-reduces may sum in another order.
            assert _rel(ref[k], got[f"{path}/{k}"]) <= 1e-6, (path, k, _rel(ref[k], got[f"{path}/{k}"]))
        assert np.linalg.norm(ref["w1"] - demo.init_params()["w1"]) > 1e-3  # training did move them


@pytest.mark.slow
def test_each_process_checksums_its_shards_and_all_reject_a_step_damaged_on_one(tmp_path):
    workdir = tmp_path / "run"
    script = os.path.join(REPO, "tests", "_support", "_multiprocess_checkpoint.py")
    with _two_workers(tmp_path, [script, "--workdir", str(workdir)]):
        pass
    reports = [json.loads((workdir / f"report_{i}.json").read_text()) for i in range(2)]

    # Each process recorded exactly the pieces it wrote -- its mesh row's replica-0 shards, and
    # process 0 the replicated leaves it saves as host copies -- hashed from its own data.
    step1 = workdir / "checkpoints" / "1"
    values = ckpt_demo.values(1)
    owned = {0: {("b", "[[0, 5]]"), ("step", "[]"), ("u", "[[0, 4], [0, 3]]"), ("w", "[[0, 4], [0, 3]]"),
                 ("w", "[[0, 4], [3, 6]]")},
             1: {("u", "[[4, 8], [0, 3]]"), ("w", "[[4, 8], [0, 3]]"), ("w", "[[4, 8], [3, 6]]")}}
    for i in range(2):
        records = json.loads((step1 / "shards" / f"process_{i}.json").read_text())["shards"]
        assert {(r["key"], str(r["index"])) for r in records} == owned[i]
        for r in records:
            piece = values[r["key"]][tuple(slice(a, b) for a, b in r["index"])]
            assert r["sha256"] == hashlib.sha256(piece.tobytes()).hexdigest(), (i, r["key"], r["index"])
        # ... and listed the checksums of the files it wrote itself.
        files = json.loads((step1 / f"state_files_process_{i}.json").read_text())["files"]
        assert files and all(("process_1" in rel) == (i == 1) for rel in files), (i, sorted(files))

    # Both processes restored the same steps, intact: step 2, then twice step 1 after a step
    # damaged on process 1 only -- and both named what process 1 found.
    for r in reports:
        assert [(step, ok) for step, ok, _ in r["restores"]] == [(2, True), (1, True), (1, True)], r
        first, at_rest, write_path = (msgs for _, _, msgs in r["restores"])
        assert first == [] and len(at_rest) == 1 and len(write_path) == 1, r
        assert (f"step 2 in {workdir}/checkpoints is DAMAGED (process 1: file state/{reports[1]['flipped_file']}: "
                "content checksum mismatch)") in at_rest[0]
        assert ("step 3 in " in write_path[0] and "DAMAGED (process 1: array ['w']: shard [[4, 8], [3, 6]] "
                "(written by process 1): content checksum mismatch)" in write_path[0])
    # Moved aside once each, by process 0.
    assert sorted(e.split(".")[0] for e in os.listdir(workdir / "damaged_checkpoints")) == ["2", "3"]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]


@pytest.mark.slow
@pytest.mark.standard_promotion(reason='the in-process reference steps optax.adam (bias correction: Python float ** int32 count)')
def test_zero_sharded_state_checkpointed_killed_resumed_and_resumed_on_another_device_count(tmp_path):
    script = os.path.join(REPO, "tests", "_support", "_multiprocess_zero.py")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    # 1. Uninterrupted: 2 processes x 2 devices, masters and moments sharded 4 ways.
    with _two_workers(tmp_path, [script, "--workdir", str(ref_dir), "--out", str(ref_dir / "final.npz")]):
        pass
    # 2. The same run, killed (SIGKILL, both processes) one step after the checkpoint at step 3.
    with _two_workers(tmp_path, [script, "--workdir", str(run_dir), "--kill-after", "4"], killed=True):
        pass
    assert sorted(os.listdir(run_dir / "checkpoints")) == [str(zero_demo.SAVE_AT)]
    # 3. Resumed by two new processes, restored straight into the ZeRO layout (each process
    #    verifies the shards it holds): bitwise the uninterrupted run.
    with _two_workers(tmp_path, [script, "--workdir", str(run_dir), "--resume", "--out", str(run_dir / "final.npz")]):
        pass
    ref, got = dict(np.load(ref_dir / "final.npz")), dict(np.load(run_dir / "final.npz"))
    assert int(got["start"]) == zero_demo.SAVE_AT and int(ref["start"]) == 0
    assert ref["finite"].tolist() == [t != zero_demo.NAN_STEP for t in range(zero_demo.STEPS)]  # both skipped it
    leaves = sorted(k for k in ref if k.startswith("l"))
    for k in leaves:
        assert got[k].dtype == ref[k].dtype and got[k].tobytes() == ref[k].tobytes(), k

    # 4. Onto another device count (8 devices of this one process), restored straight into the
    #    8-device ZeRO layout: each saved quarter lies across two devices' blocks, which the
    #    checkpointer joins to verify it. The run goes on over 8 devices, to the uninterrupted
    #    run's values up to the reduction order.
    final8, step = zero_demo.resume_here(str(run_dir), jax.devices()[:8])
    assert step == zero_demo.SAVE_AT
    for k in leaves:
        a, b = ref[k], final8[k]
        if a.dtype.kind == "f":
            # A sum over 8 devices instead of 4: a bf16 ulp here and there (norm-wise, well under 1%).
            assert _rel(a, b.astype(np.float32)) <= 1e-2, (k, _rel(a, b.astype(np.float32)))
        else:
            np.testing.assert_array_equal(b, a, err_msg=k)
