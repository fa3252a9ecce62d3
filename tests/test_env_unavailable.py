"""``env.name: openenv`` / ``verifiers`` (issue #37): neither package installs beside arl's pins
(arl/env/unavailable.py says which pin each conflicts with), so the name fails ``--dry-run`` with
one line naming the conflict and the way on, instead of "unknown env"."""
from __future__ import annotations

import pytest

from arl.env import ENVIRONMENTS, env_class
from arl.env.unavailable import UNAVAILABLE
from arl.train import main


@pytest.mark.parametrize("name", sorted(UNAVAILABLE))
def test_unavailable_name_says_why_in_one_line(name):
    assert name not in ENVIRONMENTS  # not a registered env: the corpus, choices and tiny model ignore it
    with pytest.raises(ValueError) as e:
        env_class(name)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"env.name: {name} has no arl adapter yet")
    assert "arl pins mcp==2.3.0" in msg or "arl pins 2.3.0" in msg  # the conflicting pin is named
    assert "env.name: mcp" in msg and "docs/envs.md" in msg


@pytest.mark.parametrize("name", sorted(UNAVAILABLE))
def test_dry_run_fails_with_the_one_line(name, capsys):
    argv = ["--dry-run", "--config", "examples/gym/config.yaml", "model.name_or_path=tiny",
            f"env.name={name}", "env.kwargs={}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"env.name: {name} has no arl adapter yet" in err, err


def test_unknown_name_still_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"env: unknown 'openenvv'; choose from \[.*'gym'.*'mcp'"):
        env_class("openenvv")
