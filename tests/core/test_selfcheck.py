"""jaxmp/selfcheck.py: the command line refuses what it cannot check before running anything.

The checks themselves (the composition table and the constructs) are tested in
tests/engine/test_contract.py; a full run is slow, so it is not repeated here.
"""

import pytest

from jaxmp.selfcheck import main


@pytest.mark.parametrize("policy,message", [("O9", "--policy 'O9'"), ("float32", "computes in float32"),
                                            ("O0", "computes in float32")])
def test_a_policy_it_cannot_check_is_a_usage_error(policy, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--policy", policy])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_arguments_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--fast"])
    assert e.value.code == 2 and "unrecognized arguments: --fast" in capsys.readouterr().err


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "python -m jaxmp.selfcheck" in out and "--markdown" in out
