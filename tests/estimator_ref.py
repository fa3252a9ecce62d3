"""Plain-Python references of the group advantage estimators (arl/algo/advantages.py)."""
import math


def groups_of(groups):
    out = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def ref(name, rewards, groups, eps):
    """Per-sample loops, no numpy: the estimators as their papers write them."""
    adv = [0.0] * len(rewards)
    for members in groups_of(groups).values():
        r = [rewards[i] for i in members]
        n = len(r)
        if max(r) == min(r) and name != "none":
            continue  # a group that agrees (or a lone sample) teaches nothing: exactly 0
        mean = sum(r) / n
        for i in members:
            if name == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))
                adv[i] = (rewards[i] - mean) / (std + eps)
            elif name == "dr_grpo":
                adv[i] = rewards[i] - mean
            elif name == "rloo":
                adv[i] = rewards[i] - (sum(r) - rewards[i]) / (n - 1)
            elif name == "none":
                adv[i] = rewards[i]
    return adv
