"""The pages that answer questions about a training state: how to checkpoint it on one device and
when it is quantized (docs/guides/checkpointing.md, whose blocks the slow tier runs), and how many
bytes per parameter it takes (docs/lean-recipes.md, whose answer runs here)."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from tests._support._markdown import ROOT, page, run_blocks, runnable_blocks


def test_the_checkpointing_guide_saves_a_one_device_state_and_a_quantized_one_and_refuses_damage():
    blocks = runnable_blocks(page("guides/checkpointing.md"))
    saving = [b for b in blocks if "jaxmp.parallel.Checkpointer()" in b and ".save(" in b]
    one_device = [b for b in saving if "mesh" not in b]
    quantized = [b for b in saving if "lean.preset(" in b]
    assert one_device, "no one-device save/restore block (a state without a mesh)"
    assert quantized and "uint8" in quantized[0], "no quantized-state block that checks its codes came back"
    assert "is damaged" in quantized[0] and "except ValueError" in quantized[0], "no damaged restore refused"
    assert not any("StandardCheckpointer()" in b for b in blocks), "the guide's code saves without checksums"


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_lean_recipes_answers_bytes_per_parameter_with_state_bytes_per_device():
    text = page("lean-recipes.md").read_text()
    question = text.index("How many bytes per parameter does my state take?")
    assert "`jaxmp.parallel.state_bytes_per_device((params, opt_state))`" in text[question:question + 400]
    blocks = runnable_blocks(page("lean-recipes.md"))
    answer = next(i for i, b in enumerate(blocks) if "state_bytes_per_device((params, opt_state))" in b)
    assert answer == 1  # right after the recipe's own block, whose state it measures
    ns = run_blocks(blocks[:answer + 1], "docs/lean-recipes.md")
    leaves = jax.tree.leaves((ns["params"], ns["opt_state"]))
    assert ns["n_params"] == 512
    assert ns["per_param"] == sum(np.asarray(x).nbytes for x in leaves) / 512  # every leaf, on one device
    assert ns["per_param"] > ns["lean"].PRESETS["bf16-sr"][0]  # the scalars the nominal figure leaves out


def test_import_jaxmp_does_not_import_orbax():
    code = "import sys, jaxmp; jaxmp.parallel.Checkpointer; print('orbax' in ' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
