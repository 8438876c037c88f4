"""Command-line plumbing shared by the entry points.

absl + ml_collections as in the Flax examples, with clear errors instead of tracebacks:
``--config`` takes a path *or* a config name (``cpu``, ``gpu_t4``...); an unknown config, a
config file that does not load, an unknown ``--config.<field>``, a bad value (checked by
`experiments.validation.check_fields` before JAX is imported), a bad ``--workdir``, an
unknown flag, or a user error raised by the run prints one message that says what is wrong
and what is valid, and exits with status 2. A run that fails for another reason it can name (a
full disk: `experiments.validation.RunFailedError`) prints its message and exits with
status 1; so does an unexpected exception (absl prints its traceback). Success is 0.
``--help`` of the config-taking commands lists the flags and every config field with its
default, and exits 0.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags

from experiments import configs as configs_lib
from experiments.validation import FREE_FIELDS, RunFailedError, UserError, check_fields, flat_fields

# TensorFlow (imported by the metric writer and TFDS) logs C++ start-up lines on stderr; silence
# them before it is imported (explicit settings in the environment are kept). See quiet_tensorflow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def quiet_tensorflow(config) -> None:
    """Silences TensorFlow's start-up notices for ``config`` (call before TensorFlow is imported).

    TF_CPP_MIN_LOG_LEVEL=2 hides its INFO/WARNING lines but not the oneDNN notice that TensorFlow
    2.16+ prints unconditionally; that one goes only with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0).
    oneDNN changes TensorFlow's own float kernels, which only the TFDS input pipelines use, so it
    is turned off only for the offline datasets, where TensorFlow just writes TensorBoard events.
    """
    from experiments import data as data_lib

    if config.get("dataset") in data_lib.OFFLINE:
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

__all__ = ["UserError", "define_flags", "parse_flags", "run"]

_CONFIG_RE = re.compile(r"^--config=(.*)$")
_OVERRIDE_RE = re.compile(r"^--config\.([A-Za-z0-9_.]+)(=.*)?$")


def define_flags() -> None:
    """Defines ``--config``, ``--workdir`` and ``--report`` (call once at import of the entry point)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file (experiments/configs/<name>.py) or just its name, e.g. cpu, gpu_t4. "
        "Override any field with --config.<field>=<value>.", lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics (TensorBoard, history.jsonl) and "
                        "results; a run started again with the same workdir resumes.")
    flags.DEFINE_bool("report", False, "Also run jaxmp's diagnostics (precision report of the compiled "
                      "step, gradient statistics, input-pipeline overhead) and write them to the workdir.")
    # --help lists the flags of the main module only: make these the entry point's own.
    for name in ("config", "workdir", "report"):
        flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])


def fail(message: str) -> None:
    """Prints ``error: message`` on stderr and exits with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _resolve_config(value: str) -> str:
    """Maps a config name or path to an existing file, or fails with the list of configs."""
    path = value.split(":", 1)[0]
    if os.path.isfile(path):
        return value
    # A bare name ("cpu") or a path from another working directory: look in configs/.
    name = os.path.basename(path).removesuffix(".py")
    if name in configs_lib.available():
        return os.path.join(configs_lib.CONFIG_DIR, name + ".py") + value[len(path):]
    fail(f"unknown config {value!r}: use one of {', '.join(configs_lib.available())} "
         f"(e.g. --config=experiments/configs/cpu.py or --config=cpu).")
    return value  # unreachable


def _load_config_file(path: str):
    import importlib.util

    import ml_collections

    try:
        spec = importlib.util.spec_from_file_location("_jaxmp_cfg", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config()
    except Exception as e:  # noqa: BLE001 - a user's file: report what broke, not a traceback
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        fail(f"config file {path} could not be loaded{where}: {type(e).__name__}: {e}. It must define "
             "get_config() returning an ml_collections.ConfigDict, like experiments/configs/cpu.py.")
    if not isinstance(config, ml_collections.ConfigDict):
        fail(f"config file {path}: get_config() returned {type(config).__name__} {config!r:.80}, not an "
             "ml_collections.ConfigDict; return one, like experiments/configs/cpu.py (start from "
             "experiments.configs.default.get_config() and change its fields).")
    return config


def _check_overrides(argv: list[str], config_arg: str) -> None:
    """Fails with a clear message if a ``--config.<field>`` names no field of the config."""
    config = _load_config_file(config_arg.split(":", 1)[0])
    for arg in argv:
        m = _OVERRIDE_RE.match(arg)
        if not m:
            continue
        node, parts = config, m.group(1).split(".")
        for i, part in enumerate(parts):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if part not in keys:
                where = ".".join(parts[:i]) or "the config"
                hint = f" Known fields of {where}: {', '.join(sorted(keys))}." if keys else ""
                if parts[0] == "model_kwargs":
                    hint += (" Model attributes can only be overridden where the config declares them; "
                             "add them to model_kwargs in a config file.")
                fail(f"unknown config field {m.group(1)!r} in {arg.split('=')[0]}.{hint}")
            node = node[part]


def _check_workdir(workdir: str | None) -> None:
    if not workdir:
        fail("--workdir is required, e.g. --workdir=/tmp/jaxmp_run")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        fail(f"--workdir={workdir!r} is a file, not a directory: name a directory (it is created if missing).")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        fail(f"--workdir={workdir!r} cannot be created ({e.strerror}): name a directory you can write to.")
    if not os.access(workdir, os.W_OK | os.X_OK):
        fail(f"--workdir={workdir!r} is not writable: name a directory you can write to.")


def parse_plain(argv: list[str]) -> list[str]:
    """absl's flag parsing with an unknown or bad flag reported in one line (no traceback).

    ``--help`` prints absl's help and exits 0 (absl's own exits 1, which reads as a failure).
    """
    if any(a in _HELP for a in argv[1:]):
        app.usage(shorthelp=True, writeto_stdout=True)
        sys.stdout.flush()
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}. Pass --help to see the flags.")


_HELP = ("--help", "-h", "-?", "--helpshort")
_DERIVED = {"global_batch_size": "per_device_batch_size x num_devices",
            "learning_rate": "base_learning_rate x global_batch_size / base_batch_size"}


def config_fields_help(config, source: str) -> str:
    """The ``--help`` section that lists every config field with its value in ``config``."""
    values = flat_fields(config.to_dict())
    import textwrap

    intro = (f"Config fields: --config.<field>=<value>; defaults of {source} (pass --config=<name> with --help "
             "for another config's). Fields marked * change what a run computes: they are recorded with its "
             "checkpoints, and resuming (or reading back a finished run) with another value is refused.")
    lines = textwrap.wrap(intro, 100) + [""]
    for k, v in sorted(values.items()):
        shown = "(" + ", ".join(map(repr, v)) + ("," if len(v) == 1 else "") + ")" if isinstance(v, (tuple, list)) \
            else repr(v)
        derived = f"  [= {_DERIVED[k]}]" if k in _DERIVED else ""
        mark = " " if k.split(".")[0] in FREE_FIELDS else "*"
        lines.append(f"  {mark} {k} = {shown}{derived}")
    return "\n".join(lines)


def _help(argv: list[str]) -> None:
    """absl's help of the entry point plus the config fields; exits 0."""
    config_arg = next((m.group(1) for m in map(_CONFIG_RE.match, argv) if m), None)
    path = _resolve_config(config_arg).split(":", 1)[0] if config_arg else os.path.join(
        configs_lib.CONFIG_DIR, "default.py")
    config = _load_config_file(path)
    app.usage(shorthelp=True, writeto_stdout=True)
    print("\n" + config_fields_help(config, os.path.relpath(path)))
    sys.stdout.flush()
    sys.exit(0)


