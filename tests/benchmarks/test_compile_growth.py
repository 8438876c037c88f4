"""O1's optimized program against the same plan written by hand, and under ``lax.scan``, as depth grows.

XLA:CPU's ``fusion`` pass duplicates a float32 residual chain into later fusions, so an unrolled
O1 model's optimized HLO grows faster than its depth (docs/autocast.md, "Compile time of deep
O1 models"). These tests pin what jaxmp controls: O1 hands XLA nothing the hand-written
program with O1's dtype plan does not (the same converts added per layer), and a model whose
layers run under one ``lax.scan`` compiles one layer whatever its depth. The model is
``benchmarks/compile_growth.py``'s plain Transformer LM at tiny widths; the HLO text is
deterministic, so the counts are exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compile_growth as cg  # noqa: E402

TINY = dict(cg.sizes(8), seq=4, heads=2)


def _converts(variant: str, depths: tuple[int, ...], grad: bool) -> list[int]:
    return [cg.measure(variant, L, TINY, grad=grad)["converts"] for L in depths]


def _check_not_above_hand(depths: tuple[int, int], grad: bool) -> None:
    (o1_a, o1_b), (hand_a, hand_b) = _converts("O1", depths, grad), _converts("hand-same", depths, grad)
    span = depths[1] - depths[0]
    # Converts added per layer: O1 never above the hand-written program with its dtype plan.
    assert (o1_b - o1_a) / span <= (hand_b - hand_a) / span, (o1_a, o1_b, hand_a, hand_b)
    # And in total, up to the few converts of O1's own entry and exit (inputs, output cast).
    for o1, hand in ((o1_a, hand_a), (o1_b, hand_b)):
        assert o1 <= hand + 8, (o1, hand)


def test_o1_adds_no_more_converts_per_layer_than_its_plan_by_hand_forward():
    _check_not_above_hand((1, 2), grad=False)


@pytest.mark.slow
def test_o1_adds_no_more_converts_per_layer_than_its_plan_by_hand_value_and_grad():
    _check_not_above_hand((2, 8), grad=True)


def test_scanned_layers_compile_one_layer_whatever_the_depth():
    scanned = _converts("O1-scan", (2, 8), grad=False)
    assert scanned[0] == scanned[1] > 0, scanned


@pytest.mark.slow
def test_scanned_layers_compile_one_layer_whatever_the_depth_value_and_grad():
    scanned = _converts("O1-scan", (2, 8), grad=True)
    assert scanned[0] == scanned[1] > 0, scanned
    unrolled = _converts("O1", (2,), grad=True)[0]
    assert scanned[0] < unrolled  # one layer's body: less than two unrolled layers


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="the benchmark's LayerNorm mixes a bfloat16 param with float32 statistics, "
                                       "as user code under the Linen door does")
def test_compile_growth_dry_run_the_flax_doors_hand_xla_autocasts_program(tmp_path):
    out = tmp_path / "compile_growth.json"
    result = cg.main(["--dry-run", "--out", str(out)])
    rows = result["results"]
    assert set(rows) == set(cg.VARIANTS)
    for depth in ("1", "2"):
        # The same model through either Flax door compiles to the converts autocast's does.
        assert rows["linen"][depth]["converts"] == rows["nnx"][depth]["converts"] == rows["O1"][depth]["converts"]
        assert rows["float32"][depth]["converts"] == 0 < rows["O1"][depth]["converts"]
    assert rows["O1-scan"]["1"]["converts_per_layer"] > 0
    assert cg.json.loads(out.read_text())["depths"] == [1, 2]


def test_residual_fusion_repro_dry_run(tmp_path):
    from benchmarks import residual_fusion_repro

    out = tmp_path / "repro.json"
    results = residual_fusion_repro.main(["--dry-run", "--out", str(out)])["results"]
    written, branch = results["as_written"], results["bias_in_branch"]
    assert list(written) == list(branch) == ["2", "4"]
    # The bias added inside the branch never gives XLA more adds than the chain as written.
    assert all(branch[d] <= written[d] for d in written), results
    assert cg.json.loads(out.read_text())["results"] == results
