"""experiments.data: the uniform source interface, exact resumption, offline sets, TFDS through mock data."""

import sys

import numpy as np
import pytest

from experiments.data import DatasetUnavailableError, embedded, get_datasets
from experiments.data.base import ArraySource


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same_batches(a, b):
    return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_array_source_resumes_at_any_data_position():
    rng = np.random.default_rng(0)
    src = ArraySource("toy", rng.standard_normal((50, 3)).astype(np.float32), np.arange(50, dtype=np.int32) % 10, 10,
                      augment=lambda x, r: x + r.standard_normal(x.shape).astype(np.float32))
    full = _take(src.train_batches(8, seed=3), 20)  # 6 batches per epoch: crosses 3 epoch boundaries
    for start in (0, 5, 6, 13):
        assert _same_batches(full[start:], _take(src.train_batches(8, seed=3, start=start), 20 - start))
    # Another seed, another order; an epoch visits distinct examples.
    other = _take(src.train_batches(8, seed=4), 1)
    assert not np.array_equal(full[0]["label"], other[0]["label"])
    epoch = np.concatenate([b["label"] for b in full[:6]])
    assert len(epoch) == 48


def test_eval_batches_are_padded_and_masked():
    src = ArraySource("toy", np.ones((10, 2), np.float32), np.arange(10, dtype=np.int32), 10)
    batches = list(src.eval_batches(4))
    assert [b["x"].shape for b in batches] == [(4, 2)] * 3
    assert [float(b["mask"].sum()) for b in batches] == [4, 4, 2]
    assert batches[-1]["label"].tolist() == [8, 9, 0, 0]


def test_mnist1d_is_generated_offline_without_touching_global_rng(monkeypatch, tmp_path):
    import requests

    def no_network(*a, **k):
        raise AssertionError("MNIST-1D must not be downloaded")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setenv("JAXMP_DATA_CACHE", str(tmp_path))
    embedded._mnist1d_arrays.cache_clear()
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    train, test = embedded.mnist1d("train", num_samples=500), embedded.mnist1d("test", num_samples=500)
    assert np.array_equal(np.random.get_state()[1], before)
    assert (train.num_examples, test.num_examples) == (400, 100)
    assert train.input_shape == (40,) and train.input_key == "x" and train.num_classes == 10
    assert train.inputs.dtype == np.float32 and train.labels.dtype == np.int32
    assert set(np.unique(train.labels)) == set(range(10))
    assert list(tmp_path.glob("mnist1d_n500_seed42.npz"))  # cached for the next process
    embedded._mnist1d_arrays.cache_clear()
    again = embedded.mnist1d("train", num_samples=500)  # read back from the cache: same data
    assert np.array_equal(again.inputs, train.inputs)
    embedded._mnist1d_arrays.cache_clear()


def test_digits_and_fake_sources():
    d = embedded.digits("train")
    assert d.input_shape == (8, 8, 1) and d.num_examples + embedded.digits("test").num_examples == 1797
    assert 0.0 <= d.inputs.min() and d.inputs.max() <= 1.0
    f = embedded.fake("train", shape=(4, 4, 3), num_classes=7, num_examples=16)
    b = next(f.train_batches(8, seed=0))
    assert b["image"].shape == (8, 4, 4, 3) and b["label"].max() < 7


def test_get_datasets_rejects_unknown_names():
    import ml_collections

    with pytest.raises(ValueError, match="Unknown dataset 'nope'.*mnist1d"):
        get_datasets(ml_collections.ConfigDict({"dataset": "nope"}))


@pytest.mark.slow
def test_experiments_import_no_tensorflow():
    # The offline default never pays for TensorFlow; `import jaxmp` never does either.
    import subprocess

    code = ("import sys, jaxmp, experiments.train, experiments.data as d; import ml_collections as m; "
            "d.get_datasets(m.ConfigDict(dict(dataset='digits'))); "
            "print([k for k in ('tensorflow', 'tensorflow_datasets', 'matplotlib') if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- TFDS through tfds.testing.mock_data (nothing can be downloaded here) ----


@pytest.fixture(scope="module")
def tfds_mod():
    from experiments.data.tfds_source import import_tf

    tf, tfds = import_tf()
    assert not tf.config.get_visible_devices("GPU")  # TF stays on the CPU
    return tfds


def _tfds_config(name, **kw):
    import ml_collections

    return ml_collections.ConfigDict({"dataset": name, "data_dir": "", "image_size": 32, "cache_data": True, **kw})


@pytest.mark.parametrize("name,shape", [("cifar10", (32, 32, 3)), ("mnist", (28, 28, 1)),
                                        ("imagenet2012", (32, 32, 3))])
@pytest.mark.slow
def test_tfds_sources_with_mock_data(tfds_mod, name, shape):
    with tfds_mod.testing.mock_data(num_examples=20):
        train, test = get_datasets(_tfds_config(name))
        assert train.input_shape == shape and train.input_key == "image"
        assert train.num_examples == 20 and train.num_classes in (10, 1000)
        full = _take(train.train_batches(4, seed=1), 8)  # 5 batches per epoch: crosses an epoch
        assert full[0]["image"].shape == (4, *shape) and full[0]["image"].dtype == np.float32
        assert full[0]["label"].dtype == np.int32
        resumed = _take(train.train_batches(4, seed=1, start=6), 2)
        assert _same_batches(full[6:8], resumed)  # crops and flips included
        evals = list(test.eval_batches(8))
        assert sum(float(b["mask"].sum()) for b in evals) == test.num_examples
        assert all(b["image"].shape == (8, *shape) for b in evals)


@pytest.mark.slow  # imports TensorFlow (~4-6 s of CPU, the whole cost); the slow tier runs every TFDS test
def test_tfds_dataset_not_available_offline_says_what_to_do(tfds_mod, tmp_path):
    with pytest.raises(DatasetUnavailableError) as e:
        get_datasets(_tfds_config("cifar10", data_dir=str(tmp_path)))
    msg = str(e.value)
    assert "not prepared" in msg and "tfds build cifar10" in msg and "--config.data_dir" in msg
    assert "cpu.py" in msg  # points at the offline default
