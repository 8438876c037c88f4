"""The benchmark scripts in dry-run mode (tiny models, CPU) and the schema of what they write.

The real numbers come from ``python -m benchmarks.overhead`` (CPU) and ``bash benchmarks/run_gpu.sh``
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

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as common  # noqa: E402
from benchmarks import flops, kernel_profile, overhead, report, run_gpu, throughput, torch_amp  # noqa: E402
from benchmarks._native import NativeModel  # noqa: E402
from jaxmp import _jaxpr  # noqa: E402

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
    result = run_gpu.main(["--dry-run", "--quiet", "--models", "transformer", "--policies", "O2-bf16,native-bf16",
                           "--variants", "amp-bf16", "--skip-overhead", "--out", str(out)])
    return out, result


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
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


@pytest.mark.slow
def test_throughput_part_of_the_suite(suite):
    path, result = suite
    tp = result["results"]["throughput"]
    _assert_valid(tp, "throughput")
    runs = {e["policy"]: e for e in tp["results"]["runs"]}
    assert set(runs) == {"O2-bf16", "native-bf16"}
    for e in runs.values():
        assert e["status"] == "ok", e.get("error")
        assert e["items_per_s"] > 0 and e["unit"] == "tokens"
        assert e["memory"]["source"].startswith(("peak_bytes_in_use", "memory_analysis"))
        assert e["flops"]["source"] == "analytic" and e["flops"]["per_step"] > 0
        assert e["tflops_per_s"] == pytest.approx(e["flops"]["per_step"] / e["step_time_s"]["median"] / 1e12)
        assert e["mfu"]["mfu_measured_peak"] == e["fraction_of_matmul_peak"] > 0
        assert e["mfu"]["datasheet_peak_tflops"] is None  # a CPU has no datasheet entry
    # The dry-run encoder: 1 layer, d=8, mlp 16, 10 classes, batch 2 x 8 tokens.
    assert runs["O2-bf16"]["flops"]["per_step"] == runs["native-bf16"]["flops"]["per_step"] == \
        6 * runs["O2-bf16"]["flops"]["n_params"] * 2 * 8 + 12 * 1 * 2 * 8**2 * 8
    assert runs["native-bf16"]["native"]["dtype"] == "bfloat16" and runs["native-bf16"]["recipe"] is None
    assert runs["native-bf16"]["param_dtypes"] == ["float32"]
    assert "bfloat16" in runs["O2-bf16"]["param_dtypes"]  # half params, fp32 master in the state
    assert runs["O2-bf16"]["recipe"]["master_weights"] is True
    assert tp["results"]["matmul_peak"]["tflops"] > 0


@pytest.mark.slow
def test_gpu_suite_json(suite):
    path, result = suite
    on_disk = json.loads(Path(path).read_text())
    _assert_valid(on_disk, "gpu_suite")
    assert on_disk["results"]["throughput"]["complete"] is True
    if HAS_TORCH:
        assert [r["policy"] for r in on_disk["results"]["comparison"]] == ["O2-bf16", "native-bf16"]
        assert all(r["speed_ratio"] > 0 for r in on_disk["results"]["comparison"])


@pytest.mark.slow
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


@pytest.mark.slow  # shares the GPU driver's dry run (~10 s) with the suite tests
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


@pytest.mark.slow  # shares the GPU driver's dry run (~10 s) with the suite tests
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
    assert "-m benchmarks.run_gpu" in (ROOT / "benchmarks" / "run_gpu.sh").read_text()


# ----------------------------------------------------------------------------------------------
# Analytic FLOPs against hand computations (full-size models, abstract shapes: nothing runs).


def _train_flops(name, classes, shape, **overrides):
    import jax
    import jax.numpy as jnp

    from experiments.models import get_model

    module = get_model(name, classes, **overrides)
    variables = jax.eval_shape(lambda k, x: module.init(k, x, train=False), jax.random.PRNGKey(0),
                               jax.ShapeDtypeStruct(shape, jnp.float32))
    return flops.model_train_flops(name, module, variables, shape)


def test_resnet50_flops_match_hand_computation():
    # Multiply-accumulates of ResNet-50 v1.5 at 224 x 224, 1000 classes, one image.
    macs = 112 * 112 * 64 * (7 * 7 * 3)  # stem: 7x7/2 conv, 3 -> 64 channels
    h, cin = 56, 64  # after the 3x3/2 max-pool
    for stage, blocks in enumerate((3, 4, 6, 3)):
        f = 64 * 2**stage
        for j in range(blocks):
            s = 2 if stage > 0 and j == 0 else 1
            ho = h // s
            macs += h * h * cin * f  # 1x1 reduce, at the input resolution
            macs += ho * ho * f * (3 * 3 * f)  # 3x3, carries the stride (v1.5)
            macs += ho * ho * 4 * f * f  # 1x1 expand
            if j == 0:
                macs += ho * ho * 4 * f * cin  # 1x1 projection shortcut
            h, cin = ho, 4 * f
    macs += 2048 * 1000  # classifier
    assert 4.08e9 < macs < 4.10e9  # the 4.1 GMACs usually quoted for ResNet-50
    got = _train_flops("resnet50", 1000, (1, 224, 224, 3))
    assert got["forward"] == 2 * macs
    assert got["per_step"] == 3 * 2 * macs


def test_wrn28_10_flops_match_hand_computation():
    # WRN-28-10 on 32 x 32 x 3: stem 3 -> 16, then 3 groups of 4 pre-activation blocks.
    macs = 32 * 32 * 16 * (3 * 3 * 3)
    h, cin = 32, 16
    for group, width in enumerate((160, 320, 640)):
        for i in range(4):
            s = 2 if group > 0 and i == 0 else 1
            ho = h // s
            macs += ho * ho * width * (3 * 3 * cin)  # first 3x3 (strided)
            macs += ho * ho * width * (3 * 3 * width)  # second 3x3
            if s != 1 or cin != width:
                macs += ho * ho * width * cin  # 1x1 projection
            h, cin = ho, width
    macs += 640 * 10
    assert 5.2e9 < macs < 5.3e9  # 5.25 GMACs per image, as usually quoted
    got = _train_flops("wrn28_10", 10, (1, 32, 32, 3))
    assert got["forward"] == 2 * macs and got["per_step"] == 6 * macs


def test_transformer_flops_match_hand_computation():
    L, d, m, C, B, T = 12, 768, 3072, 10, 32, 512
    per_layer = (2 * d  # LayerNorm scale + bias
                 + 4 * (d * d + d)  # query, key, value, output projections with biases
                 + 2 * d  # second LayerNorm
                 + (d * m + m) + (m * d + d))  # MLP
    n = (1 * d + d) + L * per_layer + 2 * d + (d * C + C)  # embedding Dense(1 -> d), final LN, head
    assert n == 85_065_226
    hand = 6 * n * B * T + 12 * L * B * T**2 * d  # 6 N tokens + QK^T and AV, forward x 3
    got = _train_flops("transformer", C, (B, T), num_layers=L, model_dim=d, num_heads=12, mlp_dim=m)
    assert got["n_params"] == n and got["per_step"] == hand
    # Cross-check against the matmuls of the jaxpr: the formula charges the head for every token
    # (it runs once per sequence) and the 1 -> d embedding as a matmul: within 0.5%.
    assert got["per_step"] == pytest.approx(3 * got["forward"], rel=5e-3)


def test_mfu_against_measured_and_datasheet_peaks():
    m = flops.mfu(9.29e12, 0.03, 700.0, "NVIDIA H100 80GB HBM3")
    assert m["tflops_per_s"] == pytest.approx(309.67, rel=1e-4)
    assert m["mfu_measured_peak"] == pytest.approx(309.67 / 700, rel=1e-4)
    assert m["datasheet_peak_tflops"] == 989.4 and m["mfu_datasheet"] == pytest.approx(309.67 / 989.4, rel=1e-4)
    assert flops.datasheet_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert flops.mfu(1.0, 1.0, None, "cpu")["mfu_datasheet"] is None


@pytest.mark.standard_promotion(reason="Flax bf16 LayerNorm: float32 statistics x bfloat16")
def test_native_baseline_is_the_same_module_with_flax_bf16():
    import jax
    import jax.numpy as jnp

    from experiments.models import get_model

    module = get_model("resnet50", 10, stage_sizes=(1, 1), width=4)
    x = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)
    native = NativeModel(module, jnp.bfloat16)
    # Abstract shapes only: compiling Flax's init takes seconds on a loaded CPU.
    v = jax.eval_shape(lambda k, x: native.init(k, x, train=False), jax.random.PRNGKey(0), x)
    ref = jax.eval_shape(lambda k, x: module.init(k, x, train=False), jax.random.PRNGKey(0), x)
    assert jax.tree_util.tree_structure(v) == jax.tree_util.tree_structure(ref)
    assert {p.dtype for p in jax.tree_util.tree_leaves(v)} == {jnp.dtype(jnp.float32)}
    jaxpr = jax.make_jaxpr(lambda v, x: native.apply(v, x, train=False))(v, x).jaxpr
    convs = [e for e in _jaxpr.equations(jaxpr) if e.primitive.name in ("conv_general_dilated", "dot_general")]
    assert len(convs) == 10  # stem, 2 bottlenecks x (3 convs + projection), head
    assert all(a.aval.dtype == jnp.bfloat16 for e in convs for a in e.invars)
    assert jax.eval_shape(lambda v, x: native.apply(v, x, train=False), v, x).dtype == jnp.bfloat16
    assert jax.eval_shape(lambda v, x: module.apply(v, x, train=False), ref, x).dtype == jnp.float32
    import flax.linen as nn

    assert nn.Dense.dtype is None  # the substitution ends with the call


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_profile_writes_a_top_kernel_table(tmp_path):
    result = kernel_profile.main(["--dry-run", "--quiet", "--models", "transformer", "--policies", "O1",
                                  "--profile-top", "5", "--out", str(tmp_path / "tp.json")])
    (e,) = result["results"]["runs"]
    assert e["status"] == "ok", e.get("error")
    page = (ROOT / e["profile"]["path"]).read_text()
    assert "| # | kernel / thunk | HLO op | calls | total (ms) | share |" in page
    rows = [line for line in page.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert 1 <= len(rows) <= 5 and e["profile"]["top"][0]["total_us"] > 0


def test_kernel_time_by_thread_sums_xla_events_per_pool(tmp_path):
    import gzip

    from benchmarks import _profile

    meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}}
            for t, n in ((10, "tf_XLAEigen/123"), (11, "tf_XLAEigen/-456"), (20, "tf_XLAPjRtCpuClient/7"),
                         (30, "python"))]
    x = lambda tid, name, dur, op=True: {"ph": "X", "pid": 1, "tid": tid, "name": name, "dur": dur,  # noqa: E731
                                          "args": {"hlo_op": name} if op else {}}
    events = meta + [x(10, "dot", 300.0), x(11, "dot.1", 200.0), x(20, "fusion", 50.0), x(30, "copy", 5.0),
                     x(20, "ThunkExecutor::Execute", 999.0, op=False),  # runtime, not a kernel
                     x(99, "fusion.2", 7.0)]  # a thread without a name is reported by id
    events.append(dict(x(10, "end: dot", 1000.0), ph="X"))  # the profiler's end marker is not a kernel
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert _profile.kernel_time_by_thread(path) == {"tf_XLAEigen": 500.0, "tf_XLAPjRtCpuClient": 50.0,
                                                    "tid 99": 7.0, "python": 5.0}


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_overhead_thread_profile_and_the_probe_variant(tmp_path):
    out = tmp_path / "overhead.json"
    overhead.main(["--dry-run", "--quiet", "--variants", "bare,hand-skip,jaxmp,jaxmp-noop,jaxmp-noop-probe",
                   "--thread-profile",
                   "--out", str(out)])
    r = json.loads(out.read_text())["results"]
    assert set(r["kernel_us_per_step_by_thread"]) == {"bare", "hand-skip", "jaxmp", "jaxmp-noop",
                                                             "jaxmp-noop-probe"}
    for pools in r["kernel_us_per_step_by_thread"].values():
        assert sum(pools.values()) > 0
    assert r["skipped_steps"]["jaxmp-noop-probe"] == 0
    with pytest.raises(SystemExit):
        overhead.main(["--dry-run", "--variants", "bare,jaxmp,jaxmp-noop-probes", "--out", "-"])


@pytest.mark.slow  # default-tier time: the slow tier runs it
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_the_hand_skip_control_steps_as_the_floor_and_keeps_a_non_finite_step():
    import jax
    import jax.numpy as jnp

    cfg = dict(overhead.DRY, n_batches=2, policy="O0", donate=False, variants=["floor", "hand-skip"])
    steps, inits, batches, _ = overhead.make_variants(cfg)
    (p_floor, o_floor), _ = steps["floor"](inits["floor"](), batches[0])
    (p_hand, o_hand), _ = steps["hand-skip"](inits["hand-skip"](), batches[0])
    for a, b in zip(jax.tree_util.tree_leaves((p_floor, o_floor)), jax.tree_util.tree_leaves((p_hand, o_hand))):
        assert jnp.array_equal(a, b)
    start = inits["hand-skip"]()
    x, y = batches[0]
    (p_nan, o_nan), _ = steps["hand-skip"](start, (x.at[0, 0].set(jnp.nan), y))
    for a, b in zip(jax.tree_util.tree_leaves((p_nan, o_nan)), jax.tree_util.tree_leaves(start)):
        assert jnp.array_equal(a, b)


@pytest.mark.slow  # two whole train steps compiled, ~5 s
@pytest.mark.standard_promotion(reason="optax.adamw's bias correction: Python float ** int32 count")
def test_the_o2_fp16_step_moves_at_most_1_3x_the_bytes_of_its_hand_written_floor():
    # The O2-fp16 pair on the dry-run model: float16 params, a dynamic loss scale, AdamW on float32
    # masters, by hand under lax.cond and through jaxmp's step builder, whose check of the update
    # (a master past float16's range makes an inf param) is its cost over the floor. XLA's bytes
    # accessed and memory figures are deterministic for a given program.
    cfg = dict(overhead.DRY, n_batches=1, policy="O0", donate=True, skip_with="auto",
               variants=["hand-masters-fp16", "jaxmp-o2-fp16"])
    steps, inits, batches, _ = overhead.make_variants(cfg)
    stats = {n: overhead.compiled_stats(f, inits[n](), batches[0]) for n, f in steps.items()}
    ratio = overhead._o2_ratios(stats)["jaxmp-o2-fp16"]
    assert ratio["bytes_accessed"] <= 1.3, ratio
    # Checked before the skip, the update keeps no second optimizer state alive: no more
    # temporaries or peak than the floor (checked after it, with a select: 1.006x and 1.003x).
    assert ratio["temp_bytes"] <= 1.0 and ratio["peak_bytes"] <= 1.0, ratio


# ----------------------------------------------------------------------------------------------
# Command lines: --help lists the flags; an unknown flag is named, without a traceback.

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def _script_main(name):
    return importlib.import_module(f"benchmarks.{name}").main


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_answers_help_and_names_an_unknown_flag(name, capsys):
    main = _script_main(name)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--" in out.split("options:")[-1]
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and "Traceback" not in err


def test_no_benchmark_module_edits_sys_path():
    """The scripts are modules of the ``benchmarks`` package, run as ``python -m benchmarks.<name>``
    from the repository root: none of them (helpers included) puts anything on ``sys.path``."""
    import ast

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
                pytest.fail(f"benchmarks/{path.name}:{node.lineno} uses sys.path; run it as `python -m "
                            f"benchmarks.{path.stem}` instead")


_RUN_AS_MAIN = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for name in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [name, "--help"]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code or 0
        except BaseException:
            code, err = 1, io.StringIO(err.getvalue() + traceback.format_exc())
    results[name] = [code, out.getvalue(), err.getvalue()[-2000:]]
print(json.dumps(results))
"""


