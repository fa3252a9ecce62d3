"""``env.name: openenv``: an OpenEnv environment server, run from its own venv (``bash install.sh
--openenv``), driven over OpenEnv's WebSocket protocol by arl's thin client.  The real thing:
examples/openenv/guess_env (OpenEnv's documented layout, served by OpenEnv's create_app) played by a
scripted engine through arl's episode code, and (slow) 3 RL steps of the tiny model with held-out
evaluation; these skip, saying why, when the OpenEnv venv is absent.  Fault injection (a server that
dies, bad JSON, error replies, a NaN reward, one that does not start) uses tests/fixtures/openenv_fake.py,
a stand-in speaking the same wire format from arl's venv."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
from pathlib import Path

import pytest

from arl.env import Fault, make_env
from arl.env.openenv_client import openenv_python
from arl.rollout import ChatFormat, EpisodeConfig, SamplingConfig
from arl.rollout.engine import Sample
from arl.rollout.episode import run_episode
from arl.train import main
from example_runs import BinarySearch, three_rl_steps

ROOT = Path(__file__).resolve().parents[1]
FAKE = dict(server="openenv_fake:app", python=sys.executable, cwd=str(ROOT / "tests" / "fixtures"), timeout_s=10.0)
GUESS = dict(server="guess_env.server.app:app", cwd=str(ROOT / "examples" / "openenv"))


def _need_openenv_venv():
    try:
        return openenv_python()
    except ValueError as e:
        pytest.skip(f"the OpenEnv venv is absent ({e})")


def test_turns_are_actions_and_observations_are_user_turns_the_return_is_the_reward():
    env = make_env("openenv", system_prompt="Play.", max_turns=5, **FAKE)
    assert (env.action_field, env.observation_field) == ("message", "text")  # the schemas' only text fields
    assert env.observation_role == "user" and env.stop == () and env.system_prompt == "Play."

    async def go():
        try:
            assert await env.reset(7) == "Say go 3 times (seed 7)."
            r = await env.step("go\n")
            assert (r.observation, r.reward, r.done, r.info["counts"]) == ("2 to go.", 0.0, False, {"go": 1})
            await env.step("wait")
            await env.step("go")
            r = await env.step("go")
            assert r.done and r.reward == 1.5 and r.fault is Fault.NONE  # the sum of the per-step rewards
            assert await env.reset(8) == "Say go 3 times (seed 8)."  # the same session, a new episode
        finally:
            await env.close()

    asyncio.run(go())


def test_a_server_that_dies_mid_episode_is_a_recoverable_fault_and_the_next_reset_restarts_it():
    env = make_env("openenv", **FAKE)

    async def go():
        try:
            await env.reset(0)
            url = env._url
            r = await env.step("die")
            assert r.done and r.fault is Fault.RECOVERABLE and r.reward == 0.0
            assert r.info["fault_reason"].startswith("OpenEnv server 'openenv_fake:app' died mid-episode (stderr: ")
            assert "\n" not in r.info["fault_reason"]
            assert await env.reset(1) == "Say go 3 times (seed 1)."  # on a new server
            assert env._url != url and (await env.step("go")).fault is Fault.NONE
        finally:
            await env.close()

    asyncio.run(go())


class DieOnce:
    """A scripted engine: the first turn ever says "die" (the server exits); every later turn "go"."""

    version = 0

    def __init__(self, tok):
        self.tok, self.died = tok, False

    async def generate_one(self, tokens, sampling):
        out, self.died = ("go" if self.died else "die"), True
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def test_the_rollout_manager_retries_the_episode_on_a_restarted_server(tiny_tokenizer):
    """arl's fault rules: the recoverable episode is retried on the pooled instance, whose reset
    starts a new server, and the batch is whole."""
    from arl.config import RolloutConfig
    from arl.rollout import RolloutManager

    fmt = ChatFormat(tiny_tokenizer)

    async def go():
        m = RolloutManager(DieOnce(tiny_tokenizer), lambda: make_env("openenv", **FAKE), fmt, tasks=range(10),
                           groups_per_step=1, pool_size=1,
                           config=RolloutConfig(group_size=1, tasks_per_step=1, retries=1, staleness=0),
                           episode=EpisodeConfig(max_turns=4, sampling=SamplingConfig(max_tokens=8, stop=())))
        async with m:
            return await m.get_batch()

    b = asyncio.run(go())
    (t,) = b.trajectories
    assert t.metadata["attempts"] == 2 and t.metadata["fault"] == "none" and t.reward == 1.5
    assert b.metrics["rollout/retries"] == 1


@pytest.mark.parametrize("turn,why", [("badjson", "JSONDecodeError: Expecting value"),
                                      ("error", "RuntimeError: EXECUTION_ERROR: step raised KeyError: 'x'"),
                                      ("nan", "ValueError: reward nan is not a finite number"),
                                      ("slow", "TimeoutError: no reply within 2s")])
def test_bad_replies_are_recoverable_faults_and_the_next_episode_goes_on(turn, why):
    env = make_env("openenv", **dict(FAKE, timeout_s=2.0))  # a late reply is not read as the next one's

    async def go():
        try:
            await env.reset(0)
            r = await env.step(turn)
            assert r.done and r.fault is Fault.RECOVERABLE
            assert r.info["fault_reason"].startswith(f"OpenEnv server 'openenv_fake:app': {why}"), r.info["fault_reason"]
            await env.reset(1)  # a new session on the same server
            assert (await env.step("go")).observation == "2 to go."
        finally:
            await env.close()

    asyncio.run(go())


def test_a_running_server_by_base_url():
    from arl.env.openenv_client import shared_server

    url = shared_server((sys.executable, FAKE["server"], FAKE["cwd"], 60.0)).url
    env = make_env("openenv", base_url=url + "/")

    async def go():
        try:
            assert await env.reset(2) == "Say go 3 times (seed 2)."
        finally:
            await env.close()

    asyncio.run(go())


def test_what_cannot_start_fails_in_one_line(monkeypatch, capsys):
    def one_line(match, **kw):
        with pytest.raises(ValueError) as e:
            make_env("openenv", **kw)
        assert "\n" not in str(e.value) and re.search(match, str(e.value)), str(e.value)

    one_line(r"^env.kwargs.server: OpenEnv server 'no_such_module:app' failed to start \(exited with code \d+; "
             r"stderr: .*no_such_module", **dict(FAKE, server="no_such_module:app"))
    one_line(r"^env.kwargs: give server .* or base_url .*, one of them$")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line(rf"^env.kwargs: no OpenEnv /schema at http://127.0.0.1:{port} \(ConnectError", base_url=f"http://127.0.0.1:{port}")
    one_line(r"^env.kwargs.action_field: 'GoAction' has no field 'msg' \(fields: \['message'\]\)$", action_field="msg", **FAKE)
    # no OpenEnv venv: the install flag is named, at --dry-run too
    one_line(r"^env.name: openenv runs OpenEnv servers from their own venv, which is missing \(/nonexistent/python\): "
             r"bash install.sh --openenv$", **dict(FAKE, python="/nonexistent/python"))
    with monkeypatch.context() as m:  # arl's side of the wire missing: the extra is named
        m.setitem(sys.modules, "websockets.asyncio.client", None)
        one_line(r"^env.name: openenv needs httpx and websockets>=13 in arl's environment \(.*\): "
                 r"pip install 'arl\[openenv\]' or bash install.sh --openenv$", **FAKE)
    monkeypatch.setenv("ARL_OPENENV_VENV", "/nonexistent-venv")
    argv = ["--dry-run", "--config", str(ROOT / "examples" / "openenv" / "config.yaml"), "model.name_or_path=tiny"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "(/nonexistent-venv/bin/python): bash install.sh --openenv" in err, err


def test_the_real_openenv_server_plays_an_episode_in_the_user_role(tiny_tokenizer, arun):
    _need_openenv_venv()
    fmt = ChatFormat(tiny_tokenizer)
    env = make_env("openenv", system_prompt="Play.", max_turns=6, **GUESS)
    assert (env.action_field, env.observation_field) == ("message", "text")  # GuessAction / GuessObservation
    cfg = EpisodeConfig(max_turns=6, max_total_tokens=1024, sampling=SamplingConfig(max_tokens=8, stop=()))
    try:
        t = arun(run_episode(BinarySearch(tiny_tokenizer, say="I guess {}"), env, fmt, seed=3, config=cfg))
    finally:
        arun(env.close())
    # seed 3's number is 8: 10, 5, 7, then 8
    assert t.reward == 1.0 and t.metadata["fault"] == "none" and len(t.turns) == 4
    text = tiny_tokenizer.decode(t.tokens)
    assert "<|im_start|>user\nLower.<|im_end|>" in text and "<|im_start|>user\nHigher.<|im_end|>" in text
    assert "<|im_start|>tool" not in text


@pytest.mark.slow  # a whole training run (vLLM engine, trainer rank, OpenEnv servers): 1-1.5 min on 2 CPU cores
def test_three_rl_steps_with_held_out_evaluation(tmp_path, tiny_model_dir):
    """examples/openenv/config.yaml as shipped but on the tests' tiny model: 3 RL steps against the
    real OpenEnv server, held-out evaluations before and after, the game's answers in the user role."""
    _need_openenv_venv()
    out = three_rl_steps("openenv", tmp_path, tiny_model_dir, "env.pool_size=8")
    recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # no episode failed to reset (masked) or broke mid-episode (retried): every one reached the server
    assert all(recs[s]["rollout/num_masked"] == 0 and recs[s]["rollout/retries"] == 0 for s in (1, 2, 3)), recs
    rows = [json.loads(x) for x in (out / "transcripts" / "heldout_step3.jsonl").read_text().splitlines()]
    assert rows and all(r["fault"] == "none" for r in rows)
    tr = rows[0]["transcript"]
    assert "I am thinking of a whole number from 1 to 20." in tr["prompt"]  # the server's reset observation
    obs = [t["text"] for t in tr["turns"] if t["role"] == "observation"]
    assert obs and all("user" in o and "tool" not in o for o in obs)
    assert all(any(w in o for w in ("Higher.", "Lower.", "Answer with one number.")) for o in obs), obs
