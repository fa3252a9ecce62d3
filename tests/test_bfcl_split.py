"""The BFCL recipe's split (examples/bfcl/split.json, arl/env/bfcl/split.py): no function the train
split holds is named in any row of a held-out (or otherwise untrained) category; the file is what
its maker writes; the env plays train rows for training seeds and held-out rows for held-out seeds;
the SFT demonstrations (BFCL's ground truth as hermes calls) pass BFCL's own checker."""
import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval", reason="bash install.sh --bfcl")

from arl.config import EVAL_SEED_BASE  # noqa: E402
from arl.env import make_env  # noqa: E402
from arl.env.bfcl import CATEGORIES, load_entries  # noqa: E402
from arl.env.bfcl import split as bsplit  # noqa: E402
from arl.env.bfcl.env import DEMO_SEED_BASE, REFUSAL  # noqa: E402
from arl.eval_bfcl import main as eval_main, parse_args, resolve  # noqa: E402

SPLIT = Path(__file__).resolve().parents[1] / "examples" / "bfcl" / "split.json"


@pytest.fixture(scope="module")
def doc():
    return json.loads(SPLIT.read_text())


def _names(row):
    return {d["name"] for d in row["function"]}


def test_no_train_function_appears_in_any_held_out_row(doc):
    train = set().union(*(_names(bsplit.row(i)) for i in doc["train"]))
    untrained = [c for c in CATEGORIES if c not in doc["train_categories"]]
    assert set(doc["held_out"]) | set(doc["not_trained"]) == set(untrained)
    for c in ("live_simple", "live_multiple", "parallel", "irrelevance", "live_irrelevance"):
        assert c in doc["held_out"]
    for r in load_entries(untrained, copy_rows=False):  # every row of those categories, not only the listed ones
        assert not (_names(r) & train), (r["id"], _names(r) & train)


def test_split_rows_are_their_categories_and_the_file_is_fresh(doc):
    assert bsplit.make_split(doc["seed"]) == doc  # python -m examples.bfcl.make_split rewrites it
    assert all(bsplit.category_of(i.split("|")[0]) in doc["train_categories"] for i in doc["train"])
    for c, ids in doc["held_out"].items():
        assert ids and all(bsplit.category_of(i) == c for i in ids) and len(set(ids)) == len(ids)
    pairs = [i for i in doc["train"] if "|" in i]
    assert 0.1 * len(doc["train"]) < len(pairs) == doc["irrelevance_rows"]
    for p in pairs:  # the question of one train row with another's functions: nothing to call
        a, b = p.split("|")
        assert not (_names(bsplit.row(a)) & _names(bsplit.row(b)))
        assert bsplit.row(p)["category"] == "irrelevance"


def test_env_plays_train_rows_then_held_out_rows_round_robin(doc):
    env = make_env("bfcl", split=str(SPLIT))

    async def ids(seeds):
        out = []
        for s in seeds:
            await env.reset(s)
            out.append(env.entry["id"])
        return out

    assert asyncio.run(ids(range(3))) == doc["train"][:3]
    assert asyncio.run(ids([DEMO_SEED_BASE + 1])) == [doc["train"][(DEMO_SEED_BASE + 1) % len(doc["train"])]]
    cats = list(doc["held_out"])
    got = asyncio.run(ids(range(EVAL_SEED_BASE, EVAL_SEED_BASE + 2 * len(cats))))
    assert got == [doc["held_out"][c][k] for k in range(2) for c in cats]


def test_expert_demonstrations_pass_bfcls_checker(doc):
    env = make_env("bfcl", split=str(SPLIT))

    async def play(seed):
        await env.reset(seed)
        turns = env.expert_turns()
        return env.kind, turns[0], (await env.step(turns[0])).reward

    results = [asyncio.run(play(s)) for s in range(0, len(doc["train"]), 5)]
    ast = [r for k, _, r in results if k == "ast"]
    assert all(t.startswith("<tool_call>") for k, t, _ in results if k == "ast")
    assert all(t == REFUSAL and r == 1.0 for k, t, r in results if k == "irrelevance")
    assert sum(ast) >= 0.97 * len(ast)  # BFCL's ground truth holds a few rows its own checker rejects