def parse_flags(argv: list[str]) -> list[str]:
    """Flag parser of the config-taking commands (``app.run(flags_parser=...)``)."""
    argv = list(argv)
    if any(a in _HELP for a in argv[1:]):
        _help(argv)
    if "--config" in argv[1:-1]:  # "--config cpu" -> "--config=cpu", so it is resolved like the rest
        i = argv.index("--config", 1)
        argv[i:i + 2] = ["--config=" + argv[i + 1]]
    config_arg = None
    for i, arg in enumerate(argv):
        m = _CONFIG_RE.match(arg)
        if m:
            argv[i] = "--config=" + _resolve_config(m.group(1))
            config_arg = argv[i].split("=", 1)[1]
    if config_arg is not None:
        _check_overrides(argv, config_arg)
    rest = parse_plain(argv)
    if flags.FLAGS.config is None:
        fail("--config is required, e.g. --config=experiments/configs/cpu.py")
    try:
        check_fields(flags.FLAGS.config)
    except UserError as e:
        fail(str(e))
    _check_workdir(flags.FLAGS.workdir)
    quiet_tensorflow(flags.FLAGS.config)
    return rest


def _finish(code: int, message: str | None = None) -> None:
    """Ends the process with ``code`` after a run, printing ``error: message`` first if given.

    The background TensorFlow import (`experiments.metrics.preload`) is waited for, so
    interpreter shutdown never cuts a C++ import short. After an error the process then ends
    with ``os._exit``, once its streams are flushed: a clear error must end in its own exit
    status, and a normal shutdown runs C++ static destructors (TensorFlow's, TensorStore's)
    while threads they own may still run, which can abort with ``terminate called ...`` and
    status 134 after the message. Everything the run wrote is closed by then (checkpoint manager,
    metric writers, results), so there is nothing left for shutdown to do.
    """
    from experiments import metrics

    if message is not None:
        print(f"error: {message}", file=sys.stderr, flush=True)
    metrics.settle()
    if message is None:
        sys.exit(code)
    import logging as std_logging

    std_logging.shutdown()  # absl's handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(main, *, parse: bool = True) -> None:
    """``app.run(main)`` with the exit codes 0 (success), 1 (failed run) and 2 (usage error).

    A user error (`UserError`, a missing dataset) prints one line and exits 2; a
    `RunFailedError` (a full disk...) prints its message and exits 1; an unexpected
    exception is absl's traceback and exit 1.

    Args:
      main: the command's ``main(argv)``.
      parse: use `parse_flags` (``--config``/``--workdir`` commands) rather than plain parsing.
    """
    from experiments.data import DatasetUnavailableError

    def guarded(argv):
        if len(argv) > 1:
            fail(f"unexpected arguments: {' '.join(argv[1:])} (flags are written --name=value).")
        try:
            main(argv)
        except (UserError, DatasetUnavailableError) as e:
            _finish(2, str(e))
        except RunFailedError as e:
            _finish(1, str(e))
        except Exception:  # absl prints the traceback and exits 1; let the TF import end first
            from experiments import metrics

            metrics.settle()
            raise
        _finish(0)

    app.run(guarded, flags_parser=parse_flags if parse else parse_plain)
