"""experiments.models: the seeds' architectures as plain Linen modules, run under jaxmp policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests._support._numpy_init import numpy_variables

import jaxmp
import jaxmp.flax
from experiments.models import MODELS, get_model

# (name, input shape, num_classes, expected parameter count or None)
FULL_SIZE = [
    ("wrn28_10", (32, 32, 3), 10, 36_479_194),     # the paper's 36.5M
    ("wrn16_4", (32, 32, 3), 10, 2_748_890),       # 2.7M
    ("resnet50", (224, 224, 3), 1000, 25_557_032),  # torchvision's 25.6M
    ("resnet9", (32, 32, 3), 10, 6_573_120),       # DavidNet's 6.5M
    ("cnn", (28, 28, 1), 10, None),
    ("cnn1d", (40,), 10, None),
    ("transformer", (40,), 10, None),
]


def _abstract_params(name, shape, num_classes, policy="O0"):
    model = jaxmp.flax.mixed_precision(get_model(name, num_classes), policy)
    x = jax.ShapeDtypeStruct((2, *shape), jnp.float32)
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), x)
    return model, variables, x


@pytest.mark.standard_promotion(reason="flax.linen.avg_pool: divides by an int32 window size")
@pytest.mark.parametrize("name,shape,num_classes,count", FULL_SIZE)
def test_full_size_models_shapes_and_multiples_of_8(name, shape, num_classes, count):
    model, variables, x = _abstract_params(name, shape, num_classes)
    n = sum(p.size for p in jax.tree.leaves(variables["params"]))
    if count is not None:
        assert n == count
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, train=False), variables, x)
    assert logits.shape == (2, num_classes)
    # Feature dims are multiples of 8 (Tensor-Core friendly), except the classifier's outputs
    # and the first layer's input channels, which the data fixes.
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"]):
        if leaf.ndim >= 2 and leaf.shape[-1] != num_classes:
            assert leaf.shape[-1] % 8 == 0, (jax.tree_util.keystr(path), leaf.shape)


# The CIFAR/ImageNet models also run (tiny) in test_experiments_configs' smoke tests.
@pytest.mark.parametrize("name,shape,kw", [
    pytest.param("cnn", (8, 8, 1), dict(features=(8, 8), hidden=16), marks=pytest.mark.slow),
    ("cnn1d", (40,), {}),
    pytest.param("transformer", (8, 8, 1), dict(num_layers=1, model_dim=16, num_heads=2, mlp_dim=16, patch_size=4),
                 marks=pytest.mark.slow),
])
@pytest.mark.standard_promotion(reason="flax.linen.avg_pool: divides by an int32 window size")
def test_tiny_models_run_under_o2_with_fp32_norms(name, shape, kw):
    module = get_model(name, 10, **kw)
    model = jaxmp.flax.mixed_precision(module, "O2-bf16")
    x = np.random.default_rng(0).standard_normal((4, *shape)).astype(np.float32)
    # The init traced (its structure and dtypes are the real ones) and filled in numpy: the values
    # need only be sensible, and compiling the init would be a second program.
    variables = numpy_variables(jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), x))
    dtypes = {jax.tree_util.keystr(p): l.dtype for p, l in jax.tree_util.tree_leaves_with_path(variables["params"])}
    assert any(d == jnp.bfloat16 for d in dtypes.values())  # half params (O2)
    for k, d in dtypes.items():
        if "Norm" in k:
            assert d == jnp.float32, k  # norms stay fp32
    logits, updates = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables, x)
    assert logits.dtype == jnp.float32 and logits.shape == (4, 10)
    assert np.all(np.isfinite(np.asarray(logits)))
    for leaf in jax.tree.leaves(updates):
        assert leaf.dtype == jnp.float32


def test_get_model_errors_name_the_choices():
    with pytest.raises(ValueError, match="Unknown model 'vgg'.*wrn28_10"):
        get_model("vgg", 10)
    with pytest.raises(ValueError, match="no attribute.*'widen'"):
        get_model("wrn16_4", 10, widen=3)
    assert set(MODELS) >= {"wrn28_10", "wrn16_4", "resnet50", "resnet9", "cnn", "cnn1d", "transformer"}
