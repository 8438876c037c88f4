"""TFDS datasets (cifar10, mnist, imagenet2012) through tf.data, kept on the CPU.

TensorFlow is imported here only, and only when a config names a TFDS dataset:
``import jaxmp`` and the embedded default never pay its ~8 s import. Every
random choice (shuffle order, crop, flip) is a pure function of (seed, epoch,
example index) via TF's *stateless* random ops, so a run resumed at data
position ``p`` sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from experiments.data.base import Batch, DatasetUnavailableError, pad_batch, steps_per_epoch

# Per-channel statistics on the [0, 1] scale.
_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
_TRAIN_SPLIT = {"cifar10": "train", "mnist": "train", "imagenet2012": "train"}
_EVAL_SPLIT = {"cifar10": "test", "mnist": "test", "imagenet2012": "validation"}
SUPPORTED = tuple(_MEAN_STD)


def import_tf():
    """Imports TensorFlow and TFDS with TF kept off any GPU (JAX owns the accelerator)."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TF already initialised its devices; nothing more to do
        pass
    import tensorflow_datasets as tfds

    return tf, tfds


def split_name(dataset: str, train: bool) -> str:
    """The TFDS split used for training or evaluation of ``dataset``."""
    return (_TRAIN_SPLIT if train else _EVAL_SPLIT).get(dataset, "train" if train else "test")


