"""Ecosystem env names arl cannot carry yet fail with one line saying why (arl/env/unavailable.py), not
"unknown env".  ``verifiers`` was one (its pins conflict with arl's) until its adapter ran it from a
venv of its own (issue #37): now a registered env whose missing venv is the one line, naming the flag."""
from __future__ import annotations

import pytest

from arl.env import ENVIRONMENTS, env_class, registry
from arl.train import main


def test_an_unavailable_name_says_why_in_one_line(monkeypatch):
    monkeypatch.setitem(registry.UNAVAILABLE, "someenv", "env.name: someenv has no arl adapter yet: its pins conflict")
    with pytest.raises(ValueError, match=r"^env.name: someenv has no arl adapter yet: its pins conflict$"):
        env_class("someenv")


@pytest.mark.parametrize("name", ["openenv", "verifiers"])
def test_the_ecosystem_packages_with_conflicting_pins_have_adapters(name):
    assert name in ENVIRONMENTS and name not in registry.UNAVAILABLE


def test_verifiers_without_its_venv_fails_dry_run_with_the_install_flag(monkeypatch, capsys):
    monkeypatch.setenv("ARL_VERIFIERS_VENV", "/nonexistent-venv")
    argv = ["--dry-run", "--config", "examples/gym/config.yaml", "model.name_or_path=tiny", "env.name=verifiers",
            "env.kwargs={taskset: guess_taskset}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("(/nonexistent-venv/bin/python): bash install.sh --verifiers"), err


def test_unknown_name_still_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"env: unknown 'openenvv'; choose from \[.*'gym'.*'mcp'.*'verifiers'"):
        env_class("openenvv")
