import asyncio
import math
import random
import statistics

import pytest

from arl.env import Fault, make_env
from arl.env.expert import expert_transcript
from arl.env.faults import LatencyModel
from arl.env.toolcall import format_answer, format_tool_call
from arl.env.toy import ToyLookupEnv


def run(coro):
    return asyncio.run(coro)


async def _episode(env, seed, turns, sample=0):
    obs = [await env.reset(seed, sample=sample)]
    results = []
    for t in turns:
        r = await env.step(t)
        results.append(r)
        obs.append(r.observation)
        if r.done:
            break
    return obs, results


def test_registered_and_reset_deterministic():
    a, b = make_env("toy_lookup"), make_env("toy_lookup")
    for seed in range(20):
        assert run(a.reset(seed)) == run(b.reset(seed))
        assert a.expert_turns() == b.expert_turns()
    tasks = {run(a.reset(s)) for s in range(50)}
    assert len(tasks) > 30  # seeds give different tasks
    # the same env instance replays a seed exactly, whatever ran before
    run(a.reset(3)); first = a.expert_turns()
    run(a.reset(4)); run(a.reset(3))
    assert a.expert_turns() == first


def test_expert_solves_every_episode_with_2_to_5_calls():
    env = ToyLookupEnv()
    hops = set()
    for seed in range(200):
        task, steps = run(expert_transcript(env, seed))
        assert task.startswith("Find the value for k")
        *calls, (ans, last) = steps
        assert last.done and last.reward == 1.0 and last.info["correct"]
        assert all(not r.done and r.reward == 0 and r.info["fault"] is Fault.NONE
                   and not r.info["tool_error"] and r.info["tool"] == "lookup" for _, r in calls)
        assert calls[-1][1].observation == ans[len("<answer>"):-len("</answer>")]
        hops.add(len(calls))
    assert hops == {2, 3, 4, 5}


def test_short_regular_strings():
    env = ToyLookupEnv()
    run(env.reset(0))
    assert len(env.system_prompt) < 300
    _, steps = run(expert_transcript(env, 0))
    for _, r in steps[:-1]:
        assert len(r.observation) == 3 and r.observation[0] in "kv"


def test_wrong_answers_and_early_answers_get_zero():
    env = ToyLookupEnv()
    for seed in range(30):
        run(env.reset(seed))
        turns = env.expert_turns()
        right = turns[-1]
        wrong = format_answer("v" + str((int(right[9:11]) + 1) % 100).zfill(2))
        for bad in (turns[:-1] + [wrong], [turns[0], right.replace("v", "k")], [format_answer("")]):
            _, res = run(_episode(env, seed, bad))
            assert res[-1].done and res[-1].reward == 0.0 and not res[-1].info["correct"]
        # guessing the right value without looking it up still is the right value
        _, res = run(_episode(env, seed, [right]))
        assert res[-1].reward == 1.0


def test_tool_errors_and_unknown_keys_and_truncation():
    env = ToyLookupEnv(max_turns=7)
    run(env.reset(1))
    r = run(env.step('<tool_call>{"name": "lookup", "arguments": {"k": "k01"}}</tool_call>'))
    assert not r.done and r.info["tool_error"] and r.info["tool"] == "lookup"
    assert r.observation == "error: lookup missing argument 'key'; expected lookup(key: string)"
    assert r.info["fault"] is Fault.NONE
    r = run(env.step("hmm"))
    assert r.info["tool_error"] and r.info["tool"] is None
    off_chain = next(f"k{i:02d}" for i in range(100) if f"k{i:02d}" not in env.table)
    r = run(env.step(format_tool_call("lookup", {"key": off_chain})))
    assert r.observation == "none" and not r.info["tool_error"]
    assert r.info["args"] == {"key": off_chain}  # the parsed arguments, for per-call records
    for _ in range(3):
        r = run(env.step("x"))
    assert not r.done
    r = run(env.step("x"))
    assert r.done and r.reward == 0 and r.info["truncated"] and r.info["turn"] == 7
    with pytest.raises(ValueError, match="call reset"):
        run(env.step(format_answer("v00")))


def test_bad_config_is_rejected():
    for kw, msg in [({"min_hops": 3, "max_hops": 2}, "min_hops"), ({"num_keys": 3}, "num_keys"),
                    ({"recoverable_rate": 1.5}, "recoverable_rate"),
                    ({"recoverable_rate": 0.6, "unrecoverable_rate": 0.6}, "<= 1"),
                    ({"unsolvable_frac": -0.1}, "unsolvable_frac"),
                    ({"latency_median_s": 0.2, "latency_p99_s": 0.1}, "p99_s"),
                    ({"tool_timeout_s": 0}, "timeout_s"), ({"max_turns": 3}, "max_turns")]:
        with pytest.raises(ValueError, match=msg):
            ToyLookupEnv(**kw)
    with pytest.raises(ValueError, match="unknown 'nope'"):
        make_env("nope")


