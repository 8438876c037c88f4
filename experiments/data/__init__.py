"""Datasets behind one interface: ``get_datasets(config) -> (train, eval)`` sources.

Offline (no TensorFlow): ``mnist1d`` (the embedded default), ``digits``, ``fake``.
TFDS through tf.data: ``cifar10``, ``mnist``, ``imagenet2012``.
"""

from __future__ import annotations

from experiments.data.base import ArraySource, Batch, DatasetUnavailableError, Source, pad_batch, steps_per_epoch

OFFLINE = ("mnist1d", "digits", "fake")
TFDS = ("cifar10", "mnist", "imagenet2012")
DATASETS = OFFLINE + TFDS


def get_datasets(config) -> tuple[Source, Source]:
    """Returns the (train, eval) sources a config names.

    Args:
      config: the experiment config (reads ``dataset`` and its data fields).

    Raises:
      ValueError: the name is unknown (the message lists the choices).
      DatasetUnavailableError: a TFDS dataset is not prepared offline.
    """
    name = config.dataset
    if name == "mnist1d":
        from experiments.data import embedded

        n = config.get("mnist1d_num_samples", 5000)
        return embedded.mnist1d("train", num_samples=n), embedded.mnist1d("test", num_samples=n)
    if name == "digits":
        from experiments.data import embedded

        return embedded.digits("train"), embedded.digits("test")
    if name == "fake":
        from experiments.data import embedded

        shape = tuple(config.fake_input_shape)
        key = "x" if len(shape) == 1 else "image"
        kw = dict(shape=shape, num_classes=config.num_classes, input_key=key)
        return (embedded.fake("train", num_examples=config.fake_num_examples, **kw),
                embedded.fake("test", num_examples=config.fake_num_examples, **kw))
    if name in TFDS:
        from experiments.data import tfds_source

        kw = dict(data_dir=config.data_dir or None, image_size=config.image_size, cache=config.cache_data)
        return (tfds_source.TFDSSource(name, tfds_source.split_name(name, True), **kw),
                tfds_source.TFDSSource(name, tfds_source.split_name(name, False), **kw))
    raise ValueError(f"Unknown dataset {name!r}: choose one of {', '.join(DATASETS)} (--config.dataset=...).")


__all__ = ["ArraySource", "Batch", "DATASETS", "DatasetUnavailableError", "Source", "get_datasets",
           "pad_batch", "steps_per_epoch"]
