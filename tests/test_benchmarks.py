"""The benchmark scripts in dry-run mode (tiny models, CPU) and the schema of what they write.

The real numbers come from ``python benchmarks/overhead.py`` (CPU) and ``bash benchmarks/run_gpu.sh``
(GPU); these tests only check that every script runs end to end and writes well-formed JSON,
that the PyTorch peer skips cleanly without torch, and that the report's targets logic and the
README's generated section agree with the committed results.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as common  # noqa: E402
from benchmarks import overhead, report, run_gpu, throughput, torch_amp  # noqa: E402

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _assert_valid(result: dict, benchmark: str) -> None:
    assert result["benchmark"] == benchmark
    problems = common.validate_result(result)
    assert problems == [], problems
    env = result["env"]
    assert isinstance(env["git_commit"]["sha"], str) and env["git_commit"]["sha"]
    assert isinstance(result["config"], dict)
    json.dumps(result, allow_nan=False)  # strict JSON


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One dry run of the GPU driver (one model, the O2-bf16 policy, its torch twin), to a tmp dir.

    Kept to one policy so the file stays fast; ``--dry-run`` without filters covers every model
    and policy (see benchmarks/README.md).
    """
    out = tmp_path_factory.mktemp("bench") / "gpu_dry.json"
    result = run_gpu.main(["--dry-run", "--quiet", "--models", "transformer", "--policies", "O2-bf16",
                           "--variants", "amp-bf16", "--skip-overhead", "--out", str(out)])
    return out, result


def test_overhead_dry_run_writes_valid_json(tmp_path):
    out = tmp_path / "overhead.json"
    overhead.main(["--dry-run", "--quiet", "--variants", "bare,jaxmp", "--out", str(out)])
    result = json.loads(out.read_text())
    _assert_valid(result, "overhead")
    r, cfg = result["results"], result["config"]
    assert result["dry_run"] is True
    assert set(r["step_time_s"]) == {"bare", "jaxmp"}
    assert all(len(v) == cfg["rounds"] for v in r["samples_s"].values())
    assert r["ratios"]["jaxmp/bare"]["median"] > 0
    assert r["target"]["limit"] == 1.03  # CPU
    assert isinstance(r["target"]["pass"], bool)
    assert r["skipped_steps"] == {"jaxmp": 0}  # every step finite: a fair comparison
    assert r["compiled"]["jaxmp"]["entry_instructions"] > 0
    for k in ("jax", "jaxlib", "flax", "optax"):
        assert result["env"]["versions"][k]


def test_throughput_part_of_the_suite(suite):
    path, result = suite
    tp = result["results"]["throughput"]
    _assert_valid(tp, "throughput")
    runs = {e["policy"]: e for e in tp["results"]["runs"]}
    assert set(runs) == {"O2-bf16"}
    for e in runs.values():
        assert e["status"] == "ok", e.get("error")
        assert e["items_per_s"] > 0 and e["unit"] == "tokens"
        assert e["memory"]["source"].startswith(("peak_bytes_in_use", "memory_analysis"))
        assert e["flops"]["per_step"] > 0 and e["fraction_of_matmul_peak"] > 0
    assert "bfloat16" in runs["O2-bf16"]["param_dtypes"]  # half params, fp32 master in the state
    assert runs["O2-bf16"]["recipe"]["master_weights"] is True
    assert tp["results"]["matmul_peak"]["tflops"] > 0


def test_gpu_suite_json(suite):
    path, result = suite
    on_disk = json.loads(Path(path).read_text())
    _assert_valid(on_disk, "gpu_suite")
    if HAS_TORCH:
        assert [r["policy"] for r in on_disk["results"]["comparison"]] == ["O2-bf16"]
        assert all(r["speed_ratio"] > 0 for r in on_disk["results"]["comparison"])


def test_torch_peer_in_the_suite(suite):
    _, result = suite
    tr = result["results"]["torch_amp"]
    _assert_valid(tr, "torch_amp")
    if HAS_TORCH:
        assert tr["status"] == "ok"
        assert [e["policy"] for e in tr["results"]["runs"]] == ["amp-bf16"]
        assert all(e["status"] == "ok" and e["items_per_s"] > 0 for e in tr["results"]["runs"])
    else:
        assert tr["status"] == "skipped" and tr["reason"] == torch_amp.SKIP_MESSAGE