def test_eval_split_plays_the_held_out_rows(doc, tiny_model_dir):
    args = parse_args(["--bench", "bfcl", "--model", str(tiny_model_dir), "--split", str(SPLIT), "--limit", "2"])
    cfg, _, categories, _ = resolve(args)
    assert categories == list(doc["held_out"])
    rows = bsplit.held_out_rows(str(SPLIT), categories, 2)
    assert [r["id"] for r in rows] == [i for c in categories for i in doc["held_out"][c][:2]]


@pytest.mark.parametrize("argv,msg", [
    (["--split", "nope.json"], "split file nope.json not found"),
    (["--split", "SPLIT", "--categories", "simple_python"], "is not held out in"),
])
def test_split_errors_are_one_line(argv, msg, capsys, tiny_model_dir):
    argv = [str(SPLIT) if a == "SPLIT" else a for a in argv]
    assert eval_main(["--bench", "bfcl", "--model", str(tiny_model_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_unknown_row_id_is_one_line():
    with pytest.raises(ValueError, match="unknown row id 'simple_python_99999'"):
        bsplit.row("simple_python_99999")



def test_recipe_reads_a_held_out_evaluation_by_category(doc, tmp_path):
    from examples.bfcl.recipe import from_heldout, table

    cats = list(doc["held_out"])  # task i is held-out row i, round robin over the categories
    path = tmp_path / "heldout_step0.jsonl"
    path.write_text("".join(json.dumps({"task": i, "success": cats[i % len(cats)] == "live_simple" or i < len(cats)})
                            + "\n" for i in range(4 * len(cats))))
    got = from_heldout(path)
    assert got["live_simple"] == 100.0 and got["parallel"] == 25.0 and got["irrelevance"] == 25.0
    assert got["held_out_ast_mean"] == round((100 + 25 + 25) / 3, 1)
    assert "| sft | 100.0 |" in table([{"sft": got}])


def test_sft_demonstrations_end_the_turn_as_the_engine_does(tiny_tokenizer):
    """BFCL's turns end at end of sequence (several calls may come first): each demonstration's
    turn ends with the end-of-sequence token, which SFT then teaches; a turn that ends on a stop
    string (the default envs' ``</tool_call>``) gets none, as sampling stops there."""
    from arl.config import load_config
    from arl.rollout import ChatFormat
    from arl.rollout.episode import Episode, EpisodeConfig
    from arl.rollout.expert import expert_demos, written_turn

    fmt = ChatFormat(tiny_tokenizer)
    cfg = load_config(str(SPLIT.parent / "config.yaml"), ["model.name_or_path=tiny"])
    demos = expert_demos(cfg, fmt, 3)
    assert len(demos) == 3
    for t in demos:
        start, end = t.turns[-1]
        assert end == len(t.tokens) and t.tokens[-1] == fmt.eos_token_id
        assert all(c == len(t.turns) - 1 for c in t.chunk_ids[start:end])
    ep = Episode(make_env("bfcl", split=str(SPLIT)), fmt, EpisodeConfig(), 0)
    assert written_turn(ep, "<tool_call>{}</tool_call>").token_ids[-1] == fmt.eos_token_id
    ep.env = type("Default", (), {})()  # no stop attribute: the default stop strings
    ids = written_turn(ep, "<tool_call>{}</tool_call>").token_ids
    assert ids == fmt.encode("<tool_call>{}</tool_call>")


def test_malformed_call_penalty_shapes_train_irrelevance_rows_only(doc):
    """A botched call on an irrelevance row is none by BFCL's rule (1.0); with the penalty a train
    row pays it back (named part ``malformed_call``), a held-out row keeps BFCL's verdict."""
    train = next(i for i, r in enumerate(doc["train"]) if "|" in r)  # an irrelevance-style train row
    held = EVAL_SEED_BASE + list(doc["held_out"]).index("irrelevance")
    botched, refusal = '<tool_call>\n{"name": "f", arguments: {}}\n</tool_call>', REFUSAL

    async def play(seed, text, **kw):
        env = make_env("bfcl", split=str(SPLIT), **kw)
        await env.reset(seed)
        res = await env.step(text)
        return env.kind, res.reward, res.info["reward_components"]

    assert asyncio.run(play(train, botched)) == ("irrelevance", 1.0, {"bfcl": 1.0})
    on = dict(malformed_call_penalty=True)
    assert asyncio.run(play(train, botched, **on)) == ("irrelevance", 0.0, {"bfcl": 1.0, "malformed_call": -1.0})
    assert asyncio.run(play(train, refusal, **on)) == ("irrelevance", 1.0, {"bfcl": 1.0, "malformed_call": 0.0})
    assert asyncio.run(play(held, botched, **on))[:2] == ("irrelevance", 1.0)


def test_ast_credit_scores_a_failed_train_turn_by_the_share_it_gets_right(doc):
    """``ast_credit``: a failed AST turn on a train row earns the credit times the share BFCL's checker
    passes one argument at a time; a valid turn 1.0 (part 0); held-out rows keep BFCL's 0/1."""
    env = make_env("bfcl", split=str(SPLIT), ast_credit=0.5)
    seed = next(i for i, r in enumerate(doc["train"]) if r.startswith("simple_python")
                and len(next(iter(bsplit.row(r)["ground_truth"][0].values()))) >= 2)

    async def play(text, s=seed):
        await env.reset(s)
        res = await env.step(text)
        return res.reward, res.info["reward_components"]

    asyncio.run(env.reset(seed))
    (name, answers), = env.entry["ground_truth"][0].items()
    right = {k: v[0] for k, v in answers.items() if v[0] != ""}
    call = lambda args, n=name: env.parser.format_calls("", [{"name": n, "arguments": args}])  # noqa: E731
    assert asyncio.run(play(call(right))) == (1.0, {"bfcl": 1.0, "ast_credit": 0.0})
    k = next(iter(right))
    wrong = dict(right, **{k: "arl-not-an-answer" if not isinstance(right[k], str) else 12345})
    n = len(answers)
    assert asyncio.run(play(call(wrong))) == pytest.approx((0.5 * n / (1 + n), {"bfcl": 0.0, "ast_credit": 0.5 * n / (1 + n)}))
    extra = dict(right, arl_extra=1)
    assert asyncio.run(play(call(extra)))[0] == pytest.approx(0.5 * (1 + n) / (2 + n))
    assert asyncio.run(play(call(right, "arl_other_function")))[0] == 0.0
    twice = env.parser.format_calls("", [{"name": name, "arguments": right}] * 2)
    assert asyncio.run(play(twice))[0] == pytest.approx(0.5 * 0.5)  # one expected call, two made
    assert asyncio.run(play("I cannot help."))[0] == 0.0
    held = EVAL_SEED_BASE + list(doc["held_out"]).index("live_simple")
    assert set(asyncio.run(play("<tool_call>\n{}\n</tool_call>", held))[1]) == {"bfcl"}
    with pytest.raises(ValueError, match="ast_credit: must be in"):
        make_env("bfcl", split=str(SPLIT), ast_credit=1.0)


def test_ast_credit_is_one_exactly_on_the_ground_truth(doc):
    from arl.env.bfcl import scoring
    for r in doc["train"][:: max(1, len(doc["train"]) // 60)]:
        row = bsplit.row(r)
        if "|" in r:
            continue
        env = make_env("bfcl", split=str(SPLIT))
        asyncio.run(env.reset(doc["train"].index(r)))
        calls = env.parser.parse(env.expert_turns()[0]).calls
        decoded, _ = scoring.decode(calls)
        assert scoring.score_ast(row, decoded, None)["valid"], r
        assert scoring.ast_credit(row, decoded) == 1.0, r


def test_sft_keeps_only_demonstrations_bfcl_calls_valid_with_ast_credit_on(tiny_tokenizer):
    """Train row 9 (simple_python_200): its ground truth's first allowed values fail BFCL's checker;
    with ``ast_credit`` on, its partial credit must not let it into the SFT data."""
    from arl.config import load_config
    from arl.rollout import ChatFormat
    from arl.rollout.expert import expert_demos

    fmt = ChatFormat(tiny_tokenizer)
    cfgs = [load_config(str(SPLIT.parent / "config.yaml"), ["model.name_or_path=tiny", *o])
            for o in ([], ["env.kwargs.ast_credit=0.5"])]
    plain, credit = (expert_demos(c, fmt, 12) for c in cfgs)
    assert [list(t.tokens) for t in credit] == [list(t.tokens) for t in plain]
    assert all(t.reward == 1.0 for t in credit)
