"""The tiny model's corpus comes from the configured env made with its ``env.kwargs`` (arl/prepare.py
``tiny_corpus_kwargs``): an env with a required argument (MCP's ``command``) used to be made without
them, so the run died building the model after ``--dry-run`` (which makes the env with them) said OK."""
import pytest

from arl.config import load_config
from arl.env.base import Environment, StepResult
from arl.env.registry import register_env
from arl.model.tiny import build_corpus
from arl.prepare import model_dir_for, tiny_corpus_kwargs


@register_env("arl_test_needs_command")
class NeedsCommand(Environment):
    """An env whose constructor needs an argument, as the MCP env needs its server's command."""

    def __init__(self, command: str, max_turns: int = 4):
        self.command = command
        self.system_prompt = f"Serve with {command}."

    async def reset(self, seed: int) -> str:
        return f"task {seed} for {self.command}"

    async def step(self, action_text: str) -> StepResult:
        return StepResult("", 0.0, True, {})


CFG = ["env.name=arl_test_needs_command", "env.kwargs={command: srv-7}"]


def test_the_corpus_env_gets_the_configured_kwargs():
    cfg = load_config(None, CFG)
    assert tiny_corpus_kwargs(cfg)["command"] == "srv-7"
    texts = build_corpus(["arl_test_needs_command"], seeds=2, env_kwargs={"arl_test_needs_command": {"command": "srv-7"}})
    assert "Serve with srv-7." in texts and "task 1 for srv-7" in texts


@register_env("arl_test_optional_command")
class OptionalCommand(NeedsCommand):
    def __init__(self, command: str = "default", max_turns: int = 4):
        super().__init__(command, max_turns)


def test_an_env_made_without_its_kwargs_keeps_the_corpus_it_had():
    """The shipped configs' tiny models (and the runs measured on them) keep their tokenizer: the
    kwargs are used only where the env cannot be made without them."""
    plain = build_corpus(["arl_test_optional_command"], seeds=2)
    assert "Serve with default." in plain
    assert build_corpus(["arl_test_optional_command"], seeds=2,
                        env_kwargs={"arl_test_optional_command": {"command": "x"}}) == plain


def test_model_dir_for_builds_the_tiny_corpus_with_them(monkeypatch):
    import arl.prepare as prepare

    got = {}
    monkeypatch.setattr(prepare, "build_tiny_model", lambda **kw: got.update(kw) or "/nowhere")
    assert model_dir_for(load_config(None, CFG)) == "/nowhere"
    assert got["envs"] == ("arl_test_needs_command",)
    assert got["env_kwargs"]["arl_test_needs_command"]["command"] == "srv-7"


def test_an_env_that_cannot_make_its_corpus_is_one_line():
    with pytest.raises(ValueError) as e:
        build_corpus(["arl_test_needs_command"], seeds=1)  # no command
    msg = str(e.value)
    assert msg == ("envs: environment 'arl_test_needs_command' could not produce the tiny model's corpus text "
                   "(model.name_or_path: tiny; ValueError: env.kwargs: missing a required argument: 'command' "
                   "(NeedsCommand))")


@register_env("arl_test_parses_calls")
class ParsesCalls(NeedsCommand):
    def __init__(self, command: str, parser: str = "hermes", max_turns: int = 4):
        super().__init__(command, max_turns)
        self.parser = parser


def test_a_vllm_parser_is_left_out_of_the_corpus_env():
    """A vLLM parser reads the model's tokenizer -- the one this corpus is for; arl's own stay."""
    over = ["env.name=arl_test_parses_calls", "env.kwargs={command: c}"]
    assert "parser" not in tiny_corpus_kwargs(load_config(None, over + ["env.tool_parser=llama3_json"]))
    assert tiny_corpus_kwargs(load_config(None, over + ["env.tool_parser=hermes"]))["parser"] == "hermes"
