"""Experiment configs: ``default.py`` plus one file per hardware overriding only what differs.

Each file defines ``get_config()`` returning an ``ml_collections.ConfigDict``.
``main.py`` takes ``--config=experiments/configs/<name>.py`` (or just ``<name>``).
"""

from __future__ import annotations

import importlib
import os

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
HARDWARE = ("cpu", "gpu_t4", "gpu_p100", "gpu_v100_x8", "gpu_a100", "gpu_h100", "tpu_v3_8")


def available() -> list[str]:
    """Names of the config files in this directory (``default`` included)."""
    return sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_"))


def get_config(name: str):
    """Returns the config called ``name`` (``"cpu"``, ``"gpu_t4"``...).

    Raises:
      ValueError: no such config (the message lists them).
    """
    if name not in available():
        raise ValueError(f"Unknown config {name!r}: choose one of {', '.join(available())} "
                         f"(files in {CONFIG_DIR}).")
    return importlib.import_module(f"experiments.configs.{name}").get_config()