def _fault_run(env, seeds, sample=0):
    """Expert turns with retries of recoverable faults; returns per-call fault kinds."""
    kinds = []

    async def go():
        for seed in seeds:
            await env.reset(seed, sample=sample)
            for t in env.expert_turns():
                while True:
                    r = await env.step(t)
                    if not r.info["tool_error"] and r.info["tool"] == "lookup":
                        kinds.append(r.info.get("fault_kind"))
                    if r.fault is not Fault.RECOVERABLE or r.done:
                        break
                if r.done:
                    break
    run(go())
    return kinds


def test_fault_rates_roughly_honoured_and_seeded():
    env = ToyLookupEnv(recoverable_rate=0.2, unrecoverable_rate=0.05, max_turns=60)
    kinds = _fault_run(env, range(400))
    n = len(kinds)
    rec, unrec = kinds.count("transient") / n, kinds.count("died") / n
    assert abs(rec - 0.2) < 4 * math.sqrt(0.2 * 0.8 / n)
    assert abs(unrec - 0.05) < 4 * math.sqrt(0.05 * 0.95 / n)
    assert _fault_run(env, range(400)) == kinds  # seeded: replays exactly
    assert _fault_run(env, range(400), sample=1) != kinds  # group members decorrelated
    other = ToyLookupEnv(recoverable_rate=0.2, unrecoverable_rate=0.05, max_turns=60, fault_seed=9)
    assert _fault_run(other, range(400)) != kinds


def test_unrecoverable_ends_episode_recoverable_does_not():
    env = ToyLookupEnv(unrecoverable_rate=1.0)
    run(env.reset(0))
    r = run(env.step(env.expert_turns()[0]))
    assert r.done and r.reward == 0 and r.fault is Fault.UNRECOVERABLE
    assert r.observation == "error: tool server died"
    env = ToyLookupEnv(recoverable_rate=1.0)
    run(env.reset(0))
    r = run(env.step(env.expert_turns()[0]))
    assert not r.done and r.fault is Fault.RECOVERABLE and r.info["fault_kind"] == "transient"


def test_latency_distribution_parameters():
    lat = LatencyModel(0.2, 2.0)
    rng = random.Random(0)
    xs = sorted(lat.sample(rng) for _ in range(40000))
    assert xs[len(xs) // 2] == pytest.approx(0.2, rel=0.05)
    assert xs[int(0.99 * len(xs))] == pytest.approx(2.0, rel=0.15)
    assert statistics.pstdev(math.log(x) for x in xs) == pytest.approx(lat.sigma, rel=0.03)
    assert LatencyModel().sample(rng) == 0.0


def test_env_sleeps_sampled_latency_and_times_out(monkeypatch):
    waits = []

    async def fake_sleep(s):
        waits.append(s)

    monkeypatch.setattr("arl.env.toy.asyncio.sleep", fake_sleep)
    env = ToyLookupEnv(latency_median_s=0.2, latency_p99_s=2.0, tool_timeout_s=1.0, max_turns=100)
    kinds = _fault_run(env, range(300))
    assert len(waits) == len(kinds) and max(waits) == 1.0
    assert statistics.median(waits) == pytest.approx(0.2, rel=0.2)
    # P(lognormal > 1 s) = P(z > ln 5 / sigma)
    p = 0.5 * math.erfc(math.log(5) / env.latency.sigma / math.sqrt(2))
    assert abs(kinds.count("timeout") / len(kinds) - p) < 4 * math.sqrt(p * (1 - p) / len(kinds))
    assert all(w == 1.0 for w, k in zip(waits, kinds) if k == "timeout")


def test_unsolvable_fraction():
    env = ToyLookupEnv(unsolvable_frac=0.3)
    flags = []
    for seed in range(500):
        run(env.reset(seed))
        flags.append(env.solvable)
        if not env.solvable:
            assert env.expert_turns() is None
    frac = 1 - sum(flags) / len(flags)
    assert abs(frac - 0.3) < 0.08
    # an unsolvable task loops: following the chain returns to the start; any answer earns 0
    seed = flags.index(False)
    task = run(env.reset(seed))
    key = task.split()[-1].rstrip(".")
    seen = []
    for _ in range(6):
        key = run(env.step(format_tool_call("lookup", {"key": key}))).observation
        seen.append(key)
    assert all(k.startswith("k") for k in seen) and seen[0] in seen[1:]
    r = run(env.step(format_answer("v00")))
    assert r.done and r.reward == 0 and r.info["solvable"] is False
    # the same seeds are solvable tasks with the same chain start when the fraction is 0
    assert run(ToyLookupEnv().reset(seed)) == task


def test_new_state_marks_first_reveal_of_a_chain_key_only():
    env = make_env("toy_lookup")
    run(env.reset(5))
    first = env.chain[0]
    steps = [format_tool_call("lookup", {"key": first}),  # reveals chain[1] (or the value)
             format_tool_call("lookup", {"key": first}),  # the same again: no progress
             format_tool_call("lookup", {"key": "k99" if "k99" not in env.chain else "k98"})]  # off the chain
    _, res = run(_episode(env, 5, steps))
    assert [r.info["new_state"] for r in res] == [True, False, False]
    assert res[2].observation == "none"
