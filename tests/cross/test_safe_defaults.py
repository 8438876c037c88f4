"""Safe defaults that speak: set-ups that run but save or learn nothing say so, typos get a
"did you mean", and rebuilding jaxmp.autocast(f) on every eager call costs no retrace."""

import gc
import time
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp import lean
from jaxmp.lean import _presets


def _caught(fn):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return [w for w in record if issubclass(w.category, jaxmp.MixedPrecisionWarning)]


F32 = {"w": jnp.ones((64, 64), jnp.float32), "b": jnp.ones(64, jnp.float32)}
BF16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), F32)


@pytest.mark.parametrize("name", list(lean.PRESETS))
def test_a_lean_preset_on_float32_params_warns_that_it_saves_nothing(name):
    tx = jaxmp.loss_scaling(lean.preset(name, optax.adamw(1e-3), key=0), "none")
    caught = _caught(lambda: tx.init(F32))
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the user's init
    text = str(caught[0].message)
    assert f"preset({name!r})" in text and "bfloat16" in text and "cast_floating" in text
    assert _caught(lambda: tx.init(BF16)) == []  # what the presets are for: silent
    # The figure the warning gives is what the state costs on float32 params (AdamW, per param).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.MixedPrecisionWarning)
        state = tx.init(F32)
    n = sum(x.size for x in jax.tree_util.tree_leaves(F32))
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((F32, state)) if x.size >= n // 64)
    assert round(nbytes / n) == _presets.BY_NAME[name].float32_bytes, name
    assert f"spends {round(nbytes / n)}" in text


_USER_CODE_UNDER_A_JAXMP_FOLDER = """
import os, warnings
import jax.numpy as jnp, optax, jaxmp
from jaxmp import lean
tx = jaxmp.loss_scaling(lean.preset("bf16-sr", optax.adamw(1e-3), key=0), "none")
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    tx.init({"w": jnp.ones((64, 64), jnp.float32)})
(w,) = [w for w in record if issubclass(w.category, jaxmp.MixedPrecisionWarning)]
print(os.path.realpath(w.filename) == os.path.realpath(__file__), w.filename, w.lineno)
"""


def test_a_warning_points_at_user_code_that_lives_under_a_folder_named_jaxmp(tmp_path):
    # The README clones into a folder named ``jaxmp``: user code (and these tests) then live under
    # ``.../jaxmp/``. A warning must still point at that code, not at a frame above it.
    import os
    import pathlib
    import subprocess
    import sys

    folder = tmp_path / "jaxmp" / "tests"
    folder.mkdir(parents=True)
    script = folder / "user_code.py"
    script.write_text(_USER_CODE_UNDER_A_JAXMP_FOLDER)
    package_root = str(pathlib.Path(jaxmp.__file__).resolve().parent.parent)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "True", done.stdout


def test_o2_bf16_without_master_weights_warns_as_o2_fp16_does():
    fp16 = _caught(lambda: jaxmp.loss_scaling(optax.adam(1e-3)).init({"w": jnp.ones(4, jnp.float16)}))
    bf16 = _caught(lambda: jaxmp.loss_scaling(optax.adam(1e-3), "none").init({"w": jnp.ones(4, jnp.bfloat16)}))
    assert len(fp16) == len(bf16) == 1
    assert str(bf16[0].message).startswith(str(fp16[0].message).replace("float16", "bfloat16"))
    assert bf16[0].filename == fp16[0].filename == __file__
    # Said on purpose (O3: master_weights=False), with masters, or with stochastic rounding: silent.
    for tx in (jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=False),
               jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=True),
               jaxmp.loss_scaling(lean.bf16_params(optax.adam(1e-3), key=0), "none"),
               jaxmp.loss_scaling(lean.preset("remainders", optax.adam(1e-3), accumulate_steps=2), "none")):
        assert _caught(lambda: tx.init({"w": jnp.ones(4, jnp.bfloat16)})) == []
    recipe = jaxmp.get_recipe("O3-bf16")  # the recipe says it: no warning either
    tx = jaxmp.loss_scaling(optax.adam(1e-3), recipe.loss_scale, master_weights=recipe.master_weights)
    assert _caught(lambda: tx.init({"w": jnp.ones(4, jnp.bfloat16)})) == []


@pytest.mark.parametrize("typo,meant", [("O2-bf61", "O2-bf16"), ("02-bf16", "O2-bf16"), ("O2bf16", "O2-bf16"),
                                        ("mixed_bfloat61", "mixed_bfloat16"), ("bfloat61", "bfloat16")])
def test_a_policy_typo_says_what_was_meant(typo, meant):
    for parse in (jaxmp.get_policy, lambda t: jaxmp.autocast(lambda x: x, t)):
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            parse(typo)
    with pytest.raises(ValueError, match="Unknown policy 'garbage': expected"):  # no guess when nothing is close
        jaxmp.get_policy("garbage")


def test_a_preset_typo_says_what_was_meant():
    with pytest.raises(ValueError, match="did you mean 'O2-fp16'"):
        jaxmp.get_recipe("O2-fp61")
    with pytest.raises(ValueError, match="did you mean 'bf16-sr'"):
        lean.preset("bf16_sr", optax.adamw(1e-3), key=0)


def _mlp_loss(params, x):
    h = x
    for w in params:
        h = jax.nn.gelu(h @ w)
    return jnp.mean(jax.nn.log_softmax(h) ** 2)


def test_autocast_rebuilt_on_every_eager_call_reuses_the_traced_program():
    params = [jnp.full((32, 32), 0.01 * (i + 1)) for i in range(3)]
    x = jnp.ones((4, 32))
    first = jaxmp.autocast(_mlp_loss, "O1-bf16")
    expected = jax.grad(first)(params, x)
    second = jaxmp.autocast(_mlp_loss, "O1-bf16")
    assert second._programs is first._programs  # one program cache per (function, settings)
    assert jaxmp.autocast(_mlp_loss, "O1-fp16")._programs is not first._programs
    start = time.perf_counter()
    for _ in range(5):
        got = jax.grad(jaxmp.autocast(_mlp_loss, "O1-bf16"))(params, x)
    per_call = (time.perf_counter() - start) / 5
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(got, expected))
    assert per_call < 0.25, f"rebuilding autocast costs {per_call:.2f} s a call: it traces again"


def test_the_shared_program_cache_lets_the_function_go():
    from jaxmp.engine import _build as api

    def make():
        def f(x):
            return jnp.sin(x @ x)
        jaxmp.autocast(f, "O1-bf16")(jnp.ones((2, 2)))
        return id(f)

    ident = make()
    gc.collect()
    assert ident not in api._SHARED