def test_every_script_runs_as_a_module_in_a_fresh_process():
    """``benchmarks.<name> --help`` run as ``__main__`` the way ``python -m`` runs it (``runpy``, with
    ``sys.argv`` and ``sys.modules['__main__']`` set) in a fresh process from the repository root:
    usage on stdout, exit 0. One process runs every script in turn: a process per script paid
    JAX's import once per script (~15 s in all); test_unknown_flag_in_a_fresh_process_has_no_traceback
    keeps real ``python -m`` command lines."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _RUN_AS_MAIN, *SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(results) == sorted(SCRIPTS)
    for name, (code, out, err) in results.items():
        assert code == 0 and out.startswith("usage:"), (name, err)


def test_docs_show_benchmarks_run_as_modules():
    """No page, README or docstring shows ``python benchmarks/<name>.py``, which no longer finds the
    ``benchmarks`` package; recorded results keep the command they were made with."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    pattern = re.compile(r"python[0-9.]* benchmarks/[a-z_0-9]+\.py")
    found = [f"{f}: {m.group(0)}" for f in files if not f.startswith("benchmarks/results/")
             for m in pattern.finditer((ROOT / f).read_text())]
    assert found == [], found


def test_unknown_flag_in_a_fresh_process_has_no_traceback():
    import subprocess

    for name in ("overhead", "run_gpu"):
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--no-such-flag"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "--no-such-flag" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# benchmarks/autocast.py


