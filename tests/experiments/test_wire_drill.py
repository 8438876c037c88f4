"""experiments/wire_drill.py at small scale: poisoned gradients under the wire options leave the
state bitwise, and a kill mid-save resumes bitwise (the 1000-step drill's output is in docs/parallel.md)."""

import argparse

import jax
import pytest

from experiments import wire_drill


def test_poisoned_steps_under_both_quantizers_are_skipped_without_a_trace():
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: Python float ** int32 count
        row = wire_drill.nan_drill("zero", 8, 4, steps=50, rate=0.1, seed=0)
    assert row["ok"], row
    assert row["result"].startswith("5/5 poisoned steps skipped, 0 leaves changed by them, 0 non-finite leaves, "
                                    "copies bitwise equal: yes, 0 split verdicts"), row


def test_the_drill_refuses_bad_flags_by_name():
    args = wire_drill.build_parser().parse_args(["--layouts", "replicated"])
    with pytest.raises(SystemExit, match="unknown replicated"):
        wire_drill.run(args)
    with pytest.raises(SystemExit, match="--rate"):
        wire_drill.run(argparse.Namespace(**{**vars(wire_drill.build_parser().parse_args([])), "rate": 0.9}))


@pytest.mark.slow  # five compiles
@pytest.mark.parametrize("gather_bits, reduce_bits", wire_drill.OPTIONS)
def test_every_option_under_fsdp_skips_poisoned_steps_bitwise(gather_bits, reduce_bits):
    with jax.numpy_dtype_promotion("standard"):
        row = wire_drill.nan_drill("fsdp", gather_bits, reduce_bits, steps=50, rate=0.05, seed=1)
    assert row["ok"], row


@pytest.mark.slow  # three child processes, each compiling
def test_a_kill_mid_save_under_the_wire_options_resumes_bitwise(tmp_path):
    row = wire_drill.kill_drill("fsdp", 8, 4, steps=20, workdir=str(tmp_path))
    assert row["ok"] and "SIGKILL mid-save" in row["check"], row
    assert "final state bitwise equal to the uninterrupted run: yes" in row["result"], row
