"""The long-horizon task (arl/env/long_lookup.py): seeded tasks, an expert that solves every one,
forks whose trap wastes the episode, distractor tools, error observations, ``new_state`` per turn,
the blind demonstrator (harmless forks, a branch at random), marked keys and the demonstrator's
needless checks of them (the config's form)."""
import asyncio

import pytest

from arl.config import load_config
from arl.data.tasks import EVAL_SEED_BASE
from arl.env import env_class, make_env
from arl.env.expert import expert_transcript
from arl.env.long_lookup import DEAD_END, LongLookupEnv, fork_ways
from arl.env.toolcall import format_answer, format_tool_call
from arl.rollout.expert import expert_env_kwargs


def run(coro):
    return asyncio.run(coro)


def lookup(key):
    return format_tool_call("lookup", {"key": key})


async def play(env, seed, turns):
    await env.reset(seed)
    out = []
    for t in turns:
        r = await env.step(t)
        out.append(r)
        if r.done:
            break
    return out


def fork_of(env, i):
    """(right, trap) keys of the fork on chain key ``i``'s lookup."""
    go_key, no_key, _ = fork_ways(env.table[env.chain[i]])
    return go_key, no_key


def test_registered_and_deterministic_with_disjoint_heldout():
    a, b = make_env("long_lookup"), make_env("long_lookup")
    for seed in (0, 1, 7, EVAL_SEED_BASE + 3):
        assert run(a.reset(seed)) == run(b.reset(seed))
        assert a.expert_turns() == b.expert_turns() and a.table == b.table
    run(a.reset(3)); first = a.expert_turns()
    run(a.reset(4)); run(a.reset(3))
    assert a.expert_turns() == first  # a seed replays exactly, whatever ran before
    train, held = set(), set()
    for s in range(200):
        run(a.reset(s)); train.add(tuple(a.chain))
        run(a.reset(EVAL_SEED_BASE + s)); held.add(tuple(a.chain))
    assert len(train) == len(held) == 200 and not train & held  # held-out tasks are not training tasks


def test_expert_solves_every_task_with_12_to_16_calls_and_3_to_4_forks():
    env = LongLookupEnv()
    calls_seen, forks_seen = set(), set()
    for seed in range(150):
        task, steps = run(expert_transcript(env, seed))
        assert task == f"Find the value for {env.chain[0]}."
        *calls, (ans, last) = steps
        assert last.done and last.reward == 1.0 and last.info["correct"]
        assert all(not r.done and r.info["new_state"] and not r.info["tool_error"] for _, r in calls)
        assert sum(r.info["fork"] for _, r in calls) == len(env.forks)
        calls_seen.add(len(calls))
        forks_seen.add(len(env.forks))
        assert env.budget == len(calls) + 2  # every lookup, the answer, one spare turn
    assert calls_seen == set(range(12, 17)) and forks_seen == {3, 4}


def test_fork_shows_go_and_no_in_either_order():
    env = LongLookupEnv()
    orders, go_letters = set(), set()
    for seed in range(40):
        run(env.reset(seed))
        for i in env.forks:
            obs = env.table[env.chain[i]].split()
            assert len(obs) == 5 and obs[0] == "fork:" and sorted(obs[1::2]) == ["go", "no"]  # marker, key
            right, trap = fork_of(env, i)
            assert right == env.chain[i + 1] and trap not in env.chain
            # twins: one key, two different letters; the letter alone does not tell the way either
            assert right[1:] == trap[1:] and right[0] != trap[0] and {right[0], trap[0]} <= set("abcdefgh")
            orders.add(obs[1])
            go_letters.add(right[0])
    assert orders == {"go", "no"} and go_letters == set("abcdefgh")  # position alone does not tell the way


def test_a_trap_at_the_first_fork_wastes_the_episode():
    env = LongLookupEnv()

    async def trapped(seed):
        await env.reset(seed)
        f = env.forks[0]
        for k in env.chain[:f + 1]:
            assert not (await env.step(lookup(k))).done
        r = await env.step(lookup(fork_of(env, f)[1]))
        wasted = 1
        while not r.done and r.observation != DEAD_END:  # decoys look like chain keys
            assert r.observation.startswith("k") and not r.info["new_state"] and not r.info["dead_end"]
            r = await env.step(lookup(r.observation))
            wasted += 1
        assert r.done or r.info["dead_end"]
        for t in env.expert_turns()[f + 1:]:  # the way back: the right key and the rest of the chain
            if r.done:
                break
            r = await env.step(t)
        return r, wasted

    for seed in range(30):
        r, wasted = run(trapped(seed))
        assert wasted == 1 + env.decoy_hops
        assert r.done and r.reward == 0.0 and r.info["truncated"] and env.turns == env.budget


