"""jaxmp.parallel.Checkpointer (jaxmp/parallel/_checkpoint.py): orbax plus a SHA-256 of every saved
piece, checked on restore. The drill flips one bit in each file a checkpoint writes and holds every
flip to one of two outcomes: the restored state is bitwise the saved one, or the restore is refused
with a ValueError that names the leaf whose value the flip changed (plain orbax restores some of
these flips as different values without an error)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import lean
from jaxmp.parallel._checksums import _key

ocp = pytest.importorskip("orbax.checkpoint")


@pytest.fixture(scope="module")
def quantized_zero():
    """A `remainders-8bit` state after two updates (codes, block scales and remainders all vary),
    ZeRO-sharded over 8 devices: ``(state, restore target, the mesh)``."""
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 1024)) / 4, jnp.bfloat16),
              "w2": jnp.asarray(rng.normal(size=(1024, 8)) / 16, jnp.bfloat16)}
    tx = jaxmp.loss_scaling(lean.preset("remainders-8bit", optax.adamw(1e-2)), "none")
    update = jax.jit(tx.update)
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam: a Python float ** int32 count
        for _ in range(2):
            grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
            updates, state = update(grads, state, params)
            params = jaxmp.apply_updates(params, updates, state)
    mesh = jaxmp.parallel.make_data_mesh()
    p, s = jaxmp.parallel.shard_state((params, state), mesh, "zero")
    target_p, target_s = jaxmp.parallel.abstract_state((params, state), mesh, "zero")
    return {"params": p, "opt_state": s}, {"params": target_p, "opt_state": target_s}, mesh


def _paths_and_bytes(tree):
    return [(jax.tree_util.keystr(k), np.asarray(x).tobytes()) for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def _changed(tree, saved):
    return [p for (p, b), (_, want) in zip(_paths_and_bytes(tree), saved) if b != want]


def _drill(path, target, saved, fractions):
    """Flips one bit at each ``fraction`` of every file under ``path``; returns the leaves whose
    value a flip changed under plain orbax, each of which `Checkpointer.restore` refused naming it."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    assert any("ocdbt" in str(f) for f in files) and any("checksums" in str(f) for f in files)
    caught = []
    with jaxmp.parallel.Checkpointer() as ckptr, ocp.StandardCheckpointer() as plain:
        for f in files:
            data = f.read_bytes()
            for at in sorted({min(int(len(data) * q), len(data) - 1) for q in fractions}):
                flipped = bytearray(data)
                flipped[at] ^= 1 << (at % 8)
                f.write_bytes(bytes(flipped))
                where = f"{f.relative_to(path)} byte {at}"
                try:
                    restored = ckptr.restore(path, target)
                except ValueError as e:
                    message = str(e)
                    assert message.startswith(f"checkpoint {path} is damaged: "), (where, message)
                    try:  # what the orbax code of the guide before this checkpointer restored
                        changed = _changed(plain.restore(path / "state", target), saved)
                    except Exception:  # noqa: BLE001 - orbax refuses this flip itself
                        changed = []
                    if changed:
                        assert changed[0] in message, (where, changed, message)
                        caught.append(changed[0])
                else:
                    assert _changed(restored, saved) == [], (where, "restored a different value without an error")
                finally:
                    f.write_bytes(data)
    return caught


def test_a_bit_flipped_in_each_file_a_checkpoint_writes_is_refused_naming_the_leaf_or_changes_nothing(
        quantized_zero, tmp_path):
    state, target, _ = quantized_zero
    saved = _paths_and_bytes(state)
    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        assert _changed(ckptr.restore(tmp_path / "ckpt", target), saved) == []
    caught = _drill(tmp_path / "ckpt", target, saved, fractions=(0.0, 0.5, 1.0))
    assert caught  # some flips changed a value that plain orbax restored without a word


@pytest.mark.slow  # 16 flips in each file: ~300 restores
def test_the_drill_at_16_places_a_file_catches_params_and_8bit_mu_and_nu_codes(quantized_zero, tmp_path):
    state, target, _ = quantized_zero
    saved = _paths_and_bytes(state)
    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
    caught = set(_drill(tmp_path / "ckpt", target, saved, fractions=[k / 16 for k in range(17)]))
    assert any(c.startswith("['params']") for c in caught), caught
    assert any(".mu[" in c for c in caught) and any(".nu[" in c for c in caught), caught


