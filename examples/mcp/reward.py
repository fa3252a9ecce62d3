"""Reward of the MCP example: the final answer's last number must be the task's ``answer`` within 0.01."""
from __future__ import annotations

from examples.calculator.reward import last_number


def score(task: dict, episode) -> dict:
    """``correct`` (logged as ``reward/correct``): 1 when the final answer's last number is within
    0.01 of ``answer``, else 0."""
    got = last_number(episode.final_answer)
    try:
        correct = got is not None and abs(float(got) - float(task["answer"])) <= 0.01
    except ValueError:
        correct = False
    return {"correct": float(correct)}