def test_torch_peer_skips_cleanly_without_torch(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    out = tmp_path / "torch.json"
    result = torch_amp.main(["--dry-run", "--out", str(out)])
    assert "SKIPPED: PyTorch is not installed" in capsys.readouterr().out
    assert result["status"] == "skipped" and result["reason"] == torch_amp.SKIP_MESSAGE
    _assert_valid(json.loads(out.read_text()), "torch_amp")


def test_validator_rejects_malformed_results(suite):
    _, result = suite
    tp = result["results"]["throughput"]
    bad = copy.deepcopy(tp)
    del bad["env"]["versions"]["jaxlib"]
    assert any("jaxlib" in p for p in common.validate_result(bad))
    bad = copy.deepcopy(tp)
    bad["results"]["runs"][0]["step_time_s"]["median"] = -1.0
    assert common.validate_result(bad)
    bad = copy.deepcopy(tp)
    bad["results"]["runs"][0]["items_per_s"] = 0
    assert common.validate_result(bad)
    bad = copy.deepcopy(tp)
    del bad["config"]
    assert common.validate_result(bad) == ["missing key 'config'"]
    with pytest.raises(ValueError):
        common.write_json(Path("/nonexistent/never-written.json"), bad)


def _fake_run(model, batch, policy, items, peak, framework="jax"):
    st = common.summarize([1.0, 1.1, 1.2])
    e = {"model": model, "batch_size": batch, "policy": policy, "status": "ok", "step_time_s": st,
         "items_per_s": items, "unit": "images", "memory": {"source": "peak_bytes_in_use", "peak_bytes": peak}}
    if framework == "jax":
        e["flops"] = {"per_step": 1e12, "source": "xla_cost_analysis"}
    return e


def test_report_targets_pass_fail_and_not_measured(suite):
    _, result = suite
    env = dict(result["results"]["throughput"]["env"], device="Fake GPU", platform="gpu")
    tp = common.make_result("throughput", env, {}, {
        "runs": [_fake_run("resnet50", 256, "O0-strict", 1000, 9e9), _fake_run("resnet50", 256, "O2-bf16", 3500, 5e9),
                 _fake_run("wrn28_10", 128, "O0", 800, 10e9), _fake_run("wrn28_10", 128, "O2-bf16", 1900, 7e9)],
        "matmul_peak": {"tflops": 700.0, "n": 8192}}, dry_run=False)
    tr = common.make_result("torch_amp", dict(env, versions={"torch": "2.x"}), {}, {
        "runs": [_fake_run("resnet50", 256, "amp-fp16", 3000, 6e9, "torch"),
                 _fake_run("resnet50", 256, "amp-bf16", 3200, 6e9, "torch")]}, dry_run=False, status="ok")
    assert common.validate_result(tp) == [] and common.validate_result(tr) == []
    rows = report.evaluate_targets({"overhead": [], "throughput": [("t", tp)], "torch_amp": [("p", tr)]})
    statuses = [r["status"] for r in rows]
    # 3.5x strict fp32: pass; 3500/3200 = 1.09x the faster AMP: pass; 7/10 memory: fail; no overhead files.
    assert statuses == ["pass", "pass", "fail", "not measured", "not measured"], rows
    md = report.markdown({"overhead": [], "throughput": [("t", tp)], "torch_amp": [("p", tr)]})
    assert "| resnet50 | 256 | O2-bf16 | 3,500 images |" in md and "amp-bf16: 3,200" in md


def test_report_from_committed_results_matches_readme():
    # The README's generated section is what report.py makes of the committed JSON files.
    assert report.main(["--check"]) == 0
    res = report.load_results(common.RESULTS_DIR)
    assert all(not r["dry_run"] for k in res for _, r in res[k])
    md = report.markdown(res)
    assert "not measured yet" in md or res["throughput"]


def test_every_script_has_a_dry_run_flag():
    for mod in (throughput, torch_amp):
        assert "--dry-run" in mod.build_parser().format_help()
    for script in ("overhead.py", "run_gpu.py", "throughput.py", "torch_amp.py"):
        assert "--dry-run" in (ROOT / "benchmarks" / script).read_text()
    assert "run_gpu.py" in (ROOT / "benchmarks" / "run_gpu.sh").read_text()
