"""Datasets that need no network: MNIST-1D (generated) and scikit-learn's digits (bundled).

MNIST-1D (Greydanus 2020) is generated offline by the ``mnist1d`` package from
ten 1-D templates with random padding, translation, shear and noise; its default
arguments give 4000 training and 1000 test sequences of length 40, on which a
small 1-D CNN reaches ~94% test accuracy while an MLP stays far below, so it
separates models (and precisions) that a toy set would not. We call
``make_dataset`` directly -- never ``get_dataset``, which first tries to
download a pickle.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from experiments.data.base import ArraySource


def cache_dir() -> str:
    """Where generated datasets are cached: ``$JAXMP_DATA_CACHE`` or ``~/.cache/jaxmp``."""
    return os.environ.get("JAXMP_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxmp")


def _generate_mnist1d(num_samples: int, data_seed: int):
    import mnist1d.data as mnist1d_data  # lazy: imports matplotlib

    from experiments.progress import Progress

    args = mnist1d_data.get_dataset_args()
    args.num_samples = num_samples
    args.seed = data_seed
    # make_dataset draws one example per call of its module-level ``transform``: counting those
    # calls is the only progress it exposes. It also reseeds numpy's *global* RNG; both are put
    # back afterwards so we leave no trace.
    state, transform = np.random.get_state(), mnist1d_data.transform
    with Progress(num_samples, f"generating MNIST-1D ({num_samples} examples, cached afterwards)",
                  interval_s=3.0) as bar:
        def counted(*a, **k):
            bar.update(1)
            return transform(*a, **k)

        mnist1d_data.transform = counted
        try:
            d = mnist1d_data.make_dataset(args)
        finally:
            mnist1d_data.transform = transform
            np.random.set_state(state)
    return (d["x"].astype(np.float32), d["y"].astype(np.int32),
            d["x_test"].astype(np.float32), d["y_test"].astype(np.int32))


@functools.lru_cache(maxsize=4)
def _mnist1d_arrays(num_samples: int, data_seed: int):
    """MNIST-1D arrays, generated once and cached on disk (generation takes seconds)."""
    path = os.path.join(cache_dir(), f"mnist1d_n{num_samples}_seed{data_seed}.npz")
    try:
        with np.load(path) as f:
            return f["x"], f["y"], f["x_test"], f["y_test"]
    except (OSError, KeyError, ValueError):
        pass
    x, y, xt, yt = _generate_mnist1d(num_samples, data_seed)
    try:  # a cache is a convenience: a read-only home must not stop the run
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, x=x, y=y, x_test=xt, y_test=yt)
        os.replace(tmp, path)
    except OSError:
        pass
    return x, y, xt, yt


def mnist1d(split: str, *, num_samples: int = 5000, data_seed: int = 42) -> ArraySource:
    """MNIST-1D: inputs ``"x"`` of shape ``[40]``, 10 classes.

    Args:
      split: ``"train"`` (80%) or ``"test"`` (20%).
      num_samples: total examples generated (the paper's default is 5000).
      data_seed: the generator's seed (42 reproduces the published set's recipe).
    """
    x, y, xt, yt = _mnist1d_arrays(num_samples, data_seed)
    if split == "train":
        return ArraySource("mnist1d", x, y, 10, input_key="x")
    if split in ("test", "validation"):
        return ArraySource("mnist1d", xt, yt, 10, input_key="x")
    raise ValueError(f"mnist1d has splits 'train' and 'test', not {split!r}")


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    from sklearn.datasets import load_digits  # lazy: bundled with scikit-learn, no download

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[..., None]  # [1797, 8, 8, 1] in [0, 1]
    y = d.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))  # fixed split, independent of run seed
    n_train = int(0.8 * len(y))
    return x[order[:n_train]], y[order[:n_train]], x[order[n_train:]], y[order[n_train:]]


def digits(split: str) -> ArraySource:
    """scikit-learn's 8x8 digits: ``"image"`` of shape ``[8, 8, 1]``, 10 classes, 1437/360 split."""
    x, y, xt, yt = _digits_arrays()
    if split == "train":
        return ArraySource("digits", x, y, 10, input_key="image")
    if split in ("test", "validation"):
        return ArraySource("digits", xt, yt, 10, input_key="image")
    raise ValueError(f"digits has splits 'train' and 'test', not {split!r}")


def fake(split: str, *, shape: tuple, num_classes: int, num_examples: int = 1024,
         input_key: str = "image", seed: int = 0) -> ArraySource:
    """Synthetic data of any shape for throughput runs (no input pipeline cost).

    The arrays are generated once and replayed unshuffled, so the measured speed is
    the device's, not the host's -- the point that a 2-vCPU host can starve
    a GPU is measured by comparing against the real pipeline.
    """
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    x = rng.standard_normal((num_examples, *shape), dtype=np.float32)
    y = rng.integers(0, num_classes, num_examples).astype(np.int32)
    return ArraySource("fake", x, y, num_classes, input_key=input_key, shuffle=False)
