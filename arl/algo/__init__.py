"""Algorithms that are pure functions of a step's numbers: the advantage estimators."""
from .advantages import ESTIMATORS, Estimator, gae, get_estimator, group_advantages, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "gae", "get_estimator", "group_advantages", "register_estimator"]