@pytest.mark.slow
def test_autocast_benchmark_dry_run(tmp_path):
    from benchmarks import autocast as ac

    out = tmp_path / "autocast.json"
    result = ac.main(["--dry-run", "--quiet", "--models", "mlp", "--variants", "float32,hand,jaxmp,mpx",
                      "--out", str(out)])
    _assert_valid(json.loads(out.read_text()), "autocast")
    r = result["results"]["models"]["mlp"]
    found = set(r["variants"]) | set(r["skipped"])
    assert found == {"float32", "hand", "jaxmp", "mpx"}
    if "mpx" in r["skipped"]:
        assert "mpx" in r["skipped"]["mpx"]  # says which peer and why
    f32, hand, amp = r["variants"]["float32"], r["variants"]["hand"], r["variants"]["jaxmp"]
    assert f32["loss_rel_error"] == 0 and f32["hlo_converts"] == 0 and f32["grad_dtypes"] == ["float32"]
    assert 0 < hand["loss_rel_error"] < 1e-2 and 0 < hand["grad_rel_error"] < 0.1 and hand["hlo_converts"] > 0
    assert hand["grad_dtypes"] == amp["grad_dtypes"] == ["float32"]
    # The hand cast writes out the narrow rule (a bias add in half); O1 keeps a float32 value
    # float32 where it feeds a float32-list op or the output, so its loss differs in the last
    # bf16 bits only (4e-5 relative, measured) and is never further from float32's than 1e-2.
    assert amp["loss"] == pytest.approx(hand["loss"], rel=1e-3)
    assert amp["loss_rel_error"] < 1e-2
    assert hand["step_vs_hand"]["median"] == 1.0 and amp["step_vs_hand"]["n"] == 2
    assert f32["tlc_vs_float32"] == 1.0 and amp["trace_lower_compile_s"] >= amp["trace_s"] > 0
    md = "\n".join(report.autocast_tables({"autocast": [("a.json", result)]}))
    assert "| jaxmp |" in md and "jaxmp.autocast targets: step / hand" in md