def test_wrong_or_early_answers_and_budget_get_zero():
    env = LongLookupEnv()
    for seed in range(20):
        run(env.reset(seed))
        turns = env.expert_turns()
        wrong = format_answer("v" + str((int(env.value[1:]) + 1) % 100).zfill(2))
        for bad in (turns[:-1] + [wrong], [turns[0], format_answer(env.chain[1])], [format_answer("")]):
            res = run(play(env, seed, bad))
            assert res[-1].done and res[-1].reward == 0.0 and not res[-1].info["correct"]
        # repeating a lookup is no progress, and the spare turns run out
        res = run(play(env, seed, [turns[0]] * 40))
        assert [r.info["new_state"] for r in res] == [True] + [False] * (len(res) - 1)
        assert len(res) == env.budget and res[-1].done and res[-1].reward == 0.0


def test_malformed_turns_get_an_error_observation_and_cost_a_turn():
    env = LongLookupEnv()
    run(env.reset(0))
    bad = ["", "lookup k17", "<tool_call>{bad json</tool_call>", '<tool_call>{"name": "open", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "lookup", "arguments": {"key": 17}}</tool_call>', "<answer>v1", None, "\x00" * 50]
    for i, text in enumerate(bad, 1):
        r = run(env.step(text))
        assert r.observation.startswith("error: ") and r.info["tool_error"] and not r.info["new_state"]
        assert r.info["turn"] == i and r.reward == 0.0 and not r.done
    r = run(env.step(lookup("k99999")))
    assert r.observation == "none" and not r.info["new_state"]


def test_distractor_tools_never_help():
    env = LongLookupEnv()
    for seed in range(20):
        run(env.reset(seed))
        trap = fork_of(env, env.forks[0])[1]
        peeks = [format_tool_call("peek", {"key": k}) for k in (env.chain[0], trap, "k99999")]
        res = run(play(env, seed, peeks + [format_tool_call("values", {})]))
        assert [r.observation for r in res[:3]] == ["yes", "yes", "no"]  # decoys exist too
        vals = res[3].observation.split()
        assert len(vals) == 3 and env.value in vals and len(set(vals)) == 3
        assert not any(r.info["new_state"] or r.info["tool_error"] for r in res)


def test_guessing_cannot_skip_the_chain_or_the_value():
    env = LongLookupEnv()
    for seed in range(20):
        run(env.reset(seed))
        # a later chain key, guessed: none (it is on the chain but was never shown), a turn used
        res = run(play(env, seed, [lookup(env.chain[3]), lookup(env.chain[0])]))
        assert res[0].observation == "none" and not res[0].info["new_state"]
        assert res[1].info["new_state"] or res[1].info["fork"]
        # values() shows the value, but an answer before the chain's last lookup showed it is wrong
        res = run(play(env, seed, [format_tool_call("values", {}), format_answer(env.value)]))
        assert res[-1].done and res[-1].reward == 0.0 and not res[-1].info["correct"]
    # turning back at once after a trap's first key fits the one spare turn
    run(env.reset(0))
    i = env.forks[0]
    right, trap = fork_of(env, i)
    turns = [lookup(k) for k in env.chain[:i + 1]] + [lookup(trap)] + [lookup(k) for k in env.chain[i + 1:]]
    res = run(play(env, 0, turns + [format_answer(env.value)]))
    assert res[-1].reward == 1.0 and env.slack == 1


BLIND = {"min_hops": 12, "max_hops": 16, "min_forks": 3, "max_forks": 4, "decoy_hops": 2, "slack": 1, "max_turns": 18}


def test_blind_demonstrator_shows_forks_but_carries_no_information_about_go():
    kw = env_class("long_lookup").demo_kwargs(BLIND)
    demo, run_env = make_env("long_lookup", **kw), make_env("long_lookup", **BLIND)
    assert demo.blind_forks and not run_env.blind_forks
    followed_go = followed_first = forks = 0
    for seed in range(2_000_000, 2_000_200):
        run(demo.reset(seed))
        turns = demo.expert_turns()
        res = run(play(demo, seed, turns))
        assert res[-1].reward == 1.0 and res[-1].info["correct"]  # a harmless trap still solves the task
        assert 3 <= len(demo.forks) <= 4  # the run's own fork count
        for i in demo.forks:
            right, trap = fork_of(demo, i)
            took = turns[i + 1]
            assert took in (lookup(right), lookup(trap))
            forks += 1
            followed_go += took == lookup(right)
            go_key, no_key, go_first = fork_ways(demo.table[demo.chain[i]])
            followed_first += took == lookup(go_key if go_first else no_key)
    # the choice is a coin flip: independent of go and of the position go is listed at
    assert 0.4 < followed_go / forks < 0.6 and 0.4 < followed_first / forks < 0.6, (followed_go, followed_first, forks)
    # the run's own tasks keep the real traps, and the same seed gives the same task
    run(run_env.reset(2_000_000)); run(demo.reset(2_000_000))
    assert run_env.chain == demo.chain and run_env.forks == demo.forks
    right, trap = fork_of(run_env, run_env.forks[0])
    assert run_env.table[trap] != run_env.table[right]


