"""Bad input to the experiments, table-driven: every case ends in one clear error that names the
problem and what is valid -- never a raw traceback, never silent acceptance.

Config values are checked in-process (the same check runs while the command line is parsed);
the command lines are run as subprocesses, concurrently; checkpoint folders are damaged copies
of one short run.
"""

import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from experiments import checkpoint as ckpt_lib
from experiments import configs as configs_lib
from experiments.validation import UserError, validate_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (field, value, words the message must contain)
CONFIG_CASES = [
    ("checkpoint_every_steps", 0, ["checkpoint_every_steps", ">= 1"]),
    ("log_every_steps", 0, ["log_every_steps", ">= 1"]),
    ("eval_every_steps", -5, ["eval_every_steps", ">= 1"]),
    ("keep_checkpoints", 0, ["keep_checkpoints", ">= 1"]),
    ("max_consecutive_skips", -1, ["max_consecutive_skips", ">= 0"]),
    ("base_learning_rate", -0.1, ["base_learning_rate", "> 0"]),
    ("learning_rate", -1.0, ["learning_rate", "> 0"]),
    ("learning_rate", math.nan, ["learning_rate", "finite"]),
    ("warmup_epochs", -1.0, ["warmup_epochs", ">= 0"]),
    ("weight_decay", -1e-4, ["weight_decay", ">= 0"]),
    ("label_smoothing", 2.0, ["label_smoothing", "[0, 1)"]),
    ("label_smoothing", 1.0, ["label_smoothing", "[0, 1)"]),
    ("grad_clip_norm", math.nan, ["grad_clip_norm", "finite"]),
    ("per_device_batch_size", 0, ["per_device_batch_size", ">= 1"]),
    ("seed", -1, ["seed", "[0, 2**31 - 1)"]),
    ("num_seeds", 0, ["num_seeds", ">= 1"]),
    ("momentum", 1.5, ["momentum", "[0, 1)"]),
    ("engine", "torch", ["engine", "flax", "autocast"]),
    ("optimizer", "adam", ["optimizer", "adamw, sgd"]),
    ("lr_schedule", "step", ["lr_schedule", "cosine"]),
    ("policy", "O4", ["O4", "policy"]),
    ("loss_scale", "dynamc", ["loss_scale", "dynamic"]),
    ("model", "vgg", ["model", "cnn1d"]),
    ("dataset", "imagenet", ["dataset", "mnist1d"]),
    ("num_devices", 99, ["99 devices", "num_devices"]),
    ("dynamic_scale_init", 1e39, ["dynamic_scale_init", "2**24"]),
    ("eval_batch_size", 0, ["eval_batch_size", ">= 1"]),
    ("num_train_steps", 1.5, ["num_train_steps", "integer"]),
    ("num_epochs", math.inf, ["num_epochs", "finite"]),
    ("mnist1d_num_samples", 0, ["mnist1d_num_samples", ">= 10"]),
]


@pytest.mark.parametrize("field,value,words", CONFIG_CASES, ids=[f"{c[0]}={c[1]}" for c in CONFIG_CASES])
def test_bad_config_value_is_a_clear_user_error(field, value, words):
    c = configs_lib.get_config("cpu")
    with c.ignore_type():
        c[field] = value
    with pytest.raises(UserError) as e:
        validate_config(c)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_combinations():
    c = configs_lib.get_config("cpu")
    c.num_epochs, c.num_train_steps = 0.0, -1
    with pytest.raises(UserError, match="nothing to train"):
        validate_config(c, num_train_examples=1000)
    c = configs_lib.get_config("cpu")
    c.dynamic_scale_init = 2.0**20  # needs a dynamic scale; O0's is "none"
    with pytest.raises(UserError, match=r"dynamic_scale_init.*loss_scale=dynamic"):
        validate_config(c)
    c = configs_lib.get_config("tpu_v3_8")
    c.global_batch_size = 100
    with pytest.raises(UserError, match="global batch 100 does not divide over 8 devices"):
        validate_config(c)
    with pytest.raises(UserError, match=r"seed -3 is invalid"):
        validate_config(configs_lib.get_config("cpu"), seed=-3)


