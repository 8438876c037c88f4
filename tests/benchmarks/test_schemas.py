"""The results schemas (benchmarks/_schemas.py): every committed result conforms, and a corrupted
one is refused with a problem that names the key path of what is wrong, schema by schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import _common as common
from benchmarks import _schemas as schemas

RESULTS = common.RESULTS_DIR
#: Records that scripts write outside the result envelope (no schema_version): not validated.
OUTSIDE_THE_ENVELOPE = {"debugger", "trace_profile", "efficiency_before_after", "compile_growth", None}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _fp8_result() -> dict:
    """An fp8 result as benchmarks/fp8.py writes it (none is committed: it needs fp8 hardware)."""
    stats = common.summarize([1.0, 1.2, 1.1])
    bf16 = {"step_time_s": stats, "loss_curve": [1.0, 0.5], "policy": "O2-bf16"}
    fp8 = {"step_time_s": stats, "loss_curve": [1.0, 0.6], "policy": "O2-fp8",
           "fp8_state": {"amaxes_recorded_min": 3}, "max_rel_loss_gap_last_half": 0.1}
    models = {"mlp": {"variants": {"bf16": bf16, "fp8": fp8}, "skipped": {}},
              "cnn": {"variants": {}, "skipped": {"bf16": "too slow on CPU"}}}
    return common.make_result("fp8", _load("overhead_cpu.json")["env"], {}, {"models": models}, dry_run=True)


def _fp8_blocks_result() -> dict:
    """A benchmarks/fp8_blocks.py result of one row (the committed study is checked with the other files)."""
    rows = [{"policy": "O2-mxfp8", "seed": 0, "eval_loss": 0.5, "eval_accuracy": 0.9, "train_time_s": 2.0}]
    return common.make_result("fp8_blocks", _load("overhead_cpu.json")["env"], {}, {"rows": rows, "summary": {}},
                              dry_run=True)


SOURCES = {
    "overhead": lambda: _load("overhead_cpu.json"),
    "gpu_suite": lambda: _load("gpu_nvidia_h100_80gb_hbm3.json"),
    "autocast": lambda: _load("autocast_cpu.json"),
    "efficiency": lambda: _load("efficiency_cpu.json"),
    "fidelity": lambda: _load("fidelity/fidelity_cpu.json"),
    "memory": lambda: _load("memory/memory_cpu.json"),
    "memory_gpt2": lambda: _load("memory/gpt2_cpu.json"),
    "memory_lean": lambda: _load("memory/lean_cpu.json"),
    "wire": lambda: _load("wire.json"),
    "wire_fidelity": lambda: _load("wire_fidelity.json"),
    "fp8": _fp8_result,
    "fp8_blocks": _fp8_blocks_result,
    "precision_search": lambda: _load("precision_search.json"),
}

_DELETE = object()

# (source, key path, new value or _DELETE, how a problem starts)
CORRUPTIONS = [
    ("overhead", ("results", "step_time_s", "jaxmp", "median"), -1.0,
     "results.step_time_s.jaxmp.median is not a positive number: -1.0"),
    ("overhead", ("results", "ratios", "jaxmp/bare"), _DELETE, "results.ratios: missing key 'jaxmp/bare'"),
    ("overhead", ("results", "step_time_s", "bare", "q25"), 1e9,
     "results.step_time_s.bare: min <= q25 <= median <= q75 <= max does not hold"),
    ("overhead", ("env", "versions", "jaxlib"), _DELETE, "env.versions: missing key 'jaxlib'"),
    ("overhead", ("dry_run",), "no", "dry_run is not a bool: 'no'"),
    ("overhead", ("benchmark",), "overheads", "result: unknown benchmark 'overheads'"),
    ("gpu_suite", ("results", "throughput", "results", "runs", 0, "items_per_s"), 0,
     "results.throughput.results.runs[0].items_per_s is not a positive number: 0"),
    ("gpu_suite", ("results", "throughput", "results", "runs", 0, "flops", "per_step"), -5,
     "results.throughput.results.runs[0].flops.per_step is not a positive number: -5"),
    ("gpu_suite", ("results", "throughput", "results", "matmul_peak"), _DELETE,
     "results.throughput.results: missing key 'matmul_peak'"),
    ("gpu_suite", ("results", "torch_amp", "status"), "maybe",
     "results.torch_amp: status must be 'ok' or 'skipped', got 'maybe'"),
    ("gpu_suite", ("results", "torch_amp", "env", "versions", "torch"), _DELETE,
     "results.torch_amp.env.versions: missing key 'torch'"),
    ("gpu_suite", ("results", "torch_amp", "results", "runs", 0, "status"), "error",
     "results.torch_amp.results.runs[0]: missing key 'error'"),
    ("gpu_suite", ("results", "torch_amp", "config"), _DELETE, "results.torch_amp: missing key 'config'"),
    ("autocast", ("results", "models", "mlp", "variants", "jaxmp", "hlo_converts"), -1,
     "results.models.mlp.variants.jaxmp.hlo_converts is not a count (int >= 0): -1"),
    ("autocast", ("results", "models", "mlp", "variants", "hand", "trace_s"), 0,
     "results.models.mlp.variants.hand.trace_s is not a positive number: 0"),
    ("autocast", ("results", "models", "mlp", "skipped"), {"hand": ""},
     "results.models.mlp.skipped.hand is not a non-empty string: ''"),
    ("autocast", ("results", "models"), {}, "results.models is not a non-empty dict: {}"),
    ("efficiency", ("results", "models", "mlp", "grad", "native"), _DELETE,
     "results.models.mlp.grad: missing key 'native'"),
    ("efficiency", ("results", "models", "mlp", "step", "jaxmp-O2", "converts"), "7",
     "results.models.mlp.step.jaxmp-O2.converts is not a number: '7'"),
    ("fidelity", ("results", "lm", "runs", "bf16-sr", 0, "eval_loss"), -0.5,
     "results.lm.runs.bf16-sr[0].eval_loss is not a non-negative number: -0.5"),
    ("fidelity", ("results", "lm", "summary", "bf16-sr"), _DELETE,
     "results.lm: summary lacks an entry for a key of runs"),
    ("fidelity", ("results", "lm", "runs", "bf16-sr"), [], "results.lm.runs.bf16-sr is not a non-empty list: []"),
    ("memory", ("results", "rows", 0, "recipe"), _DELETE, "results.rows[0]: missing key 'recipe'"),
    ("fp8_blocks", ("results", "rows", 0, "policy"), _DELETE, "results.rows[0]: missing key 'policy'"),
    ("memory", ("results", "rows"), [], "results.rows is not a non-empty list: []"),
    ("memory_gpt2", ("results", "rows", 1, "compiled", "peak_estimate_bytes"), 1.5,
     "results.rows[1].compiled.peak_estimate_bytes is not an int: 1.5"),
    ("memory_lean", ("results", "rows", 2, "bytes_per_param"), _DELETE, "results.rows[2]: missing key 'bytes_per_param'"),
    ("wire", ("results", "rows", 1, "wire_bytes"), -1.0, "results.rows[1].wire_bytes is not a non-negative number: -1.0"),
    ("wire_fidelity", ("results", "models", "lm zero", "summary"), _DELETE,
     "results.models.lm zero: missing key 'summary'"),
    # A measured row relabelled "not available" lacks the options it misses.
    ("wire", ("results", "rows", 3, "status"), "not available in this build", "results.rows[3]: missing key 'missing'"),
    ("wire", ("results", "rows", 0, "status"), "guessed",
     "results.rows[0]: status must be measured, refused or not available, got 'guessed'"),
    ("fp8", ("results", "models", "mlp", "variants", "fp8", "fp8_state", "amaxes_recorded_min"), 0,
     "results.models.mlp.variants.fp8.fp8_state.amaxes_recorded_min is not a positive number: 0"),
    ("fp8", ("results", "models", "mlp", "variants", "fp8", "max_rel_loss_gap_last_half"), _DELETE,
     "results.models.mlp.variants.fp8: missing key 'max_rel_loss_gap_last_half'"),
    ("precision_search", ("results", "models", "flax_resnet", "variants", "chosen", "within"), "yes",
     "results.models.flax_resnet.variants.chosen.within is not a bool: 'yes'"),
    ("precision_search", ("results", "models", "flax_resnet", "variants", "float32"), _DELETE,
     "results.models.flax_resnet.variants: missing key 'float32'"),
    ("fp8", ("results", "models", "cnn", "skipped"), {}, "results.models.cnn: variants or skipped must be non-empty"),
    ("fp8", ("results", "models", "mlp", "variants", "bf16", "loss_curve"), [],
     "results.models.mlp.variants.bf16.loss_curve is not a non-empty list: []"),
]


def _corrupt(result: dict, path: tuple, value) -> dict:
    bad = copy.deepcopy(result)
    parent = bad
    for key in path[:-1]:
        parent = parent[key]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return bad


def test_every_committed_result_conforms():
    checked = 0
    for path in sorted(RESULTS.rglob("*.json")):
        result = json.loads(path.read_text())
        if "schema_version" not in result:
            assert result.get("benchmark") in OUTSIDE_THE_ENVELOPE, f"{path}: a result without the envelope"
            continue
        assert common.validate_result(result) == [], path
        checked += 1
    assert checked >= 20  # the files above: overhead, autocast, efficiency, fidelity, memory, the GPU suite


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_source_conforms(source):
    assert common.validate_result(SOURCES[source]()) == []


@pytest.mark.parametrize("source,path,value,says", CORRUPTIONS,
                         ids=[f"{c[0]}:{'.'.join(map(str, c[1]))}" for c in CORRUPTIONS])
def test_a_corrupted_result_is_refused_naming_the_key_path(source, path, value, says):
    problems = common.validate_result(_corrupt(SOURCES[source](), path, value))
    assert any(p.startswith(says) for p in problems), problems


def test_every_schema_is_exercised_by_a_corruption():
    exercised = {c[0] for c in CORRUPTIONS} | {"throughput", "torch_amp"}  # both inside the GPU suite
    assert exercised == set(schemas.SCHEMAS)


def test_what_is_not_a_result():
    assert common.validate_result([1, 2]) == ["result is not a dict: [1, 2]"]
    assert common.validate_result({"benchmark": "overhead"})[0] == "missing key 'schema_version'"
    with pytest.raises(ValueError, match="results.rows is not a non-empty list"):
        common.write_json(Path("/nonexistent/never-written.json"), _corrupt(SOURCES["memory"](), ("results", "rows"), []))