class TFDSSource:
    """One split of a TFDS dataset as a `experiments.data.base.Source`.

    Args:
      name: the TFDS name (``cifar10``, ``mnist``, ``imagenet2012``).
      split: the TFDS split.
      data_dir: where prepared TFDS data lives (``None``: TFDS's default).
      image_size: output side for ImageNet crops; CIFAR and MNIST keep theirs.
      cache: cache decoded examples in memory (off for ImageNet-sized sets).
      shuffle_buffer: tf.data shuffle buffer (capped at the split size).
    """

    def __init__(self, name: str, split: str, *, data_dir: str | None = None, image_size: int = 224,
                 cache: bool = True, shuffle_buffer: int = 50_000):
        tf, tfds = import_tf()
        self._tf, self._tfds = tf, tfds
        self.name, self.split, self.image_size = name, split, image_size
        self.input_key = "image"
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except Exception as e:  # DatasetNotFoundError and friends: say it plainly
            raise DatasetUnavailableError(
                f"TFDS does not know a dataset called {name!r} ({type(e).__name__}). "
                f"Supported here: {', '.join(SUPPORTED)}, or the offline sets mnist1d, digits, fake."
            ) from None
        try:
            ds = builder.as_dataset(split=split, shuffle_files=False)
        except Exception as e:  # AssertionError "could not find data", missing split ...
            raise DatasetUnavailableError(
                f"Dataset {name!r} (split {split!r}) is not prepared in "
                f"{data_dir or builder.data_dir!r} and nothing can be downloaded here. "
                f"Prepare it on a machine with network access (`tfds build {name}`"
                f"{'; ImageNet needs its tar files placed in the manual dir first' if name == 'imagenet2012' else ''}) "
                f"and pass --config.data_dir=<that directory>, or use the offline default "
                f"--config=experiments/configs/cpu.py (MNIST-1D). [{type(e).__name__}: {str(e)[:200]}]"
            ) from None
        features = builder.info.features
        self.num_classes = int(features["label"].num_classes)
        try:
            self.num_examples = int(builder.info.splits[split].num_examples)
        except Exception:
            self.num_examples = 0
        # Keep only what the model needs; decode once and cache the uint8 images.
        ds = ds.map(lambda ex: {"image": ex["image"], "label": tf.cast(ex["label"], tf.int32)})
        if cache:
            ds = ds.cache()
        if not self.num_examples:  # tfds.testing.mock_data has no split metadata: count
            self.num_examples = int(ds.reduce(np.int64(0), lambda n, _: n + 1).numpy())
        self._base = ds
        self._eval_ds = None
        self._shuffle_buffer = max(1, min(shuffle_buffer, self.num_examples))
        shape = features["image"].shape
        self.input_shape = ((image_size, image_size, 3) if name == "imagenet2012"
                            else tuple(int(s) for s in shape))

    # ---- preprocessing (TF graph functions) ----

    def _normalize(self, image):
        tf = self._tf
        mean, std = _MEAN_STD.get(self.name, ((0.5,), (0.5,)))
        image = tf.cast(image, tf.float32) / 255.0
        return (image - tf.constant(mean)) / tf.constant(std)

    def _train_fn(self, ex, seed):
        tf = self._tf
        image = ex["image"]
        s1, s2 = seed, seed + tf.constant([0, 1], seed.dtype)
        if self.name == "cifar10":
            # The standard CIFAR recipe: 4-pixel reflect padding, random 32x32 crop, random flip.
            image = tf.pad(image, [[4, 4], [4, 4], [0, 0]], mode="REFLECT")
            image = tf.image.stateless_random_crop(image, (32, 32, 3), seed=s1)
            image = tf.image.stateless_random_flip_left_right(image, seed=s2)
        elif self.name == "imagenet2012":
            # Inception-style random-resized crop (8%-100% of the area), then flip.
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.shape(image), bounding_boxes=tf.zeros([1, 0, 4]), seed=s1,
                min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
                max_attempts=10, use_image_if_no_bounding_boxes=True)
            image = tf.slice(image, begin, size)
            image = tf.image.resize(image, (self.image_size, self.image_size))
            image = tf.image.stateless_random_flip_left_right(image, seed=s2)
        return {"image": self._normalize(image), "label": ex["label"]}

    def _eval_fn(self, ex):
        tf = self._tf
        image = ex["image"]
        if self.name == "imagenet2012":
            # Resize the short side to size/0.875 and take the central crop.
            side = int(round(self.image_size / 0.875))
            shape = tf.cast(tf.shape(image)[:2], tf.float32)
            scale = side / tf.reduce_min(shape)
            image = tf.image.resize(image, tf.cast(tf.round(shape * scale), tf.int32))
            image = tf.image.resize_with_crop_or_pad(image, self.image_size, self.image_size)
        return {"image": self._normalize(image), "label": ex["label"]}

    def _options(self):
        options = self._tf.data.Options()
        options.deterministic = True  # same order on every run: needed for exact resumption
        return options

    # ---- the Source interface ----

    def train_batches(self, batch_size: int, *, seed: int, start: int = 0) -> Iterator[Batch]:
        tf, tfds = self._tf, self._tfds
        if batch_size > self.num_examples:
            raise ValueError(f"batch size {batch_size} is larger than the {self.num_examples} examples of "
                             f"{self.name}/{self.split}; lower --config.per_device_batch_size.")
        spe = steps_per_epoch(self.num_examples, batch_size)
        first_epoch, skip = divmod(start, spe)
        n = self.num_examples

        def epoch_dataset(epoch):
            # Each epoch is its own shuffle of the cached base, keyed on (seed, epoch), and is
            # batched on its own (the last partial batch dropped), so an epoch always has
            # exactly `spe` batches and data position p is (p // spe, p % spe).
            ds = self._base.shuffle(self._shuffle_buffer, seed=seed * 1_000_003 + epoch,
                                    reshuffle_each_iteration=False)
            ds = ds.enumerate()
            key = tf.stack([tf.constant(seed, tf.int64), 2 * epoch * n])
            ds = ds.map(lambda i, ex: self._train_fn(ex, key + tf.stack([tf.constant(0, tf.int64), 2 * i])),
                        num_parallel_calls=tf.data.AUTOTUNE)
            return ds.batch(batch_size, drop_remainder=True)

        # One pipeline for the whole run (traced once); only the first epoch is partly skipped.
        ds = tf.data.Dataset.range(first_epoch, 2**62).flat_map(epoch_dataset)
        ds = ds.skip(skip).prefetch(tf.data.AUTOTUNE).with_options(self._options())
        yield from tfds.as_numpy(ds)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        tf, tfds = self._tf, self._tfds
        if self._eval_ds is None or self._eval_ds[0] != batch_size:
            ds = self._base.map(self._eval_fn, num_parallel_calls=tf.data.AUTOTUNE)
            ds = ds.batch(batch_size).prefetch(tf.data.AUTOTUNE).with_options(self._options())
            self._eval_ds = (batch_size, ds)  # built once: re-iterating does not re-trace _eval_fn
        for batch in tfds.as_numpy(self._eval_ds[1]):
            yield pad_batch(batch, batch_size)
