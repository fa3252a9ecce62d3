"""``env.name: mcp``: an MCP server's tools (stdio) with the tools env's tasks and reward.  The
example server (examples/mcp/server.py, the SDK's documented MCPServer style) is started for real
and scripted model turns play episodes through arl's own episode code: a tool call, then an
answer.  A server that dies mid-episode is a recoverable fault and the next episode gets a new
server; a server that fails to start and a missing package fail in one line."""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mcp")  # the mcp extra (bash install.sh --mcp)

from arl.env import check_env, make_env  # noqa: E402
from arl.rollout import ChatFormat, Episode, EpisodeConfig, Sample  # noqa: E402
from example_runs import three_rl_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "examples" / "mcp" / "server.py")
ROW = {"prompt": "One box holds 55 lb. How many kg do 2 boxes hold?", "answer": "49.9"}
KW = dict(command="python", args=[SERVER], reward_fn="examples.mcp.reward:score", system_prompt="Use the tools.")


def _call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


async def _play(env, fmt, turns, row=ROW):
    ep = Episode(env, fmt, EpisodeConfig(max_total_tokens=4096), seed=0, task=row)
    await ep.start()
    for text in turns:
        if ep.done:
            break
        ids = fmt.encode(text) + [fmt.eos_token_id]
        await ep.apply(Sample(ids, [-0.5] * len(ids), text, "stop"))
    return ep.trajectory()


@pytest.fixture(scope="module")
def fmt(tiny_tokenizer):
    return ChatFormat(tiny_tokenizer)


def test_the_servers_tools_answer_the_models_calls(fmt):
    env = make_env("mcp", **KW)
    try:
        assert env.observation_role == "tool" and env.stop == ()
        schemas = {t["function"]["name"]: t["function"] for t in env.tools}
        assert sorted(schemas) == ["calculator", "convert"]  # the server's tools/list, JSON schemas as given
        assert schemas["convert"]["parameters"]["required"] == ["value", "from_unit", "to_unit"]
        assert schemas["calculator"]["description"].startswith("Evaluate an arithmetic expression")
        turns = [_call("convert", {"value": 55, "from_unit": "lb", "to_unit": "kg"}),
                 _call("convert", {"value": 1, "from_unit": "lb", "to_unit": "m"})
                 + _call("calculator", {"expression": "24.95 * 2"}) + _call("convert", {"value": "x"}),
                 "The boxes hold 49.9 kg."]
        t = asyncio.run(_play(env, fmt, turns))
        assert t.metadata["fault"] == "none" and t.reward == 1.0
        text = fmt.tokenizer.decode(t.tokens.tolist())
        assert "24.95" in text and "49.9" in text
        # a tool's own error (isError) and a bad argument are error messages; the episode goes on
        assert ("error: convert raised ToolError: Error executing tool convert: "
                "cannot convert mass (lb) to length (m)") in text
        assert "error: convert arguments" in text
        assert [c["tool"] for c in t.metadata["calls"]] == ["convert", "convert", "calculator", "convert"]
        assert t.metadata["tool_errors"] == 2
        # the same instance (the same server) plays the next episode
        again = asyncio.run(_play(env, fmt, turns))
        assert again.reward == 1.0
    finally:
        asyncio.run(env.close())


DYING = textwrap.dedent('''
    import os
    from mcp.server.mcpserver import MCPServer
    mcp = MCPServer("dying", log_level="WARNING")

    @mcp.tool()
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    @mcp.tool()
    def die() -> str:
        """Exit the server's process."""
        os._exit(1)

    if __name__ == "__main__":
        mcp.run()
''')


def test_a_server_that_dies_mid_episode_is_a_recoverable_fault_and_is_restarted(fmt, tmp_path):
    (tmp_path / "dying.py").write_text(DYING)
    env = make_env("mcp", command="python", args=[str(tmp_path / "dying.py")],
                   reward_fn="examples.mcp.reward:score")
    try:
        t = asyncio.run(_play(env, fmt, [_call("echo", {"text": "hi"}), _call("die", {}), "49.9"]))
        assert t.metadata["fault"] == "recoverable" and t.reward == 0.0  # retried or filtered by the manager
        assert f"MCP server 'python {tmp_path / 'dying.py'}' died mid-episode" == t.metadata["fault_reason"]
        assert len(t.turns) == 2
        # the next episode on this instance gets a new server
        t = asyncio.run(_play(env, fmt, [_call("echo", {"text": "alive again"}), "49.9"]))
        assert t.metadata["fault"] == "none" and t.reward == 1.0
        assert "alive again" in fmt.tokenizer.decode(t.tokens.tolist())
    finally:
        asyncio.run(env.close())


