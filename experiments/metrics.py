"""Training metrics: TensorBoard event files through ``clu.metric_writers`` plus a JSON history.

Scalars written per log point (tags): ``loss``, ``accuracy`` (training, mean over the log
interval), ``loss_scale``, ``skipped_steps`` (total so far), ``step_time`` (seconds per step),
``throughput`` (examples per second) and, at evaluation points, ``val_loss`` and
``val_accuracy``. ``tensorboard --logdir <workdir>`` shows them; for a comparison the workdir
holds one TensorBoard run per (policy, seed). The same rows go to ``history.jsonl`` (and into
the checkpoint metadata), the machine-readable record the tables and plots are drawn from.

``clu.metric_writers`` imports TensorFlow (seconds): `preload` starts that import in a
background thread at the start of a command so it overlaps with data loading and compilation.
"""

from __future__ import annotations

import json
import os
import threading

# history key -> TensorBoard tag
TAGS = {"train_loss": "loss", "train_accuracy": "accuracy", "loss_scale": "loss_scale",
        "total_skips": "skipped_steps", "step_time": "step_time", "throughput": "throughput",
        "val_loss": "val_loss", "val_accuracy": "val_accuracy"}

_preload: threading.Thread | None = None


def preload() -> None:
    """Starts importing ``clu.metric_writers`` in the background (idempotent)."""
    global _preload
    quiet_tensorflow()
    if _preload is None:
        def work():
            try:
                import clu.metric_writers  # noqa: F401
            except Exception:  # noqa: BLE001 - the real import in MetricsLog reports it
                pass
        _preload = threading.Thread(target=work, name="clu-import", daemon=True)
        _preload.start()


def quiet_tensorflow() -> None:
    """Silences TensorFlow's C++ start-up log lines (oneDNN notice, absl pre-init warning) on stderr.

    Must run before TensorFlow is imported; an explicit ``TF_CPP_MIN_LOG_LEVEL`` is kept.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def settle(timeout: float = 60.0) -> None:
    """Waits for the background TensorFlow import to end, so no interpreter exit cuts it short
    (a C++ import interrupted at shutdown can abort the process after the run's own message)."""
    if _preload is not None:
        _preload.join(timeout)


def _writer(workdir: str):
    if _preload is not None:
        _preload.join()
    from clu import metric_writers

    return metric_writers.create_default_writer(workdir, just_logging=False, asynchronous=False)


class MetricsLog:
    """Writes one row of scalars per log point to TensorBoard and ``history.jsonl``.

    Args:
      workdir: the run's directory (event files and ``history.jsonl`` go there).
      history: rows already written (a resumed run continues them).

    Example:
      >>> log = MetricsLog("/tmp/jaxmp_metrics_demo")  # doctest: +SKIP
      >>> log.write({"step": 10, "train_loss": 0.5, "loss_scale": 32768.0})  # doctest: +SKIP
      >>> log.close()  # doctest: +SKIP
    """

    def __init__(self, workdir: str, history: list[dict] | None = None):
        self.workdir = workdir
        self.history = list(history or [])
        self._tb = _writer(workdir)

    def write(self, row: dict) -> None:
        """Appends ``row`` (must hold ``"step"``) and writes its scalars."""
        self.history.append(row)
        scalars = {tag: float(row[key]) for key, tag in TAGS.items() if row.get(key) is not None}
        if scalars:
            self._tb.write_scalars(int(row["step"]), scalars)

    def flush(self) -> None:
        """Makes the event files and ``history.jsonl`` current (at checkpoints)."""
        self._tb.flush()
        path = os.path.join(self.workdir, "history.jsonl")
        with open(path + ".tmp", "w") as f:
            for row in self.history:
                f.write(json.dumps(row) + "\n")
        os.replace(path + ".tmp", path)

    def close(self) -> None:
        """Closes the event files. ``history.jsonl`` is written only with a checkpoint (`flush`),
        so it never runs ahead of one: a run that dies before its first checkpoint leaves none, and
        its workdir stays usable for the corrected rerun."""
        self._tb.flush()
        self._tb.close()
