"""Command-line plumbing shared by ``main.py`` and ``compare.py``.

absl + ml_collections as in the Flax examples, with two conveniences and clear
errors instead of tracebacks: ``--config`` takes a path *or* a config name
(``cpu``, ``gpu_t4``...); an unknown config, an unknown ``--config.<field>``, a bad
value, or a user error raised by the run (:class:`UserError`) prints one message
that says what to do and exits with status 2.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags

from experiments import configs as configs_lib


class UserError(ValueError):
    """A problem with the user's input; its message says what to do."""


_CONFIG_RE = re.compile(r"^--config=(.*)$")
_OVERRIDE_RE = re.compile(r"^--config\.([A-Za-z0-9_.]+)(=.*)?$")


def define_flags() -> None:
    """Defines ``--config``, ``--workdir`` and ``--report`` (call once at import of the entry point)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file (experiments/configs/<name>.py) or just its name, e.g. cpu, gpu_t4.",
        lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results; "
                        "a run started again with the same workdir resumes.")
    flags.DEFINE_bool("report", False, "Also run jaxmp's diagnostics (precision report of the compiled "
                      "step, gradient statistics, input-pipeline overhead) and write them to the workdir.")


def _fail(message: str) -> None:
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
    _fail(f"unknown config {value!r}: use one of {', '.join(configs_lib.available())} "
          f"(e.g. --config=experiments/configs/cpu.py or --config=cpu).")
    return value  # unreachable


def _check_overrides(argv: list[str], config_arg: str) -> None:
    """Fails with a clear message if a ``--config.<field>`` names no field of the config."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_jaxmp_cfg", config_arg.split(":", 1)[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
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
                _fail(f"unknown config field {m.group(1)!r} in {arg.split('=')[0]}.{hint}")
            node = node[part]


def parse_flags(argv: list[str]) -> list[str]:
    """absl flags parser with config-name resolution and friendly errors (``app.run(flags_parser=...)``)."""
    argv = list(argv)
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
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e}. Pass --helpfull to see all flags.")
    if flags.FLAGS.config is None:
        _fail("--config is required, e.g. --config=experiments/configs/cpu.py")
    if not flags.FLAGS.workdir:
        _fail("--workdir is required, e.g. --workdir=/tmp/jaxmp_run")
    return rest


def run(main) -> None:
    """``app.run(main)`` that turns :class:`UserError` and friends into a one-line message."""
    from experiments.checkpoint import CheckpointMismatchError
    from experiments.data import DatasetUnavailableError

    def guarded(argv):
        try:
            return main(argv)
        except (UserError, DatasetUnavailableError, CheckpointMismatchError) as e:
            _fail(str(e))

    app.run(guarded, flags_parser=parse_flags)
