"""The config reference (arl/config/reference.py): every key described, docs/config.md current, and
``python -m arl.train --help-config``."""
import pytest
from pydantic import BaseModel, Field

from arl.config.reference import DOC, keys, markdown, select, sections, table
from arl.train import main

def test_every_key_has_a_one_line_description():
    missing = sorted(k.name for k in keys() if not k.description.strip())
    assert not missing, f"keys without a description: {missing}"
    assert not [k.name for k in keys() if "\n" in k.description]


def test_docs_config_md_is_current():
    assert DOC.is_file() and DOC.read_text() == markdown(), \
        "docs/config.md is stale: regenerate it with python -m arl.config.reference --write"


def test_nested_sections_are_listed_with_dotted_names():
    names = [k.name for k in keys()]
    for key in ("seed", "trainer.optim.lr", "stabilizers.ipa.anchors", "env.dataset.path",
                "stabilizers.monitors.alarms[].signal", "logging.wandb.project", "loss.clip_high"):
        assert key in names
    assert len(names) == len(set(names))
    assert sections()[:2] == ["seed", "output_dir"] and "critic" in sections()


def test_a_new_section_is_walked_by_itself():
    class Algo(BaseModel):
        advantage: str = Field("grpo", description="Advantage estimator.")

    class Top(BaseModel):
        algo: Algo = Field(Algo(), description="The algorithm.")

    assert [k.name for k in keys(Top)] == ["algo", "algo.advantage"]
    assert keys(Top)[1].description == "Advantage estimator."


def test_types_and_defaults():
    row = {k.name: k for k in keys()}
    assert row["trainer.zero_stage"][1:3] == ("0|1|2|3", "2")
    assert row["loss.dual_clip"][1:3] == ("float|null", "null")
    assert row["stabilizers.shaping.checkpoints"].default == "[valid_tool_call, new_state]"
    assert row["env.dataset.path"].default == "required"
    assert row["trainer.optim"][1:3] == ("section", "-")


def test_help_config_prints_a_section_or_a_key(capsys):
    assert main(["--help-config", "trainer.optim"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["KEY", "TYPE", "DEFAULT"]
    assert "trainer.optim.lr" in out and "Peak learning rate" in out and "trainer.zero_stage" not in out
    assert main(["--help-config", "seed"]) == 0
    assert "seed" in capsys.readouterr().out
    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in ("critic.gamma", "stabilizers.stall.patience", "output_dir"))


@pytest.mark.parametrize("query,msg", [
    ("trainr", "unknown section trainr (sections: seed, output_dir, model,"),
    ("trainer.stepz", "unknown key trainer.stepz (keys of trainer: world_size,"),
])
def test_help_config_unknown_is_one_line(query, msg, capsys):
    assert main(["--help-config", query]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: --help-config: ") and msg in err and "\n" not in err
    with pytest.raises(ValueError):
        select(query)


def test_table_wraps_descriptions_to_the_width():
    out = table(select("critic"), width=60)
    assert all(len(line) <= 60 for line in out.splitlines() if line.startswith("    "))


def test_help_mentions_help_config(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--help-config" in capsys.readouterr().out