def test_hand_cast_mlp_assigns_the_o1_dtypes():
    import jax
    import jax.numpy as jnp

    from benchmarks import _autocast_models as am

    m = am.make_mlp(0, 2, 8, 2, 4, 3)
    jaxpr = jax.make_jaxpr(lambda p, x, y: m.hand_loss(p, x, y, jnp.bfloat16))(m.params, *m.batch).jaxpr
    dtypes = {}
    for e in _jaxpr.equations(jaxpr):
        dtypes.setdefault(e.primitive.name, set()).add(str(e.outvars[0].aval.dtype))
    assert dtypes["dot_general"] == {"bfloat16"}
    for op in ("reduce_sum", "reduce_max", "exp", "log", "rsqrt"):
        assert dtypes[op] == {"float32"}, op
    assert jax.eval_shape(lambda p, x, y: m.hand_loss(p, x, y, jnp.bfloat16), m.params, *m.batch).dtype == jnp.float32


# ----------------------------------------------------------------------------------------------
# benchmarks/fp8.py


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_fp8_benchmark_dry_run_times_every_variant_updates_the_fp8_state_and_compares_loss_curves(tmp_path):
    from benchmarks import fp8 as bench

    out = tmp_path / "fp8.json"
    steps = 6
    result = bench.main(["--dry-run", "--quiet", "--models", "mlp", "--train-steps", str(steps), "--out", str(out)])
    on_disk = json.loads(out.read_text())
    _assert_valid(on_disk, "fp8")
    assert on_disk["env"]["versions"]["jax"] and on_disk["env"]["device"] and on_disk["env"]["git_commit"]["sha"]
    r = result["results"]["models"]["mlp"]
    assert list(r["variants"]) == list(bench.VARIANTS) and r["skipped"] == {}  # the CPU emulates fp8
    assert set(bench.BLOCK_VARIANTS) < set(bench.VARIANTS)
    assert not any("emulated" in x for x in r["variants"].values())  # on a CPU emulation is the default
    assert {v: x["policy"] for v, x in r["variants"].items()} == bench.POLICIES
    curves = {v: x["loss_curve"] for v, x in r["variants"].items()}
    for v, c in curves.items():
        # Finite, and it trains: the loss on batch 0 (4 batches are cycled) went down by step 4.
        assert len(c) == steps and all(np.isfinite(c)) and c[4] < c[0], v
        assert r["variants"][v]["skipped_steps"] == 0
        assert r["variants"][v]["step_time_s"]["n"] == 2
    for v in bench.BLOCK_VARIANTS:
        assert curves[v] != curves["bf16"], v  # the block formats quantize too
    for v in ("fp8", "fp8-current"):
        assert curves[v] != curves["bf16"], v  # fp8 rounding changes the numbers ...
        assert 0 < r["variants"][v]["max_rel_loss_gap_last_half"] < 0.05, v  # ... but not the curve
        assert r["variants"][v]["speedup_over_bf16"]["n"] == 2
    # Delayed scaling: make_train_step recorded one amax per step in every history of the two
    # Dense layers (3 tensors each) and moved every scale off its initial 1; current scaling has no state.
    state = r["variants"]["fp8"]["fp8_state"]
    assert (state["layers"], state["tensors"], state["history_length"]) == (2, 6, 1024)
    assert state["amaxes_recorded_min"] == state["amaxes_recorded_max"] == steps
    assert state["all_finite"] and state["scale_min"] > 1
    assert r["variants"]["bf16"]["fp8_state"] is None and r["variants"]["fp8-current"]["fp8_state"] is None
    # The yardstick for "within noise": bf16 from another init, on the same batches.
    ref = r["noise_reference"]
    assert len(ref["loss_curve"]) == steps and ref["loss_curve"] != curves["bf16"]
    assert all(x["within_noise"] == (x["max_rel_loss_gap_last_half"] <= ref["max_rel_loss_gap_last_half"])
               for v, x in r["variants"].items() if v != "bf16")
    assert result["config"]["native_fp8"] is False and result["dry_run"] is True