MODEL_KWARGS_CASES = [
    # (field, value, words): issue 37, item 16 -- these failed inside the model (ZeroDivisionError, a JAX shape error)
    ("features", ("abc",), ["model_kwargs.features=('abc',)", "tuple of integers >= 1"]),
    ("features", (0,), ["model_kwargs.features=(0,)", "tuple of integers >= 1"]),
    ("features", (), ["model_kwargs.features=()", "non-empty"]),
    ("use_batchnorm", "yes", ["model_kwargs.use_batchnorm='yes'", "switches True or False"]),
    ("dropout_rate", 1.5, ["model_kwargs.dropout_rate=1.5", "[0, 1)"]),
    ("width", 0, ["model_kwargs.width=0", "integers >= 1"]),
]


@pytest.mark.parametrize("field,value,words", MODEL_KWARGS_CASES, ids=[f"{c[0]}={c[1]}" for c in MODEL_KWARGS_CASES])
def test_bad_model_attribute_is_a_clear_user_error(field, value, words):
    c = configs_lib.get_config("cpu")
    with c.ignore_type():
        c.model_kwargs[field] = value
    with pytest.raises(UserError) as e:
        validate_config(c)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("over", [{"per_device_batch_size": 100000}, {"mnist1d_num_samples": 10}])
def test_a_batch_larger_than_the_training_set_is_a_clear_user_error(over):
    # Issue 37, item 16: a ValueError from the data source, after JAX and the data had loaded.
    c = configs_lib.get_config("cpu")
    c.update(over)
    n_train = int(c.mnist1d_num_samples * 0.8)
    with pytest.raises(UserError, match=rf"global batch {c.per_device_batch_size} .* larger than the {n_train} "
                                        r"training examples of mnist1d: lower --config.per_device_batch_size"):
        validate_config(c, num_train_examples=n_train)


def test_a_config_file_whose_get_config_returns_no_config_dict_exits_2(tmp_path, capsys):
    from experiments import cli

    path = tmp_path / "int_config.py"
    path.write_text("def get_config():\n    return 3\n")
    with pytest.raises(SystemExit) as e:
        cli._load_config_file(str(path))
    assert e.value.code == 2
    assert "get_config() returned int 3, not an ml_collections.ConfigDict" in capsys.readouterr().err


# ---- the command lines: (argv, words the one-line error must contain) ----


def _cli_cases(tmp):
    bad_cfg = os.path.join(tmp, "broken_config.py")
    with open(bad_cfg, "w") as f:
        f.write("def get_config(:\n    pass\n")
    a_file = os.path.join(tmp, "a_file")
    open(a_file, "w").close()
    not_json = os.path.join(tmp, "job.json")
    with open(not_json, "w") as f:
        f.write("\x80\x04\x95 pickled bytes")
    wd = f"--workdir={tmp}/wd"
    main = ["-m", "experiments.main", "--config=cpu"]
    return [
        (main + [wd, "--bogus_flag=1"], ["bogus_flag"]),
        (["-m", "experiments.main", "--config=gpu_k80", wd], ["unknown config", "gpu_t4"]),
        (main + ["--config.learning_rat=0.1", wd], ["learning_rat", "base_learning_rate"]),
        (["-m", "experiments.main", f"--config={bad_cfg}", wd], ["could not be loaded", "line 1", "SyntaxError"]),
        (main + [f"--workdir={a_file}"], ["--workdir", "is a file"]),
        (main + ["--workdir=/proc/jaxmp_no_such_dir"], ["--workdir", "cannot be created"]),
        (main + ["--config.seed=abc", wd], ["seed", "abc"]),
        (main + ["--config.per_device_batch_size=0", wd], ["per_device_batch_size", ">= 1"]),
        (main + ["--config.checkpoint_every_steps=0", wd], ["checkpoint_every_steps", ">= 1"]),
        (main + ["--config.label_smoothing=2", wd], ["label_smoothing", "[0, 1)"]),
        (main + [wd, "extra_positional"], ["unexpected arguments", "extra_positional"]),
        (["-m", "experiments.main", wd], ["--config is required"]),
        (["-m", "experiments.compare", "--config=cpu", wd, "--seeds=0"], ["seeds", "positive integer"]),
        (["-m", "experiments.compare", "--config=cpu", wd, "--isolate=maybe"], ["isolate", "auto"]),
        (["-m", "experiments.compare", "--config=cpu", wd, "--config.policy=O9"], ["--config.policy", "--policies"]),
        (["-m", "experiments.compare", "--config=cpu", wd, "--policies="], ["--policies is empty"]),
        (["-m", "experiments.train", f"--job={tmp}/missing.json"], ["--job", "cannot read"]),
        (["-m", "experiments.train", f"--job={not_json}"], ["--job", "not a JSON job file"]),
        (["-m", "experiments.fault_drill", "--only=bogus"], ["--only", "bogus", "overflow"]),
        (["-m", "experiments.precision_reports", "--batch_size=0"], ["batch_size", "positive integer"]),
    ]


