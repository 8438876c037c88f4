"""experiments.configs: one file per hardware, explicit batch/LR arithmetic, a tiny smoke run of each,
and clear messages for bad input."""

import os
import subprocess
import sys

import jax
import pytest

from experiments import configs as configs_lib
from experiments import train
from experiments.validation import validate_config
from experiments.cli import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tiny versions of each config's model (same architecture family, a fraction of the compile).
TINY_MODEL = {
    "wrn28_10": dict(depth=10, widen_factor=1),
    "resnet50": dict(stage_sizes=(1,), width=8),
    "resnet9": dict(width=8),
}


def test_every_hardware_config_exists_and_is_explicit():
    assert set(configs_lib.HARDWARE) <= set(configs_lib.available())
    for name in configs_lib.HARDWARE:
        c = configs_lib.get_config(name)
        # Per-device batch and device count explicit, global batch their product,
        # learning rate linear in the global batch, warm-up given.
        assert c.global_batch_size == c.per_device_batch_size * c.num_devices, name
        assert c.learning_rate == pytest.approx(c.base_learning_rate * c.global_batch_size / c.base_batch_size)
        assert c.warmup_epochs > 0 and c.policy in c.compare_policies
        # The hardware files override only what differs: they import default (or a sibling).
        text = open(os.path.join(configs_lib.CONFIG_DIR, name + ".py")).read()
        assert "get_config()" in text and "ml_collections.ConfigDict()" not in text
    # Derived fields follow an override of the per-device batch.
    c = configs_lib.get_config("tpu_v3_8")
    assert (c.num_devices, c.per_device_batch_size, c.global_batch_size, c.learning_rate) == (8, 64, 512, 0.4)
    c.per_device_batch_size = 32
    assert (c.global_batch_size, c.learning_rate) == (256, 0.2)
    v = configs_lib.get_config("gpu_v100_x8")
    assert (v.per_device_batch_size, v.global_batch_size, v.learning_rate, v.warmup_epochs) == (208, 1664, 0.65, 5.0)


def _tiny(name):
    c = configs_lib.get_config(name)
    with c.unlocked():
        c.model_kwargs.update(TINY_MODEL.get(c.model, {}))
        c.per_device_batch_size = 2
        c.num_train_steps = 3
        c.checkpoint_every_steps = 2
        c.eval_batch_size = 4 * c.num_devices
        c.image_size = 32
        c.progress_bar = False
        c.mnist1d_num_samples = 200
    return c


@pytest.fixture(scope="module")
def tfds_mock():
    from experiments.data.tfds_source import import_tf

    _, tfds = import_tf()
    return tfds.testing.mock_data


@pytest.mark.slow
@pytest.mark.parametrize("name", configs_lib.HARDWARE)
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_smoke_every_config_at_tiny_size(name, tmp_path, tfds_mock):
    c = _tiny(name)
    assert jax.device_count() >= c.num_devices  # conftest simulates 8 CPU devices
    with tfds_mock(num_examples=4 * c.num_devices + 4):
        r = train.train_and_evaluate(c, str(tmp_path))
    assert r["steps"] == 3 and r["policy"] == c.policy
    assert 0.0 <= r["val_accuracy"] <= 1.0 and r["skipped_steps"] >= 0
    assert r["device"].startswith(f"{c.num_devices} x")
    assert r["peak_memory_bytes"] > 0 and r["memory_source"]
    assert os.path.isdir(tmp_path / "checkpoints" / "3")


# ---- bad input: one clear message, no traceback ----


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "experiments.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_cli_unknown_config_name_and_field(tmp_path):
    out = _cli("--config=experiments/configs/gpu_k80.py", f"--workdir={tmp_path}")
    assert out.returncode == 2 and "unknown config" in out.stderr and "gpu_t4" in out.stderr
    assert "Traceback" not in out.stderr
    out = _cli("--config=cpu", "--config.learning_rat=0.1", f"--workdir={tmp_path}")
    assert out.returncode == 2 and "unknown config field 'learning_rat'" in out.stderr
    assert "base_learning_rate" in out.stderr and "Traceback" not in out.stderr
    out = _cli("--config=cpu", "--config.model=vgg", f"--workdir={tmp_path}")
    assert out.returncode == 2 and "unknown model 'vgg'" in out.stderr and "Traceback" not in out.stderr


def test_batch_that_does_not_divide_the_devices():
    c = configs_lib.get_config("tpu_v3_8")
    c.global_batch_size = 100  # set directly, breaking per-device x devices
    with pytest.raises(UserError, match="global batch 100 does not divide over 8 devices"):
        validate_config(c)
    c = configs_lib.get_config("cpu")
    c.num_devices = jax.device_count() + 1
    with pytest.raises(UserError, match="wants .* devices but only"):
        validate_config(c)
    c = configs_lib.get_config("cpu")
    c.policy = "O4"
    with pytest.raises(UserError, match="O4"):
        validate_config(c)


@pytest.mark.slow
def test_unavailable_tfds_dataset_is_a_user_error(tmp_path):
    c = configs_lib.get_config("gpu_t4")
    c.data_dir = str(tmp_path)  # nothing prepared there, and nothing can be downloaded
    from experiments.data import DatasetUnavailableError

    with pytest.raises(DatasetUnavailableError, match="tfds build cifar10"):
        train.train_and_evaluate(c, str(tmp_path / "run"))
