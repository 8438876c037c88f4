"""The peer and hardware statements of the low-bit pages against the code (issue 59's "what it
must show"): docs/lean-recipes.md names the peer of every code map and quotes the reference
test's counts; docs/fp8.md names the peer of every scale rule (with values the quantizer gives),
quotes the block reference's counts, and is the one page that says what a block preset does on
CPU, H100/H200, Blackwell and TPU, which `jaxmp.fp8.check_hardware` answers the same way.
"""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests._support._markdown import README, page, pages

import jaxmp
from jaxmp import _formats, fp8
from jaxmp._formats import _block_scaled as B


def _heading(text: str, title: str) -> str:
    """The text under the heading ``title`` (any level) up to the next heading of that level or
    above, code blocks left out (a ``# comment`` in one is no heading)."""
    text = re.sub(r"^```.*?^```\n", "", text, flags=re.M | re.S)
    match = re.search(rf"^(#+) {re.escape(title)}\n", text, flags=re.M)
    assert match, f"no heading {title!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def _rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``text`` (not their headers), as stripped cells."""
    lines = text.splitlines()
    separator = [bool(re.match(r"^\|[-| ]+\|$", line.strip())) for line in lines]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for i, line in enumerate(lines)
            if line.startswith("|") and not separator[i] and not (i + 1 < len(lines) and separator[i + 1])]


def test_lean_recipes_names_the_peer_of_every_map_and_quotes_the_reference_counts():
    from tests.lean.test_lean_reference import DIFFERENCES

    text = _heading(page("lean-recipes.md").read_text(), "The peers, bit for bit")
    table = {row[0]: row[1] for row in _rows(text)}
    names = {(8, True): "8-bit signed (first moments)", (8, False): "8-bit unsigned (second moments)",
             (4, True): "4-bit signed", (4, False): "4-bit unsigned"}
    assert set(names) == set(_formats.CODE_MAPS)
    for (bits, signed), name in names.items():
        peers = table[name]
        assert "torchao's" in peers and ("bitsandbytes'" in peers) is (bits == 8), name
        assert f"get_qmap_{'signed' if signed else 'unsigned'}()" in peers, name
    # The counts the prose quotes are the ones the reference test holds jaxmp to.
    ties = [DIFFERENCES["torchao", n]["ties"][0] for n in ("8s", "8u", "4s", "4u")]
    assert f"{ties[0]} of 256 values of a block of\n  midpoints at 8 bits signed, {ties[1]} unsigned, " \
           f"{ties[2]} and {ties[3]} of 128 at 4 bits" in text
    decades = [DIFFERENCES["bnb", n]["decades"][0] for n in ("8s", "8u")]
    assert f"({decades[0]}\nof 256 values of the seven-decade block signed, {decades[1]} unsigned)" in text
    tiny = DIFFERENCES["torchao", "4u"]["tiny"][0]
    assert f"({tiny} of 128 at\n  4 bits unsigned)" in text


def _exponent(amax: float, rule: str) -> int:
    """The E8M0 exponent the quantizer gives a 1x32 E4M3 block whose largest magnitude is ``amax``."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = amax
    scale = jax.jit(lambda v: B.quantize(v, jnp.float8_e4m3fn, (1, 32), "e8m0", rule).scale)(x)
    return int(np.asarray(jax.lax.bitcast_convert_type(scale, jnp.uint8))[0, 0]) - 127


def test_fp8_names_the_peer_of_every_scale_rule_and_its_values_are_the_quantizers():
    text = _heading(page("fp8.md").read_text(), "Block-scaled formats")
    rules = {row[0].strip("`\""): row for row in _rows(text) if re.fullmatch(r'`"\w+"`', row[0])
             and len(row) == 6}
    assert set(rules) == set(B.POW2_RULES)
    for rule, (_, _, equals, at_09, at_448, at_449) in rules.items():
        assert f"torchao `{rule.upper()}`" in equals or (rule == "floor" and "`ScaleCalculationMode.FLOOR`" in equals)
        got = [_exponent(a, rule) for a in (0.9, 448.0, 449.0)]
        assert [int(re.match(r"-?\d+", c).group()) for c in (at_09, at_448, at_449)] == got, rule
    assert "Transformer Engine's" in rules["rceil"][2] and "JAX's `scaled_dot_general`" in rules["rceil"][2]
    assert "OCP Microscaling" in rules["floor"][2]
    # The differences by design are the ones the block reference test counts.
    from tests.fp8.test_peer_reference import MX_EXPECTED, NVFP4_EXPECTED

    counts = [int(row[-1].split()[0]) for row in _rows(_heading(text, "Against the peers"))]
    assert counts == [*MX_EXPECTED.values(), *NVFP4_EXPECTED.values()]


def _gpu(cc: str, kind: str):
    return SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind)


def test_fp8_is_the_one_page_of_what_each_preset_does_per_hardware_and_check_hardware_agrees(monkeypatch):
    from jaxmp.fp8 import _hardware

    text = _heading(page("fp8.md").read_text(), "Where each preset runs")
    table = {row[0]: row[1:] for row in _rows(text)}
    assert len(table) == 4      # four rows of hardware
    hardware = {"CPU": "cpu", "H100, H200, Ada (fp8 Tensor Cores, no block-scaled GEMMs)": _gpu("9.0", "NVIDIA H200"),
                "TPU, GPUs before compute capability 8.9 (A100)": SimpleNamespace(platform="tpu")}
    per_tensor, block = jaxmp.get_recipe("O2-fp8-current").fp8, jaxmp.get_recipe("O2-nvfp4").fp8
    for row, device in hardware.items():
        said_per_tensor, said_block = table[row]
        if said_per_tensor.startswith("refused"):
            with pytest.raises(ValueError, match="opt in with emulate=True"):
                fp8.check_hardware(per_tensor, device)
        else:
            assert said_per_tensor.split()[0] == fp8.check_hardware(per_tensor, device), row
        assert said_block.split()[0].strip(",") == fp8.check_hardware(block, device) == "emulated", row
    blackwell = next(row for row in table if row.startswith("Blackwell"))
    monkeypatch.setattr(_hardware, "_jax_version", lambda: (0, 12))
    b200 = _gpu("10.0", "NVIDIA B200")
    assert table[blackwell][0] == "native" == fp8.check_hardware(per_tensor, b200)
    assert "MXFP8's forward matmul native" in table[blackwell][1]
    assert fp8.check_hardware(jaxmp.get_recipe("O2-mxfp8").fp8, b200) == "native"
    assert fp8.check_hardware(block, b200) == "emulated"      # "the other formats emulated"
    # Told there only: the other pages that name the hardware point at it.
    for path in (README, page("concepts.md"), page("index.md")):
        line = next(p for p in path.read_text().split("\n\n") if "H100/H200, Blackwell and TPU" in p)
        assert "fp8.md" in line, path
    for path in pages():
        if path.name != "fp8.md":
            rows = [r for r in _rows(path.read_text()) if any("nvfp4" in c.lower() or "mxfp8" in c.lower() for c in r)]
            assert not [r for r in rows if any(re.search(r"H100|H200|Blackwell|TPU", c) for c in r)], path