def _issue_37_cli_cases(tmp):
    int_cfg = os.path.join(tmp, "int_config.py")
    with open(int_cfg, "w") as f:
        f.write("def get_config():\n    return 3\n")
    main = ["-m", "experiments.main", "--config=cpu", f"--workdir={tmp}/wd37"]
    return [
        (["-m", "experiments.main", f"--config={int_cfg}", f"--workdir={tmp}/wd37"], ["returned int 3"]),
        (main + ["--config.model_kwargs.features=abc"], ["model_kwargs.features", "integers >= 1"]),
        (main + ["--config.model_kwargs.features=(0,)"], ["model_kwargs.features=(0,)", "integers >= 1"]),
        (main + ["--config.per_device_batch_size=100000"], ["global batch 100000", "16000 training examples"]),
        (main + ["--config.mnist1d_num_samples=10"], ["8 training examples", "mnist1d_num_samples"]),
    ]


@pytest.mark.slow
def test_issue_37_command_lines_exit_2_with_one_message(tmp_path):
    # Each was a traceback and exit 1; the model and data cases fail only after JAX has started.
    cases = _issue_37_cli_cases(str(tmp_path))

    def run(args):
        return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(run, [a for a, _ in cases]))
    for (args, words), out in zip(cases, outs):
        assert out.returncode == 2, (args, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and out.stderr.count("error:") == 1, (args, out.stderr[-2000:])
        for w in words:
            assert w in out.stderr, (args, w, out.stderr[-800:])


@pytest.mark.slow
def test_command_line_bad_input_is_one_clear_line(tmp_path):
    cases = _cli_cases(str(tmp_path))

    def run(args):
        return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(run, [a for a, _ in cases]))
    for (args, words), out in zip(cases, outs):
        text = out.stdout + out.stderr
        assert out.returncode not in (0, None), (args, text[-500:])
        assert "Traceback" not in text, (args, text[-2000:])
        for w in words:
            assert w in text, (args, w, text[-800:])


# ---- checkpoint folders ----


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from experiments import drills, train

    wd = str(tmp_path_factory.mktemp("ckpt") / "run")
    train.train_and_evaluate(drills._damage_config(num_train_steps=20), wd)
    return wd


def _edit_json(path, fn):
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump(fn(data), f)


FOLDER_CASES = {
    # name: (damage(workdir), words of the error or warning)
    "metadata replaced by a list": (lambda wd: _edit_json(f"{wd}/checkpoints/20/meta/metadata", lambda m: [m]),
                                    ["step 20", "metadata"]),
    "manifest checksum edited": (lambda wd: _edit_json(f"{wd}/checkpoints/20/manifest/metadata",
                                                       lambda m: {**m, "step": 10}), ["step 20", "manifest"]),
    "history made non-list": (lambda wd: _edit_json(f"{wd}/checkpoints/20/meta/metadata",
                                                    lambda m: {**m, "history": "x"}), ["step 20", "metadata"]),
    "junk file, no step": (lambda wd: [shutil.rmtree(f"{wd}/checkpoints/{s}") for s in ("10", "20")]
                           and open(f"{wd}/checkpoints/notes.txt", "w").close(), ["notes.txt", "no complete"]),
    "results without checkpoints": (lambda wd: shutil.rmtree(f"{wd}/checkpoints"), ["results.json", "refusing"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDER_CASES))
def test_damaged_checkpoint_folder_is_named_never_loaded(name, finished_run, tmp_path):
    import warnings

    from experiments import drills, train

    wd = str(tmp_path / "run")
    shutil.copytree(finished_run, wd)
    damage, words = FOLDER_CASES[name]
    damage(wd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            r = train.train_and_evaluate(drills._damage_config(num_train_steps=20), wd)
            text = " ".join(str(w.message) for w in caught if issubclass(w.category, ckpt_lib.CheckpointDamageWarning))
            assert r["resumed_from"] == 10, r["resumed_from"]  # the damaged newest step was skipped
        except UserError as e:
            text = str(e)
    for w in words:
        assert w in text, (w, text)
