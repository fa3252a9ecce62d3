"""The user's own environment by import path (``env.name: "module:Class"``): made in this process
and in a spawned one (how rollout processes start), checked by ``--dry-run``, and every mistake a
one-line error."""
import multiprocessing as mp
import sys
import textwrap

import pytest

from arl.env import check_env, env_class, make_env
from arl.train import main

PLUGIN = textwrap.dedent('''
    from arl.env import Environment, StepResult

    class Echo(Environment):
        """Answer with the task's word."""
        def __init__(self, word="hello", fail_reset=False):
            self.word, self.fail_reset = word, fail_reset

        async def reset(self, seed):
            if self.fail_reset:
                raise RuntimeError("no tasks today")
            return f"say {self.word} {seed}"

        async def step(self, action_text):
            return StepResult("", reward=float(self.word in action_text), done=True)

    NOT_AN_ENV = object
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "arl_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "arl_test_plugin:Echo"
    sys.modules.pop("arl_test_plugin", None)


def _make_in_child(name, out):
    out.put(type(make_env(name, word="hi")).__qualname__)


@pytest.mark.slow  # a spawned process imports torch and the plugin
def test_made_here_and_in_a_spawned_process(plugin):
    env = make_env(plugin, word="hi")
    assert type(env).__name__ == "Echo" and env.word == "hi" and env_class(plugin) is type(env)
    check_env(plugin, {"word": "hi"})
    ctx = mp.get_context("spawn")  # the rollout processes' start method: they import the plugin themselves
    out = ctx.Queue()
    p = ctx.Process(target=_make_in_child, args=(plugin, out))
    p.start()
    p.join(120)
    assert p.exitcode == 0 and out.get(timeout=5) == "Echo"


@pytest.mark.parametrize("name,kwargs,msg", [
    ("arl_test_plugin:Nope", {}, "env.name: module 'arl_test_plugin' has no 'Nope'"),
    ("arl_test_plugin:NOT_AN_ENV", {}, "is not an arl.env.Environment subclass"),
    ("no_such_module_xyz:Env", {}, "env.name: cannot import 'no_such_module_xyz' (ModuleNotFoundError"),
    ("nope", {}, "env: unknown 'nope'"),
    ("arl_test_plugin:Echo", {"colour": 1}, "env.kwargs: got an unexpected keyword argument 'colour' (Echo)"),
    ("arl_test_plugin:Echo", {"fail_reset": True}, "failed to reset task 0 (RuntimeError: no tasks today)"),
])
def test_mistakes_are_one_line(plugin, name, kwargs, msg):
    with pytest.raises(ValueError) as e:
        check_env(name, kwargs)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_dry_run_checks_the_environment(plugin, capsys):
    assert main(["--dry-run", f"env.name={plugin}", "env.kwargs={word: hi}", "sft.enabled=false"]) == 0
    assert "env OK: arl_test_plugin:Echo" in capsys.readouterr().out
    # SFT on, but this env has no expert and no sft.dataset is given: said at once, not skipped
    assert main(["--dry-run", f"env.name={plugin}", "env.kwargs={word: hi}"]) == 2
    assert "config error: sft.enabled: environment 'arl_test_plugin:Echo' has no expert" in capsys.readouterr().err
    assert main(["--dry-run", "env.name=toy_lookup", "env.kwargs={colour: red}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: config error: env.kwargs: got an unexpected keyword argument 'colour'")