def test_a_state_saved_on_8_devices_restores_onto_4_verified_and_a_flip_is_found_there(quantized_zero, tmp_path):
    # Resharding: the target's shardings decide the layout; the pieces saved on 8 devices are
    # checked inside the 4-device blocks that hold them.
    state, _, _ = quantized_zero
    mesh4 = jaxmp.parallel.make_data_mesh(jax.devices()[:4])
    host = jax.device_get(state)
    target4 = dict(zip(("params", "opt_state"),
                       jaxmp.parallel.abstract_state((host["params"], host["opt_state"]), mesh4, "zero")))
    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        restored = ckptr.restore(tmp_path / "ckpt", target4)
    assert _paths_and_bytes(restored) == _paths_and_bytes(state)
    codes = [x for x in jax.tree.leaves(restored["opt_state"]) if x.dtype == jnp.uint8]
    assert codes and all(len(x.sharding.device_set) == 4 for x in codes)
    assert any(not x.sharding.is_fully_replicated for x in codes)
    # a flipped bit in the largest data file, found through the 4-device blocks
    data = max((p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 4
    data.write_bytes(bytes(flipped))
    with jaxmp.parallel.Checkpointer() as ckptr, pytest.raises(ValueError, match=r"is damaged: .*\['"):
        ckptr.restore(tmp_path / "ckpt", target4)


def test_a_one_device_state_round_trips_with_a_concrete_target_and_without_one(tmp_path):
    params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)}
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    state = {"params": params, "opt_state": tx.init(params)}

    def by_key(tree):  # `_key` spells a leaf alike in the state and in orbax's target-free dicts
        return {_key(k): (str(np.asarray(x).dtype), np.asarray(x).tobytes())
                for k, x in jax.tree_util.tree_leaves_with_path(tree)}

    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        restored = ckptr.restore(tmp_path / "ckpt", state)
        assert jax.tree.structure(restored) == jax.tree.structure(state) and by_key(restored) == by_key(state)
        assert by_key(ckptr.restore(tmp_path / "ckpt")) == by_key(state)


def test_a_restore_into_the_target_of_another_state_names_the_arrays_that_differ(tmp_path):
    # Issue 60 item 8: orbax's own tree-mismatch message listed tree diffs; the Checkpointer names
    # the arrays and the target to build instead.
    params = {"w": jnp.ones((3, 4), jnp.float32)}
    state = {"params": params, "opt_state": optax.adam(0.1).init(params)}
    wrong = {"params": {"w": jnp.ones((4, 4), jnp.float32)}, "opt_state": optax.sgd(0.1).init(params)}
    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        with pytest.raises(ValueError, match=r"restore target does not match checkpoint .*\['w'\].*saved"):
            ckptr.restore(tmp_path / "ckpt", wrong)


def test_what_is_not_a_checkpointer_checkpoint_is_a_clear_error(tmp_path):
    with jaxmp.parallel.Checkpointer() as ckptr:
        with pytest.raises(ValueError, match="no checkpoint at .*missing: pass the directory given to"):
            ckptr.restore(tmp_path / "missing")
    with ocp.StandardCheckpointer() as plain:
        plain.save(tmp_path / "plain", {"w": np.ones(3, np.float32)})
    with jaxmp.parallel.Checkpointer() as ckptr:
        with pytest.raises(ValueError, match=r"not written by jaxmp.parallel.Checkpointer .*StandardCheckpointer\(\)"):
            ckptr.restore(tmp_path / "plain")


def test_a_missing_or_edited_checksum_file_is_damage(tmp_path):
    state = {"w": np.arange(6, dtype=np.float32)}
    with jaxmp.parallel.Checkpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        checksums = tmp_path / "ckpt" / "checksums" / "process_0.json"
        checksums.write_text(checksums.read_text().replace('"process_count":1', '"process_count":2')
                             .replace('"process_count": 1', '"process_count": 2'))
        with pytest.raises(ValueError, match="is damaged: checksums/process_0.json: its own checksum does not match"):
            ckptr.restore(tmp_path / "ckpt", state)
        os.remove(checksums)
        with pytest.raises(ValueError, match="is damaged: checksums/process_0.json: missing"):
            ckptr.restore(tmp_path / "ckpt", state)


_SAVE_SLOWLY = """
import sys, numpy as np, jaxmp
state = {f"w{i}": np.full((1 << 22,), i, np.float32) for i in range(24)}  # 384 MiB: a save that takes a while
print("saving", flush=True)
with jaxmp.parallel.Checkpointer() as ckptr:
    ckptr.save(sys.argv[1], state)
print("saved", flush=True)
"""


@pytest.mark.slow  # a child process writes 384 MiB and is killed while it does (~10-30 s)
def test_a_save_killed_midway_leaves_no_checkpoint_at_its_path(tmp_path):
    """docs/guides/checkpointing.md: a save killed midway leaves no checkpoint at ``path`` (orbax
    writes a temporary directory and renames it once complete), so a restore says so."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", _SAVE_SLOWLY, str(path)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 120
        while not any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir()):
            assert child.poll() is None and time.monotonic() < deadline, "the save ended before it was seen midway"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert not path.exists(), sorted(p.name for p in tmp_path.iterdir())
    with jaxmp.parallel.Checkpointer() as ckptr, pytest.raises(ValueError, match="no checkpoint at"):
        ckptr.restore(path)
