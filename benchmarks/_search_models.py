"""The models of ``benchmarks/precision_search.py``: each as a float32 loss, its init, its data.

Every model is a plain Linen module applied by a float32 loss ``loss(params, *batch)``: under
``jaxmp.autocast`` Flax Linen names its scopes after the module paths, so the search
(``compare_to_float32(..., choose=True)``) sees one module per layer. Two are this repository's
(``benchmarks/_lm.py``'s character LM, the experiments' MNIST-1D CNN), three are google/flax's
examples, vendored verbatim (``benchmarks/_vendored/``, ``tests/_support/flax_imagenet_resnet.py``)
with their widths reduced through their own config objects and constructor arguments.

Batch norm (the CNN, the ResNet) runs on the batch's statistics (``train=True``) in training and
in evaluation; the running averages are not kept (every variant is evaluated alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

#: Sizes per model: the full table's, and ``--quick``'s (seconds, for the test).
SIZES: dict[str, tuple[dict, dict]] = {
    "lm": (dict(width=32, num_layers=1, num_heads=2, mlp_dim=64, context=32, batch=16, lr=3e-3),
           dict(width=16, num_layers=1, num_heads=2, mlp_dim=16, context=8, batch=4, lr=3e-3)),
    "cnn1d": (dict(features=(16, 16, 16), batch=64, lr=3e-3, samples=4000),
              dict(features=(8,), batch=16, lr=3e-3, samples=400)),
    "flax_lm1b": (dict(emb_dim=32, num_heads=2, num_layers=1, qkv_dim=32, mlp_dim=64, context=32, batch=16, lr=3e-3),
                  dict(emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=16, context=8, batch=4, lr=3e-3)),
    "flax_vae": (dict(latents=8, batch=32, lr=1e-3), dict(latents=4, batch=8, lr=1e-3)),
    "flax_resnet": (dict(stage_sizes=(1,), num_filters=8, batch=32, lr=3e-3),
                    dict(stage_sizes=(1,), num_filters=8, batch=8, lr=3e-3)),
}

#: Where each model comes from, in words (the table's "source" column).
SOURCES = {
    "lm": "jaxmp: benchmarks/_lm.py CausalLM (docs/fp8.md's small LM), stdlib docstrings",
    "cnn1d": "jaxmp: experiments/models/cnn.py CNN1D (batch norm), MNIST-1D",
    "flax_lm1b": "google/flax 0.12.8 examples/lm1b TransformerLM (benchmarks/_vendored), stdlib docstrings",
    "flax_vae": "google/flax 0.12.8 examples/vae VAE (benchmarks/_vendored), sklearn digits at 28x28",
    "flax_resnet": "google/flax 0.12.8 examples/imagenet ResNet (tests/_support), sklearn digits",
}


class Task(NamedTuple):
    """One model as the benchmark trains it.

    Attributes:
      init: ``seed -> params`` (float32).
      loss: ``loss(params, *batch) -> scalar`` in float32 (the function every variant wraps).
      batch: ``(seed, step) -> batch`` (a tuple of arrays): the seed's data order.
      eval_batch: the held-out batch (fixed).
      metric: what the final figure is (``"held-out loss"``; lower is better).
      lr: Adam's learning rate.
      config: the sizes, as recorded.
    """

    init: Callable[[int], Any]
    loss: Callable
    batch: Callable[[int, int], tuple]
    eval_batch: tuple
    metric: str
    lr: float
    config: dict


def _xent(logits, labels):
    import jax.numpy as jnp
    import optax

    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels))


def _with_state(module, sample, *extra, axis_name: str | None = None):
    """``(apply(params, x), init(seed))`` for a module whose other collections (batch stats) are
    recomputed every call: the loss differentiates the params only. ``axis_name``: the module's
    BatchNorm averages over that named axis (the ImageNet example's pmap); a vmap over one shard
    names it on one device."""
    import jax

    def init(seed: int):
        return module.init(jax.random.key(seed), sample, *extra)

    def apply(params, x):
        variables = init_vars["rest"]
        if not variables:
            return module.apply({"params": params}, x, *extra)

        def shard(xb):
            return module.apply({"params": params, **variables}, xb, *extra, mutable=list(variables))[0]

        return jax.vmap(shard, axis_name=axis_name)(x[None])[0] if axis_name else shard(x)

    first = init(0)
    init_vars = {"rest": {k: v for k, v in first.items() if k != "params"}}
    return apply, lambda seed: init(seed)["params"]


def _text_task(name: str, hp: dict, quick: bool) -> Task:
    """The character LMs (jaxmp's CausalLM, flax's lm1b TransformerLM) on the docstrings' text."""
    import jax.numpy as jnp

    from benchmarks import _lm

    text = _lm.load_text(max_chars=20000 if quick else 200000)
    ctx, bsz = hp["context"], hp["batch"]
    if name == "lm":
        module = _lm.CausalLM(context=ctx, width=hp["width"], num_layers=hp["num_layers"], num_heads=hp["num_heads"],
                              mlp_dim=hp["mlp_dim"])
        shift = 0
    else:
        from benchmarks._vendored import flax_lm1b_models as lm1b

        # lm1b's TransformerLM predicts its own inputs (it shifts them right inside) and masks id 0
        # as padding: the characters are ids 1..96 here.
        cfg = lm1b.TransformerConfig(vocab_size=len(_lm.VOCAB) + 1, output_vocab_size=len(_lm.VOCAB) + 1,
                                     emb_dim=hp["emb_dim"], num_heads=hp["num_heads"], num_layers=hp["num_layers"],
                                     qkv_dim=hp["qkv_dim"], mlp_dim=hp["mlp_dim"], max_len=ctx, dropout_rate=0.0,
                                     attention_dropout_rate=0.0, deterministic=True)
        module = lm1b.TransformerLM(cfg)
        shift = 1
    apply, init = _with_state(module, jnp.ones((1, ctx), jnp.int32))

    def loss(params, inputs, labels):
        return _xent(apply(params, inputs), labels)

    def batch(seed: int, step: int):
        b = _lm.train_batch(text.train, step, bsz, ctx, seed)
        if shift:
            return b["label"] + 1, b["label"] + 1
        return b["inputs"], b["label"]

    windows = next(_lm.eval_batches(text.eval, 64, ctx, max_windows=64))
    held = (windows["label"] + 1, windows["label"] + 1) if shift else (windows["inputs"], windows["label"])
    return Task(init, loss, batch, held, "held-out loss", hp["lr"], hp)


def _classifier_task(module, x, y, xt, yt, hp: dict, axis_name: str | None = None) -> Task:
    apply, init = _with_state(module, x[:1], axis_name=axis_name)

    def loss(params, inputs, labels):
        return _xent(apply(params, inputs), labels)

    def batch(seed: int, step: int):
        idx = np.random.default_rng([seed, step]).integers(0, len(x), hp["batch"])
        return x[idx], y[idx]

    return Task(init, loss, batch, (xt[:256], yt[:256]), "held-out loss", hp["lr"], hp)


def _digits(size: int | None = None):
    from experiments.data import embedded

    tr, te = embedded.digits("train"), embedded.digits("test")
    x, xt = tr.inputs.astype(np.float32) / 16.0, te.inputs.astype(np.float32) / 16.0
    if size:  # nearest-neighbour upsampling to size x size, flattened (the VAE's 784 inputs)
        idx = (np.arange(size) * 8) // size
        x, xt = (a[:, idx][:, :, idx].reshape(len(a), -1) for a in (x, xt))
    return x, tr.labels.astype(np.int32), xt, te.labels.astype(np.int32)


def _vae_task(hp: dict) -> Task:
    import jax
    import jax.numpy as jnp

    from benchmarks._vendored import flax_vae_models as vae

    x, _, xt, _ = _digits(28)
    module = vae.model(hp["latents"])

    def init(seed: int):
        return module.init(jax.random.key(seed), jnp.ones((1, 784)), jax.random.key(0))["params"]

    def loss(params, images, z_key):
        # examples/vae/train.py's loss: binary cross-entropy of the logits plus the KL term
        logits, mean, logvar = module.apply({"params": params}, images, z_key)
        bce = -jnp.sum(images * jax.nn.log_sigmoid(logits) + (1 - images) * jax.nn.log_sigmoid(-logits), -1)
        kld = -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), -1)
        return jnp.mean(bce + kld).astype(jnp.float32)

    def batch(seed: int, step: int):
        idx = np.random.default_rng([seed, step]).integers(0, len(x), hp["batch"])
        return x[idx], jax.random.key(1000 * seed + step)

    return Task(init, loss, batch, (xt[:256], jax.random.key(12345)), "held-out loss (ELBO)", hp["lr"], hp)


