"""The lean presets as one table of records (jaxmp/lean/_presets.py): ``lean.PRESETS``, ``preset``'s
docstring table, the bytes, the key and the composition all come from (or are held to) the records."""

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp import lean
from jaxmp._scaling._transform import MasterWeightsState
from jaxmp._tree import find_states
from jaxmp.lean import _presets

RECORDS = {p.name: p for p in _presets.TABLE}


def test_the_table_is_one_record_per_preset_and_presets_is_derived_from_it():
    assert len(RECORDS) == len(_presets.TABLE)  # no name twice
    assert list(lean.PRESETS) == list(RECORDS)
    assert lean.PRESETS == {p.name: (p.bytes, p.doc) for p in _presets.TABLE}
    for name, (nbytes, doc) in lean.PRESETS.items():  # the public shape: name -> (bytes, doc)
        assert isinstance(name, str) and isinstance(nbytes, (int, float)) and isinstance(doc, str) and doc
    assert all(p.moments in _presets.MOMENTS and p.params in _presets.PARAMS for p in _presets.TABLE)
    assert _presets.BY_NAME == RECORDS


def _docstring_rows():
    rows = re.findall(r'^\s*\| ``"([\w-]+)"`` \| ([\d.]+) \| ``(.+)`` \|$', lean.preset.__doc__, re.M)
    assert rows, "preset's docstring table not found"
    return rows


def test_the_docstring_table_is_the_records():
    rows = _docstring_rows()
    assert [name for name, _, _ in rows] == list(RECORDS)
    for name, nbytes, composition in rows:
        assert float(nbytes) == round(RECORDS[name].bytes, 2), name
        assert composition == RECORDS[name].composition, name


def test_the_docstring_names_the_presets_that_need_a_key():
    doc = " ".join(lean.preset.__doc__.split())
    named = doc.split("required by the presets that round stochastically (")[1].split(")")[0]
    stochastic = [p.name for p in _presets.TABLE if p.draws_random_bits]
    # The bf16-sr family is named once ('and the "bf16-sr" ones').
    assert set(re.findall(r'"([\w-]+)"', named)) == {n for n in stochastic if not n.startswith("bf16-sr-")}


# What each half costs per parameter with AdamW: the param (2 bytes in bfloat16) and what keeps it
# (a float32 master 4, a remainder 2), and the two moments (float32 8, bfloat16 4; 8-bit: a byte
# plus a float32 scale per 256; 4-bit: half a byte plus one per 128).
_PARAM_BYTES = {"masters": 2 + 4, "remainders": 2 + 2, "bf16": 2}
_PARAM_BYTES_ON_FLOAT32 = {"masters": 4 + 4, "remainders": 4, "bf16": 4}
_MOMENT_BYTES = {"float32": 8, "bf16": 4, "8bit": 2 * (1 + 4 / 256), "4bit": 2 * (0.5 + 4 / 128)}


@pytest.mark.parametrize("name", list(RECORDS))
def test_the_bytes_of_a_record_are_those_of_its_parts(name):
    p = RECORDS[name]
    assert p.bytes == _PARAM_BYTES[p.params] + _MOMENT_BYTES[p.moments]
    assert p.float32_bytes == round(_PARAM_BYTES_ON_FLOAT32[p.params] + _MOMENT_BYTES[p.moments])


@pytest.mark.parametrize("name", list(RECORDS))
def test_draws_random_bits_is_what_the_preset_asks_of_its_key(name):
    p = RECORDS[name]
    assert p.draws_random_bits == (_presets.MOMENTS[p.moments].draws_random_bits
                                   or _presets.PARAMS[p.params].draws_random_bits)
    if p.draws_random_bits:
        with pytest.raises(TypeError, match=f"preset {name!r} rounds stochastically and needs key="):
            lean.preset(name, optax.adamw(1e-3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lean.preset(name, optax.adamw(1e-3), key=0)
    else:
        with pytest.warns(jaxmp.MixedPrecisionWarning, match="is unused.*the presets that round stochastically: "
                          + ", ".join(n for n, r in RECORDS.items() if r.draws_random_bits)):
            lean.preset(name, optax.adamw(1e-3), key=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lean.preset(name, optax.adamw(1e-3))


@pytest.mark.parametrize("name", list(RECORDS))
def test_preset_builds_the_composition_its_record_names(name):
    p = RECORDS[name]
    tx = lean.preset(name, optax.adamw(1e-3), key=0 if p.draws_random_bits else None)
    state = jax.eval_shape(tx.init, {"w": jnp.zeros((64, 128), jnp.bfloat16)})
    stored = {"float32": None, "bf16": lean.Bf16MomentsState, "8bit": lean.QuantizedMomentsState,
              "4bit": lean.QuantizedMomentsState}
    for cls in (lean.Bf16MomentsState, lean.QuantizedMomentsState):
        assert bool(find_states(state, cls)) == (stored[p.moments] is cls), cls
    if p.moments in ("8bit", "4bit"):
        assert find_states(state, lean.QuantizedMomentsState)[0].grid.bits == int(p.moments[0])
    held = {"masters": MasterWeightsState, "remainders": lean.ParamRemaindersState, "bf16": lean.Bf16ParamsState}
    for params, cls in held.items():
        assert bool(find_states(state, cls)) == (p.params == params), (params, cls)
