"""BFCL as arl environments (arl/env/bfcl/): on hand-written generations
(tests/fixtures/bfcl_generations.json), arl's rewards equal BFCL's own checkers called directly
(tests/bfcl_ref.py): the AST checker, the irrelevance rule, the multi-turn checker on trajectories
including a wrong final state; BFCL's types as JSON schema; bad input is one line."""
import asyncio
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("bfcl_eval", reason="bash install.sh --bfcl")

from arl.config import load_config  # noqa: E402
from arl.env import make_env  # noqa: E402
from arl.env.bfcl import INSTALL_HINT, bfcl, load_entries, loader, scoring  # noqa: E402
from bfcl_ref import CATEGORIES, FIXTURE, bfcl_convert_to_function_call, ref_multi_turn, ref_single  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in load_entries(CATEGORIES, limit=4)}


# -- single turn ---------------------------------------------------------------------------------
async def play(env, entry, texts, seed=0):
    await env.reset(seed, task=entry)
    for text in texts:
        res = await env.step(text)
        if res.done:
            return res
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("gen", FIXTURE["single_turn"], ids=[g["what"] for g in FIXTURE["single_turn"]])
def test_single_turn_reward_is_bfcls_verdict(gen, rows):
    entry = rows[gen["id"]]
    env = make_env("bfcl", categories=[entry["category"]])
    res = asyncio.run(play(env, entry, [gen["text"]]))
    want = ref_single(entry, gen["text"])
    assert res.done and res.reward == float(want) and env.verdict["valid"] is want
    assert res.info["reward_components"] == {"bfcl": float(want)}


def test_fixture_holds_right_and_wrong_answers(rows):
    verdicts = {g["what"]: ref_single(rows[g["id"]], g["text"]) for g in FIXTURE["single_turn"]}
    assert 3 <= sum(verdicts.values()) <= len(verdicts) - 5, verdicts


# -- multi turn ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gen", FIXTURE["multi_turn"], ids=[g["what"] for g in FIXTURE["multi_turn"]])
def test_multi_turn_reward_is_bfcls_checker(gen, rows, tmp_path):
    entry = rows[gen["id"]]
    env = make_env("bfcl", categories=["multi_turn_base"])
    texts = [t for turn in gen["turns"] for t in turn]
    res = asyncio.run(play(env, entry, texts))
    assert res.reward == float(ref_multi_turn(entry, gen["turns"])), env.verdict
    assert not Path("/tmp/arl_bfcl_must_not_exist").exists()  # a builtin's name never reaches eval
    asyncio.run(env.close())
    assert not [k for k in bfcl().executor_globals if k.startswith("arl_") and k.endswith("_instance")]


def test_multi_turn_verdicts_differ_across_the_fixture(rows):
    got = [ref_multi_turn(rows[g["id"]], g["turns"]) for g in FIXTURE["multi_turn"]]
    assert got[0] and not got[1] and not got[4], got


def test_multi_turn_episode_feeds_user_turns_and_runs_bfcls_classes(rows):
    entry = rows["multi_turn_base_1"]
    env = make_env("bfcl", categories=["multi_turn_base"])

    async def go():
        first = await env.reset(0, task=entry)
        assert first[-1]["role"] == "user" and "alex" in first[-1]["content"]
        r1 = await env.step(FIXTURE["multi_turn"][0]["turns"][0][0])
        assert env.observation_role == "tool" and "workspace" in r1.observation[0]
        r2 = await env.step("Here it is.")
        assert env.observation_role == "user" and r2.observation == entry["question"][1][0]["content"]
        await env.close()

    asyncio.run(go())


