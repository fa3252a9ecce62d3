"""Exact-match reward of the calculator example: the last number of the final answer must equal the
task's ``answer``."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str):
    found = _NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


def score(task: dict, episode) -> dict:
    """One named component, ``correct`` (logged as ``reward/correct``): 1 when the final answer's
    last number is the ground truth, else 0."""
    got = last_number(episode.final_answer)
    correct = float(got is not None and got == str(task["answer"]))
    return {"correct": correct}
