"""jaxmp._effects: the one owner of jaxmp's process-wide effects."""

import os
import pathlib
import subprocess
import sys
import types

import pytest

from jaxmp import _effects


def test_a_patch_is_installed_once_and_keeps_the_original():
    owner = types.SimpleNamespace(f=lambda: "original")
    before = owner.f
    assert _effects.original(owner, "f") is before  # never patched: the current attribute
    assert _effects.patch(owner, "f", lambda orig: lambda: "patched " + orig())
    assert owner.f() == "patched original"
    assert not _effects.patch(owner, "f", lambda orig: lambda: "twice")  # once per process
    assert owner.f() == "patched original"
    assert _effects.original(owner, "f") is before
    assert any(line.startswith("patch: ") and line.endswith(".f") for line in _effects.installed())


def test_a_class_attribute_patch_wraps_the_class_own_definition():
    class Base:
        def __call__(self):
            return 1

    class Child(Base):
        pass

    assert _effects.patch(Base, "__call__", lambda orig: lambda self: orig(self) + 1)
    assert Child()() == 2
    assert f"patch: {__name__}.{Base.__qualname__}.__call__" in _effects.installed()


def test_a_registration_is_retried_until_it_succeeds_then_never_run_again():
    calls = []
    key = f"test-{id(calls)}"

    def register():
        calls.append(1)
        return len(calls) >= 2  # the library "is loaded" from the second try on

    assert not _effects.register_once(key, register)
    assert _effects.register_once(key, register)
    assert _effects.register_once(key, register)
    assert len(calls) == 2
    assert f"registered: {key}" in _effects.installed()


_FRESH_PROCESS = """
import jax, jax.numpy as jnp
import equinox as eqx
import flax.linen as nn
from flax import nnx
import jaxmp, jaxmp.flax
from jaxmp import _effects

def hooked(classes):
    return sorted(c.__name__ for c in classes if getattr(vars(c).get("__call__"), "_jaxmp_marking", False))

jax_attention = jax.nn.dot_product_attention
assert jax_attention.__module__.startswith("jax."), jax_attention.__module__
assert nnx.dot_product_attention.__module__.startswith("flax."), nnx.dot_product_attention.__module__
assert nn.dot_product_attention.__module__.startswith("flax."), nn.dot_product_attention.__module__
classes = [nnx.Module, nnx.Linear, nnx.MultiHeadAttention, nnx.LayerNorm, nn.Module, nn.Dense, eqx.nn.Linear]
assert hooked(classes) == [], hooked(classes)
assert not any(line.startswith("patch: ") for line in _effects.installed()), _effects.installed()

layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
rules = jaxmp.AutocastRules(class_rules=((nnx.Linear, "float32"),))
def f(x):
    q = layer(x)[None, :, None, :]
    return jax.nn.dot_product_attention(q, q, q)
jaxmp.autocast(f, "O1-bf16", rules=rules)(jnp.ones((2, 4)))
assert jax.nn.dot_product_attention is not jax_attention
assert _effects.original(jax.nn, "dot_product_attention") is jax_attention
assert hooked(classes) == ["Linear"], hooked(classes)  # the ruled class (and its subclasses) only
assert nnx.dot_product_attention.__module__.startswith("flax.")
print("\\n".join(_effects.installed()))
"""


@pytest.mark.slow  # a fresh interpreter importing jax, flax, equinox and jaxmp: ~5 s, nothing to trim
def test_a_process_that_never_calls_autocast_sees_jax_and_flax_unpatched():
    root = pathlib.Path(__file__).resolve().parents[2]  # this checkout's jaxmp
    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=180,
                         cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    # After one autocast call: the attention router and the ruled class's hook (LoRALinear, a
    # subclass of nnx.Linear, runs the same rule), nothing else.
    assert "patch:" in lines and "registered:" in lines
    patched = [line for line in out.stdout.splitlines() if line.startswith("patch: ")]
    assert "patch: jax.nn.dot_product_attention" in patched, patched
    assert "patch: flax.nnx.nn.linear.Linear.__call__" in patched, patched
    assert all(line.endswith("Linear.__call__") for line in patched if "dot_product_attention" not in line), patched
    assert "registered: flax.serialization" in out.stdout.splitlines()