def test_turn_credit_shapes_failures_below_every_success(rows):
    entry = rows["multi_turn_base_1"]
    env = make_env("bfcl", categories=["multi_turn_base"], turn_credit=0.5)
    flat = lambda g: [t for turn in g["turns"] for t in turn]  # noqa: E731
    ok = asyncio.run(play(env, entry, flat(FIXTURE["multi_turn"][0])))
    wrong = asyncio.run(play(env, entry, flat(FIXTURE["multi_turn"][1])))
    assert ok.reward == 1.0 and ok.info["reward_components"] == {"bfcl": 1.0, "turn_credit": 0.0}
    # turn 0 passes BFCL's checker, turn 1 moves the file elsewhere: 1 of 4 turns
    assert wrong.info["reward_components"] == {"bfcl": 0.0, "turn_credit": 0.5 * 1 / 4}
    with pytest.raises(ValueError, match=r"turn_credit: must be in \[0, 1\)"):
        make_env("bfcl", categories=["multi_turn_base"], turn_credit=1.0)


# -- schemas and call strings ------------------------------------------------------------------------
def test_bfcl_types_map_to_json_schema():
    doc = {"name": "f", "description": "d", "parameters": {"type": "dict", "required": ["a"], "properties": {
        "a": {"type": "float", "description": "x"}, "b": {"type": "tuple", "items": {"type": "integer"}},
        "c": {"type": "any"}, "d": {"type": "dict", "properties": {"e": {"type": "boolean"}}, "required": ["e"]},
        "f": {"type": "array", "items": {"type": "dict", "properties": {"g": {"type": "string"}}}}}}}
    p = loader.tool_schema(doc)["function"]["parameters"]
    assert p["type"] == "object" and p["required"] == ["a"]
    assert [p["properties"][k]["type"] for k in "abcdf"] == ["number", "array", "string", "object", "array"]
    assert p["properties"]["b"]["items"] == {"type": "integer"} and p["properties"]["d"]["required"] == ["e"]
    assert p["properties"]["f"]["items"]["properties"]["g"] == {"type": "string"}


def test_every_function_doc_is_a_valid_json_schema():
    for r in load_entries(["simple_python", "live_multiple", "parallel_multiple", "multi_turn_base"], limit=30):
        for d in r["function"]:
            jsonschema.Draft202012Validator.check_schema(loader.tool_schema(d)["function"]["parameters"])


def test_call_strings_are_bfcls():
    convert = bfcl_convert_to_function_call()
    for name, args in [("cd", {"folder": "a'b"}), ("mv", {"source": "x", "destination": "y"}), ("ls", {}),
                       ("f", {"n": 1.5, "l": [1, "a"], "d": {"k": None}, "b": True})]:
        assert scoring.call_string(name, args) == convert([{name: args}])[0]


# -- bad input, one line each ----------------------------------------------------------------------
def test_bfcl_not_installed_is_one_line(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    bfcl.cache_clear()
    try:
        with pytest.raises(ValueError) as e:
            make_env("bfcl", categories=["simple_python"])
        assert str(e.value) == INSTALL_HINT == "bfcl: bfcl-eval is not installed: bash install.sh --bfcl"
    finally:
        monkeypatch.undo()
        bfcl.cache_clear()


def test_unknown_category_names_the_known_ones():
    with pytest.raises(ValueError, match=r"^bfcl: unknown category 'simple_js'; known: simple_python, multiple, .*"
                                         r"multi_turn_base"):
        make_env("bfcl", categories=["simple_js"])


def test_config_names_the_env():
    cfg = load_config(None, ["env.name=bfcl", "env.kwargs={}", 'env.kwargs.categories=["live_simple"]'])
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    first = asyncio.run(env.reset(3))
    assert env.rows[3]["id"] == "live_simple_3-2-1" and first[-1]["content"].startswith("I need a 'Plus'")


def test_a_pool_of_envs_shares_the_rows_and_episodes_leave_them_alone(rows):
    a, b = (make_env("bfcl", categories=["multi_turn_base"], limit=2) for _ in range(2))
    assert a.rows[1] is b.rows[1]
    before = repr(a.rows[1])
    asyncio.run(play(a, None, [t for turn in FIXTURE["multi_turn"][0]["turns"] for t in turn], seed=1))
    assert a.verdict["valid"] and repr(b.rows[1]) == before
