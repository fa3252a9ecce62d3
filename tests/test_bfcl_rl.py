"""RL on BFCL end to end (slow): the multi-turn environment (BFCL's executable classes, its
multi-turn checker as the reward, turn credit on) runs 3 RL steps on the tests' tiny model, with
held-out evaluations before and after; examples/bfcl/config.yaml is the config it starts from."""
import json

import pytest

pytest.importorskip("bfcl_eval", reason="bash install.sh --bfcl")

from example_runs import three_rl_steps  # noqa: E402


@pytest.mark.slow  # a whole training run (vLLM engine, trainer rank), like tests/test_gym_env.py's
def test_multi_turn_three_rl_steps(tmp_path, tiny_model_dir):
    kwargs = json.dumps({"categories": ["multi_turn_base"], "turn_credit": 0.5})
    out = three_rl_steps("bfcl", tmp_path, tiny_model_dir, f"env.kwargs={kwargs}", "env.max_turns=4",
                         "sft.enabled=false", "env.pool_size=8", "rollout.max_turn_tokens=32",
                         "rollout.max_total_tokens=8192", "trainer.micro_batch_tokens=8192")
    rows = [json.loads(x) for x in (out / "transcripts" / "heldout_step3.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["fault"] == "none" for r in rows)
