"""Every experiments entry point answers --help with its flags and help text, and rejects an
unknown flag by naming it, without a traceback. --help exits 0 (absl's own exits 1)."""

import concurrent.futures
import os
import subprocess
import pytest
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# module -> flags (with a word of their help) that --help must list
ENTRY_POINTS = {
    "experiments.main": {"--config": "Config file", "--workdir": "checkpoints", "--report": "diagnostics"},
    "experiments.compare": {"--config": "Config file", "--policies": "Policies", "--seeds": "Seeds",
                            "--isolate": "own process", "--scale_demo": "loss scale"},
    "experiments.train": {"--job": "job file"},
    "experiments.precision_reports": {"--batch_size": "examples", "--policies": "recipes", "--models": "models"},
    "experiments.fault_drill": {"--short": "quick", "--kills": "SIGKILL", "--overflows": "overflow",
                                "--only": "Drills"},
}


def _run(args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_help_and_unknown_flag_of_every_entry_point():
    jobs = [[m, "--help"] for m in ENTRY_POINTS] + [[m, "--no_such_flag=3"] for m in ENTRY_POINTS]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(_run, jobs))
    for (module, arg), out in zip(jobs, outs):
        text = out.stdout + out.stderr
        assert "Traceback" not in text, (module, arg, text[-2000:])
        if arg == "--help":
            assert out.returncode == 0, (module, text[-500:])
            for flag, word in ENTRY_POINTS[module].items():
                shown = flag in text or flag.replace("--", "--[no]") in text  # bool flags: --[no]name
                assert shown and word in text, (module, flag, word, text[-3000:])
        else:
            assert out.returncode != 0 and "no_such_flag" in text, (module, text[-500:])


def test_job_files_are_json_and_round_trip(tmp_path):
    from experiments import configs, jobs

    c = configs.get_config("cpu")
    c.policy = "O2-fp16"
    path = str(tmp_path / "job.json")
    jobs.write_job(path, c, workdir="/tmp/w", policy="O1", seed=3, desc="d", report=False)
    text = open(path).read()
    assert text.lstrip().startswith("{")  # data, not a pickle
    job = jobs.read_job(path)
    assert (job["policy"], job["seed"], job["workdir"], job["report"]) == ("O1", 3, "/tmp/w", False)
    back = job["config"]
    assert back.policy == "O2-fp16" and back.learning_rate == c.learning_rate
    assert tuple(back.compare_policies) == tuple(c.compare_policies)


def test_config_taking_commands_list_every_config_field_with_its_default_in_help():
    from experiments import configs

    defaults = configs.get_config("default")
    for module in ("experiments.compare", "experiments.main"):
        out = _run([module, "--help"])
        assert out.returncode == 0, (module, out.stderr[-500:])
        for field in defaults.keys():
            assert f" {field}" in out.stdout, (module, field)
        for shown in ("base_learning_rate = 0.01", "mnist1d_num_samples = 20000", "lr_schedule = 'cosine'",
                      "model_kwargs.features = (32, 32, 32)", "checkpoint_every_steps = 250"):
            assert shown in out.stdout, (module, shown)
    out = _run(["experiments.compare", "--config=cpu_fp8", "--help"])
    assert "defaults of experiments/configs/cpu_fp8.py" in out.stdout and "O2-fp8" in out.stdout