class DieOnce:
    """A scripted engine: the first episode calls ``die``; later ones call ``echo``, then answer."""

    version = 0

    def __init__(self, tok):
        self.tok, self.died = tok, False

    async def generate_one(self, tokens, sampling):
        text = self.tok.decode(tokens)
        if "alive" in text.split("<|im_start|>user", 1)[-1]:
            out = "49.9"
        elif not self.died:
            self.died, out = True, _call("die", {})
        else:
            out = _call("echo", {"text": "alive"})
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def test_the_rollout_manager_retries_the_episode_on_a_new_server(fmt, tmp_path):
    """arl's fault rules: the recoverable episode is retried (here on the same pooled instance,
    whose reset starts a new server) and the batch is whole."""
    from arl.config import RolloutConfig
    from arl.rollout import RolloutManager, SamplingConfig

    (tmp_path / "dying.py").write_text(DYING)
    factory = lambda: make_env("mcp", command="python", args=[str(tmp_path / "dying.py")],  # noqa: E731
                               reward_fn="examples.mcp.reward:score")

    async def go():
        m = RolloutManager(DieOnce(fmt.tokenizer), factory, fmt, tasks=range(10), groups_per_step=1, pool_size=1,
                           config=RolloutConfig(group_size=1, tasks_per_step=1, retries=1, staleness=0),
                           episode=EpisodeConfig(max_turns=3, sampling=SamplingConfig(max_tokens=64, stop=())),
                           task_row=lambda seed: ROW)
        async with m:
            return await m.get_batch()

    b = asyncio.run(go())
    (t,) = b.trajectories
    assert t.metadata["attempts"] == 2 and t.metadata["fault"] == "none" and t.reward == 1.0
    assert b.metrics["rollout/retries"] == 1


def test_a_server_that_fails_to_start_and_a_missing_package_are_one_line(tmp_path, monkeypatch):
    # the server's last stderr line is in the error: the MCP client itself sees only the closed pipe
    (tmp_path / "broken.py").write_text("import sys\nprint('loading', file=sys.stderr)\n"
                                        "raise SystemExit('no tools today')\n")
    with pytest.raises(ValueError) as e:
        make_env("mcp", command="python", args=[str(tmp_path / "broken.py")], reward_fn="examples.mcp.reward:score")
    assert str(e.value) == (f"env.kwargs.command: MCP server 'python {tmp_path / 'broken.py'}' failed to start "
                            "(MCPError: Connection closed; stderr: no tools today)")
    with pytest.raises(ValueError, match=r"^env.kwargs.command: MCP server 'no-such-server' failed to start "
                                         r"\(FileNotFoundError: "):
        make_env("mcp", command="no-such-server", reward_fn="examples.mcp.reward:score")
    check_env("mcp", KW, ROW)  # what --dry-run does: make it, reset the first task
    monkeypatch.setitem(sys.modules, "mcp", None)  # not installed
    with pytest.raises(ValueError) as e:
        make_env("mcp", **KW)
    assert "mcp needs the mcp package, which is not installed" in str(e.value)
    assert "pip install 'arl[mcp]'" in str(e.value) and "bash install.sh --mcp" in str(e.value)
    assert "\n" not in str(e.value)


_SLOW_SERVER = """
import time
time.sleep(float({start}))  # a server slow to start: its SDK imported on a loaded machine
from mcp.server.mcpserver import MCPServer
mcp = MCPServer("slow", log_level="WARNING")

@mcp.tool()
def wait(seconds: float) -> str:
    \"\"\"Wait, then answer.

    Args:
        seconds: how long
    \"\"\"
    time.sleep(seconds)
    return "done"

mcp.run()
"""


def test_the_start_gets_start_timeout_and_a_call_gets_tool_timeout(tmp_path):
    """The server's start (initialize, tools/list) is bounded by ``start_timeout_s``, each tool call
    by ``tool_timeout_s``: a start slower than a tool call's budget is not a failed start."""
    server = tmp_path / "slow.py"
    server.write_text(_SLOW_SERVER.format(start=2.5))
    env = make_env("mcp", command="python", args=[str(server)], reward_fn="examples.mcp.reward:score",
                   tool_timeout_s=1.0, start_timeout_s=60.0)
    try:
        call = env._caller("wait")
        assert asyncio.run(call(seconds=0.0)) == "done"
        with pytest.raises(Exception, match="[Tt]imed out"):
            asyncio.run(call(seconds=5.0))
    finally:
        env._server.close()
    # whichever bound fires first (the session's read timeout or the wait for tools/list): one line
    with pytest.raises(ValueError, match=r"failed to start \((TimeoutError: no tools/list answer within 1s|"
                                         r"MCPError: Request 'initialize' timed out)"):
        make_env("mcp", command="python", args=[str(server)], reward_fn="examples.mcp.reward:score",
                 tool_timeout_s=1.0, start_timeout_s=1.0)


@pytest.mark.slow  # a whole training run (vLLM engine, trainer rank, the MCP servers): minutes on 2 CPU cores
def test_three_rl_steps_with_held_out_evaluation(tmp_path, tiny_model_dir):
    """examples/mcp/config.yaml as shipped but on the tests' tiny model: 3 RL steps whose tool calls
    (if the tiny model writes any) go to the example server, held-out evaluations before and after."""
    out = three_rl_steps("mcp", tmp_path, tiny_model_dir, f"env.kwargs.args=[{json.dumps(SERVER)}]",
                         "env.pool_size=2", "rollout.max_turn_tokens=32", "rollout.max_total_tokens=1536")
    row = json.loads((out / "transcripts" / "heldout_step3.jsonl").read_text().splitlines()[0])
    assert "convert" in json.dumps(row)  # the server's tools reached the prompt


def test_restart_each_episode_starts_a_server_per_episode():
    env = make_env("mcp", restart_each_episode=True, **KW)
    try:
        first = env._server
        asyncio.run(env.reset(0, task=ROW))
        assert env._server is not first and first.dead and not env._server.dead
    finally:
        asyncio.run(env.close())