def test_the_linen_transformer_block_is_written_once():
    """experiments' EncoderBlock is the one Linen Transformer block: benchmarks/fp8.py's encoder and
    benchmarks/_lm.py's causal LM build theirs from it, under their own module names (the names seed
    the initialisers), and no other benchmark or experiment writes attention into a block itself."""
    import jax
    import jax.numpy as jnp

    from benchmarks import _lm, fp8 as bench
    from experiments.models.transformer import EncoderBlock

    module, batch = bench.make_model("transformer", bench.DRY_SIZES["transformer"])
    x, _ = batch(jax.random.key(0))
    params = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    assert set(params) == {"block_0"} and set(params["block_0"]) == {"ln1", "attention", "ln2", "up", "down"}
    lm = jax.eval_shape(_lm.CausalLM(context=8, num_layers=2).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert {"Block_0", "Block_1"} <= set(lm["params"])
    assert set(lm["params"]["Block_0"]) == {"LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1",
                                            "Dense_0", "Dense_1"}
    # The names reach the same block: one it builds by itself gives the same params at the same names.
    named = EncoderBlock(2, 64, names=bench._BLOCK_NAMES)
    assert set(jax.eval_shape(named.init, jax.random.key(0), x)["params"]) == set(params["block_0"])
    writers = [str(p.relative_to(ROOT)) for tree in ("benchmarks", "experiments") for p in sorted((ROOT / tree).rglob("*.py"))
               if "MultiHeadDotProductAttention(" in p.read_text() and "_vendored" not in p.parts]  # google/flax's own
    assert writers == ["experiments/models/transformer.py"], writers

@pytest.mark.slow
def test_fp8_benchmark_records_fp8_variants_as_skipped_where_the_hardware_check_refuses(monkeypatch):
    import jaxmp.fp8
    from benchmarks import fp8 as bench
    from jaxmp.fp8 import _hardware

    def refuse(recipe, device=None):  # what jaxmp.fp8.check_hardware says on an A100
        raise ValueError("NVIDIA A100 (compute capability 8.0) has no fp8 Tensor Cores")

    # The doors check through _hardware.check_for_run, the benchmark through jaxmp.fp8.check_hardware.
    monkeypatch.setattr(jaxmp.fp8, "check_hardware", refuse)
    monkeypatch.setattr(_hardware, "check_hardware", refuse)
    result = bench.main(["--dry-run", "--quiet", "--models", "mlp", "--variants", "fp8,fp8-current", "--out", "-"])
    _assert_valid(result, "fp8")
    r = result["results"]["models"]["mlp"]
    assert r["variants"] == {} and set(r["skipped"]) == {"fp8", "fp8-current"}
    assert all("no fp8 Tensor Cores" in why for why in r["skipped"].values())


# ----------------------------------------------------------------------------------------------
# Dry runs of the entry points the sections above do not run (every benchmarks/*.py main is run
# once with --dry-run somewhere: see test_every_script_has_a_dry_run_test).


_NATIVE_BF16 = "the native baseline: Flax modules with dtype=bfloat16 mix float32 statistics and bfloat16"


@pytest.mark.slow  # a script's end-to-end dry run: six programs compiled and timed (~10 s of the default tier)
@pytest.mark.standard_promotion(reason=_NATIVE_BF16)
def test_promotion_dry_run_measures_every_rule(tmp_path):
    _promotion_dry_run(tmp_path, ["--models", "mlp"], {"mlp"})


@pytest.mark.slow  # 24 compilations: ~70 s on a busy 2-core machine
@pytest.mark.standard_promotion(reason=_NATIVE_BF16)
def test_promotion_dry_run_on_every_model(tmp_path):
    # mlp: test_promotion_dry_run_measures_every_rule (above); the other three models here
    _promotion_dry_run(tmp_path, ["--models", "transformer,resnet,plain-transformer"],
                       {"transformer", "resnet", "plain-transformer-1"})


def _promotion_dry_run(tmp_path, flags, names):
    from benchmarks import promotion

    out = tmp_path / "promotion.json"
    rows = promotion.main(["--dry-run", *flags, "--out", str(out)])
    rules = {"float32", "O1 narrow", "O1 demand", "O1 widest", "O2 narrow"}
    assert set(rows) == names
    for name, row in rows.items():
        assert rules <= set(row) and ("native" in row) == (name != "plain-transformer-1"), (name, row)
        assert all(v["MiB"] > 0 and v["peak MiB"] > 0 and v["ms"] > 0 for v in row.values()), (name, row)
    # Half precision converts: O1 inserts casts that the float32 program does not have.
    assert all(row["O1 demand"]["converts"] > row["float32"]["converts"] for row in rows.values())
    written = json.loads(out.read_text())
    assert written["dry_run"] is True and written["models"] == json.loads(json.dumps(rows))
    assert written["env"]["versions"]["jax"] and written["commit"]["sha"]


def test_trace_profile_dry_run(tmp_path):
    from benchmarks import trace_profile

    out = tmp_path / "trace.json"
    results = trace_profile.main(["--dry-run", "--models", "mlp", "--out", str(out)])
    r = results["mlp"]
    assert r["jaxmp"]["first_order_equations"] > 0 and r["hand"]["profiled_trace_s"] > 0
    assert 0 < r["engine_share_of_jaxmp_trace"] <= 1
    assert json.loads(out.read_text())["dry_run"] is True


def test_flops_dry_run_counts_every_tiny_model():
    rows = flops.main(["--dry-run"])
    assert rows and all(r["per_step"] > r["forward"] > 0 for r in rows), rows


@pytest.mark.slow  # one fresh process per measurement: ~20 s each on a busy 2-core machine
def test_debugger_dry_run_times_the_step_and_a_tool(tmp_path):
    from benchmarks import debugger

    out = tmp_path / "debugger.json"
    results = debugger.main(["--dry-run", "--models", "cnn", "--tools", "locate", "--out", str(out)])
    row = results["cnn"]
    assert row["cold_step_s"] > 0 and row["warm_step_s"] > 0, row
    assert row["locate"]["seconds"] > 0 and row["locate"]["alarm"] is False, row
    assert json.loads(out.read_text())["dry_run"] is True


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_efficiency_dry_run_writes_valid_json(tmp_path):
    from benchmarks import efficiency

    out = tmp_path / "efficiency.json"
    efficiency.main(["--dry-run", "--quiet", "--models", "mlp", "--out", str(out)])
    _assert_valid(json.loads(out.read_text()), "efficiency")


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adamw's bias correction: Python float ** int32 count")
def test_fp8_blocks_dry_run_trains_each_policy_and_compares_with_bf16(tmp_path):
    from benchmarks import fp8_blocks

    out = tmp_path / "fp8_blocks.json"
    result = fp8_blocks.main(["--dry-run", "--quiet", "--seeds", "0", "--policies", "O2-mxfp8", "--out", str(out)])
    _assert_valid(json.loads(out.read_text()), "fp8_blocks")
    summary = result["results"]["summary"]
    assert set(summary) == {"O2-bf16", "O2-mxfp8", "bf16_accuracy_spread"}  # bf16 always runs: the reference
    assert summary["O2-bf16"]["time_vs_bf16"] == 1.0 and summary["O2-mxfp8"]["time_vs_bf16"] > 0


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adamw's bias correction: Python float ** int32 count")
def test_fp8_blocks_lm_dry_run_judges_the_loss_and_runs_the_nvfp4_variants(tmp_path):
    from benchmarks import fp8_blocks

    out = tmp_path / "fp8_blocks_lm.json"
    result = fp8_blocks.main(["--dry-run", "--quiet", "--model", "lm", "--seeds", "0", "--policies", "O2-nvfp4",
                              "O2-nvfp4-plain", "O2-nvfp4-head-f32", "--out", str(out)])
    _assert_valid(json.loads(out.read_text()), "fp8_blocks")
    summary = result["results"]["summary"]
    assert set(summary) == {"O2-bf16", "O2-nvfp4", "O2-nvfp4-plain", "O2-nvfp4-head-f32", "bf16_loss_spread"}
    losses = {p: summary[p]["eval_loss_mean"] for p in ("O2-bf16", "O2-nvfp4", "O2-nvfp4-plain", "O2-nvfp4-head-f32")}
    assert len(set(losses.values())) == 4, losses  # four different programs, the same seed and batches
    with pytest.raises(SystemExit):  # the extra variants are the LM study's
        fp8_blocks.main(["--dry-run", "--quiet", "--policies", "O2-nvfp4-plain", "--out", "-"])


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_search_strategies_dry_run_runs_both_searches():
    from benchmarks import search_strategies

    result = search_strategies.main(["--dry-run", "--out", "-"])["mlp"]
    for strategy in ("greedy", "program"):
        assert result[strategy]["within_band"] and result[strategy]["rungs"]["head"] == "float32"
    # the program: reference, twin, the all-float32 floor, 3 modules alone, its choice; 2 steps each
    assert result["program"]["cost_steps"] == 2 * 7
    # the verified search: judged by float32's 3-seed spread, its rules within it
    assert result["verified"]["within_band"] and not result["verified"]["gave_up"]


#: Where each entry point's dry run (or, for scripts without a model to shrink, its plain run) is
#: tested: a script added without one fails here.
DRY_RUN_TESTS = {
    "autocast": "tests/benchmarks/test_benchmarks.py::test_autocast_benchmark_dry_run",
    "compile_growth": "tests/benchmarks/test_compile_growth.py::test_compile_growth_dry_run_the_flax_doors_hand_xla_autocasts_program",
    "debugger": "tests/benchmarks/test_benchmarks.py::test_debugger_dry_run_times_the_step_and_a_tool",
    "efficiency": "tests/benchmarks/test_benchmarks.py::test_efficiency_dry_run_writes_valid_json",
    "fidelity": "tests/benchmarks/test_fidelity.py::fidelity.main([\"--dry-run\"",
    "flops": "tests/benchmarks/test_benchmarks.py::test_flops_dry_run_counts_every_tiny_model",
    "fp8": "tests/benchmarks/test_benchmarks.py::test_fp8_benchmark_dry_run_times_every_variant",
    "fp8_blocks": "tests/benchmarks/test_benchmarks.py::test_fp8_blocks_dry_run_trains_each_policy_and_compares_with_bf16",
    "kernel_profile": "tests/benchmarks/test_benchmarks.py::test_profile_writes_a_top_kernel_table",
    "memory": "tests/parallel/test_layouts.py::memory.main([\"--dry-run\"",
    "overhead": "tests/benchmarks/test_benchmarks.py::test_overhead_dry_run_writes_valid_json",
    "precision_search": "tests/benchmarks/test_precision_search.py::test_quick_run_on_the_vae_reports_every_variant_and_reproduces",
    "promotion": "tests/benchmarks/test_benchmarks.py::test_promotion_dry_run_measures_every_rule",
    "report": "tests/benchmarks/test_benchmarks.py::report.main([\"--check\"])",
    "residual_fusion_repro": "tests/benchmarks/test_compile_growth.py::test_residual_fusion_repro_dry_run",
    "run_gpu": "tests/benchmarks/test_benchmarks.py::run_gpu.main([\"--dry-run\"",
    "scaling_model": "tests/docs/test_docs.py::module[\"main\"]([])",
    "search_strategies": "tests/benchmarks/test_benchmarks.py::test_search_strategies_dry_run_runs_both_searches",
    "throughput": "tests/benchmarks/test_benchmarks.py::test_throughput_part_of_the_suite",
    "torch_amp": "tests/benchmarks/test_benchmarks.py::torch_amp.main([\"--dry-run\"",
    "trace_profile": "tests/benchmarks/test_benchmarks.py::test_trace_profile_dry_run",
    "wire": "tests/benchmarks/test_wire_bytes.py::wire.main([\"--quick\"",
    "wire_fidelity": "tests/benchmarks/test_wire_bytes.py::wire_fidelity.main([\"--study\", \"--quick\"",
}


def test_every_script_has_a_dry_run_test():
    assert set(DRY_RUN_TESTS) == set(SCRIPTS), "add the new script's dry-run test to DRY_RUN_TESTS"
    for name, where in DRY_RUN_TESTS.items():
        path, needle = where.split("::")
        needle = f"def {needle}" if needle.startswith("test_") else needle
        assert needle in (ROOT / path).read_text(), (name, where)