def test_demo_forks_sets_the_demonstrators_fork_count():
    assert LongLookupEnv.demo_kwargs({"demo_forks": 0, "min_forks": 3}) == {
        "demo_forks": 0, "min_forks": 0, "max_forks": 0, "blind_forks": True}
    assert LongLookupEnv.demo_kwargs({"min_forks": 3}) == {"min_forks": 3, "blind_forks": True}
    plain = make_env("long_lookup", **LongLookupEnv.demo_kwargs({"demo_forks": 0}))
    run(plain.reset(5))
    assert plain.forks == []


@pytest.mark.parametrize("kwargs, msg", [
    ({"min_hops": 10, "max_hops": 8}, "min_hops/max_hops"),
    ({"min_forks": 5, "max_forks": 4}, "min_forks/max_forks"),
    ({"max_forks": 12}, "min_forks/max_forks"),
    ({"num_keys": 20}, "num_keys"),
    ({"max_turns": 10}, "max_turns"),
    ({"slack": -1}, "decoy_hops/slack"),
    ({"demo_forks": 20}, "demo_forks"),
    ({"blind_forks": "yes"}, "blind_forks"),
])
def test_bad_arguments_fail_with_one_line(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        LongLookupEnv(**kwargs)
    assert "\n" not in str(e.value)


def test_step_before_reset_and_bad_seed_raise():
    env = LongLookupEnv()
    with pytest.raises(ValueError, match="no episode"):
        run(env.step(lookup("k01")))
    with pytest.raises(ValueError, match="seed must be an int"):
        run(env.reset("0"))


def test_expert_demos_take_the_demonstrator_or_given_env_kwargs(tiny_tokenizer):
    """The SFT data comes from the demonstrator (the config's: needless checks of marked keys);
    ``env_kwargs`` gives the expert on the run's own tasks (probe_long_lookup.py --sighted-sft):
    every fork call follows go there, and no key is checked."""
    from arl.rollout.episode import ChatFormat
    from arl.rollout.expert import expert_demos

    cfg = load_config("configs/long_horizon_cpu.yaml")
    fmt = ChatFormat(tiny_tokenizer)
    sighted = expert_demos(cfg, fmt, 3, env_kwargs=expert_env_kwargs(cfg, keep_task_definition=True))
    blind = expert_demos(cfg, fmt, 3)
    env, demo = make_env("long_lookup", **expert_env_kwargs(cfg, True)), make_env(
        "long_lookup", **LongLookupEnv.demo_kwargs(expert_env_kwargs(cfg, False)))
    for trajs, e in ((sighted, env), (blind, demo)):
        assert len(trajs) == 3 and all(t.reward == 1.0 for t in trajs)
        for k, t in enumerate(trajs):
            run(e.reset(2_000_000 + k))
            text = tiny_tokenizer.decode(t.tokens)
            assert all(x in text for x in e.expert_turns())  # the expert: the chain; the demonstrator: its coins
    assert sum(tiny_tokenizer.decode(t.tokens).count('"peek"') for t in blind) > 0
    assert not any('"name": "peek"' in tiny_tokenizer.decode(t.tokens) for t in sighted)
    run(env.reset(2_000_000))
    assert env.expert_turns() == [lookup(k) for k in env.chain] + [format_answer(env.value)]


def test_each_fork_choice_is_counted_by_the_way_it_took():
    env = LongLookupEnv()

    async def counts(seed, trap_at):
        await env.reset(seed)
        turns, out = env.expert_turns(), []
        for k, t in enumerate(turns):
            if k - 1 == trap_at:
                t = lookup(fork_of(env, trap_at)[1])
            r = await env.step(t)
            out.append(r.info.get("counts"))
            if r.done or k - 1 == trap_at:
                break
        return out

    run(env.reset(5))
    forks = list(env.forks)
    seen = run(counts(5, None))
    # only the turn right after a fork reports counts: the way it took
    assert [k - 1 for k, c in enumerate(seen) if c] == forks
    assert all(c == {"fork_seen": 1, "fork_go": True, "fork_no": False} for c in seen if c)
    trapped = run(counts(5, forks[0]))
    assert trapped[-1] == {"fork_seen": 1, "fork_go": False, "fork_no": True}


MARKED = {**BLIND, "fork_order": "go_last", "demo_blind": False, "marks": 0.4, "demo_checks": 0.7, "max_turns": 22}


def test_go_last_lists_the_go_way_second_and_keeps_the_tasks():
    """``fork_order: go_last`` changes only where a fork lists its go way (same chains, same forks)."""
    rand, last = LongLookupEnv(), LongLookupEnv(fork_order="go_last")
    for seed in range(40):
        run(rand.reset(seed)); run(last.reset(seed))
        assert rand.chain == last.chain and rand.forks == last.forks
        for i in last.forks:
            go_key, no_key, go_first = fork_ways(last.table[last.chain[i]])
            assert not go_first and (go_key, no_key) == fork_ways(rand.table[rand.chain[i]])[:2]


def test_marked_keys_show_a_mark_that_changes_nothing_else():
    plain, marked = LongLookupEnv(), LongLookupEnv(marks=0.4)
    n_marked = n_markable = 0
    for seed in range(200):
        run(plain.reset(seed)); run(marked.reset(seed))
        assert plain.chain == marked.chain and plain.forks == marked.forks and plain.marked == []
        for j in marked.marked:  # the lookup that shows key j marks it; never a fork's answer
            assert j - 1 not in marked.forks and marked.table[marked.chain[j - 1]] == f"{marked.chain[j]} ?"
        n_marked += len(marked.marked)
        n_markable += len(marked.chain) - 1 - len(marked.forks)
        res = run(play(marked, seed, marked.expert_turns()))  # the expert ignores marks and solves it
        assert res[-1].reward == 1.0 and not any('"peek"' in t for t in marked.expert_turns())
    assert 0.35 < n_marked / n_markable < 0.45


def test_demonstrator_checks_marked_keys_needlessly_and_still_succeeds():
    kw = LongLookupEnv.demo_kwargs(MARKED)
    assert kw["checks"] == 0.7 and kw["slack"] == 22 - 17 and "blind_forks" not in kw
    demo, run_env = LongLookupEnv(**kw), LongLookupEnv(**MARKED)
    checks = marks = 0
    for seed in range(2_000_000, 2_000_200):
        run(demo.reset(seed))
        turns = demo.expert_turns()
        assert len(turns) <= 22
        res = run(play(demo, seed, turns))
        assert res[-1].reward == 1.0
        peeks = [k for k, t in enumerate(turns) if '"peek"' in t]
        for k in peeks:  # a check is a peek of the very key looked up next, and only of a marked one
            assert turns[k + 1] == turns[k].replace('"peek"', '"lookup"')
        marks += len(demo.marked)
        checks += len(peeks)
    assert 0.6 < checks / marks < 0.75, (checks, marks)
    # the run's own task: checking two marked keys spends the one spare turn and then some
    seed = next(s for s in range(100) if run(run_env.reset(s)) and len(run_env.marked) >= 2)
    turns = []
    for j, k in enumerate(run_env.chain):
        if j in run_env.marked:
            turns.append(format_tool_call("peek", {"key": k}))
        turns.append(lookup(k))
    res = run(play(run_env, seed, turns + [format_answer(run_env.value)]))
    assert res[-1].reward == 0.0 and res[-1].info.get("truncated")


@pytest.mark.parametrize("kwargs, msg", [
    ({"fork_order": "go_first"}, "fork_order"),
    ({"marks": 1.0}, "marks"),
    ({"demo_checks": -0.1}, "demo_checks"),
    ({"checks": "often"}, "checks"),
    ({"demo_blind": 1}, "demo_blind"),
])
def test_bad_mark_and_order_arguments_fail_with_one_line(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        LongLookupEnv(**kwargs)
    assert "\n" not in str(e.value)


def test_each_turn_after_a_mark_is_counted_checked_or_not():
    env = LongLookupEnv(**MARKED)
    seed = next(s for s in range(100) if run(env.reset(s)) and len(env.marked) >= 2)
    first, second = env.marked[:2]
    turns = []
    for j, k in enumerate(env.chain):
        if j == first:  # check the first marked key, not the second
            turns.append(format_tool_call("peek", {"key": k}))
        turns.append(lookup(k))
    res = run(play(env, seed, turns + [format_answer(env.value)]))
    counts = [r.info.get("counts") for r in res if r.info.get("counts") and "mark_seen" in r.info["counts"]]
    assert counts == [{"mark_seen": 1, "mark_checked": True}] + [{"mark_seen": 1, "mark_checked": False}] * (
        len(env.marked) - 1)
    assert res[-1].reward == 1.0  # one check fits the spare turn