def task(name: str, quick: bool = False) -> Task:
    """The model ``name`` (a key of :data:`SIZES`) at the full table's sizes or ``--quick``'s."""
    hp = dict(SIZES[name][1 if quick else 0])
    if name in ("lm", "flax_lm1b"):
        return _text_task(name, hp, quick)
    if name == "cnn1d":
        from experiments.data import embedded
        from experiments.models.cnn import CNN1D

        tr, te = embedded.mnist1d("train", num_samples=hp["samples"]), embedded.mnist1d("test", num_samples=hp["samples"])
        module = CNN1D(features=hp["features"], kernel_sizes=(5, 3, 3)[:len(hp["features"])])
        return _classifier_task(module, tr.inputs.astype(np.float32), tr.labels.astype(np.int32),
                                te.inputs.astype(np.float32), te.labels.astype(np.int32), hp)
    if name == "flax_vae":
        return _vae_task(hp)
    if name == "flax_resnet":
        from tests._support import flax_imagenet_resnet as resnet

        module = resnet.ResNet(stage_sizes=list(hp["stage_sizes"]), block_cls=resnet.ResNetBlock, num_classes=10,
                               num_filters=hp["num_filters"])
        return _classifier_task(module, *_digits(), hp, axis_name="batch")
    raise ValueError(f"unknown model {name!r}: choose from {', '.join(SIZES)}")
