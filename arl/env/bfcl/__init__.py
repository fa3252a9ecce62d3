"""BFCL (the Berkeley Function Calling Leaderboard) as arl environments, scored by BFCL's own
checkers (``env.name: bfcl``; docs/bfcl.md)."""
from .env import BfclEnv
from .loader import AST, CATEGORIES, INSTALL_HINT, IRRELEVANCE, MULTI_TURN, bfcl, check_categories, kind, load_entries
from .scoring import score_ast, score_irrelevance, score_multi_turn

__all__ = ["AST", "BfclEnv", "CATEGORIES", "INSTALL_HINT", "IRRELEVANCE", "MULTI_TURN", "bfcl", "check_categories",
           "kind", "load_entries", "score_ast", "score_irrelevance", "score_multi_turn"]
