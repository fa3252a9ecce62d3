"""The package's layers (docs/design.md, "Layers"): every import of an arl module points down, two
packages of one layer never import each other (so rollout and stabilizers stay independent), and
arl's own modules are imported at the top of a file, never inside a function; the objective's
interface stays narrow."""
import ast
from pathlib import Path

ARL = Path(__file__).resolve().parents[1] / "arl"

# bottom to top; a module may import its own package and anything in a lower layer
LAYERS = [
    ("errors", "procs"),
    ("ops",),
    ("config",),
    ("env", "data"),
    ("model", "metrics"),
    ("algo",),  # how a batch becomes a loss: the estimators, the step's advantages, the objectives
    ("stabilizers", "rollout"),
    ("trainer",),
    ("prepare", "layout", "plot"),
    ("launch", "cluster"),
    ("eval_bfcl",),  # python -m arl.eval --bench bfcl: below eval, which dispatches to it
    ("train", "eval"),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """``arl.rollout.worker`` -> ``rollout``: the top-level package or module inside arl."""
    return module.split(".")[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ARL.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    return _imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_of(src: str, name: str, is_package: bool):
    """``(imported arl module, line, at module level)`` for every import of an arl module."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(src)
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            mods = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            if m == "arl" or m.startswith("arl."):
                yield m, node.lineno, id(node) in top


def _sources():
    return [p for p in sorted(ARL.rglob("*.py")) if p.name != "__init__.py" or p.parent != ARL]


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in _sources()}
    assert units <= set(LAYER_OF), f"add to LAYERS: {sorted(units - set(LAYER_OF))}"


def _upward(name: str, imports) -> list:
    me = _unit(name)
    bad = []
    for mod, line, _ in imports:
        if mod in ("arl", "arl._C", "arl._C_cuda"):  # the compiled op libraries sit below everything
            continue
        other = _unit(mod)
        if other != me and LAYER_OF[other] >= LAYER_OF[me]:
            bad.append(f"{name}:{line} ({me}) imports {mod} ({other})")
    return bad


def test_imports_point_down_and_siblings_stay_apart():
    bad = [b for path in _sources() for b in _upward(_module_name(path), _imports(path))]
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


# optional heavy dependencies behind arl modules, loaded on demand: the compiled op libraries, and the
# Triton kernels (importing them imports triton and decorates the kernels)
ON_DEMAND = ("arl._C", "arl._C_cuda", "arl.ops.policy_loss.triton_launch", "arl.ops.logprob.triton_kernel")


def test_arl_modules_are_imported_at_the_top():
    local = [f"{p.relative_to(ARL.parent)}:{line} {mod}" for p in _sources() for mod, line, top in _imports(p)
             if not top and mod not in ON_DEMAND]
    assert not local, "function-local imports of arl modules:\n" + "\n".join(local)


def test_the_checker_sees_a_violation():
    """The rule is checked, not assumed: an import of a sibling or of a higher layer is reported,
    one of a lower layer or of the module's own package is not."""
    src = "from ..stabilizers import Stabilizers\nfrom ..trainer.rank import trainer_rank\n" \
          "from ..data.batch import RolloutBatch\nfrom .engine import make_engine\n"
    bad = _upward("arl.rollout.manager", _imports_of(src, "arl.rollout.manager", False))
    assert bad == ["arl.rollout.manager:1 (rollout) imports arl.stabilizers (stabilizers)",
                   "arl.rollout.manager:2 (rollout) imports arl.trainer.rank (trainer)"]
    local = list(_imports_of("def f():\n    from ..data import batch\n", "arl.rollout.manager", False))
    assert local == [("arl.data", 2, False)]


MAX_FILE_LINES = 450  # a file a newcomer reads in one sitting
MAX_FUNCTION_LINES = 60  # in the trainer and the algorithm: a step reads top to bottom


def test_files_stay_small():
    big = [f"{p.relative_to(ARL.parent)}: {n} lines" for p in sorted(ARL.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(big)


def _long_functions(src: str, limit: int) -> list:
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_trainer_functions_stay_short():
    long = [f"{p.relative_to(ARL.parent)}: {f}" for unit in ("trainer", "algo") for p in sorted((ARL / unit).rglob("*.py"))
            for f in _long_functions(p.read_text(), MAX_FUNCTION_LINES)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
    assert _long_functions("def f():\n" + "    x = 1\n" * 3, 3) == ["f (4 lines)"]  # the counter counts


def _module_graph() -> dict:
    """arl module -> the arl modules it imports at module level (a package's own ``__init__`` included)."""
    names = {_module_name(p) for p in ARL.rglob("*.py")}

    def resolve(mod: str) -> str:
        while mod not in names and "." in mod:  # ``from .x import Name`` names a symbol, not a module
            mod = mod.rpartition(".")[0]
        return mod

    graph = {}
    for p in ARL.rglob("*.py"):
        me = _module_name(p)
        graph[me] = {resolve(m) for m, _, top in _imports(p) if top and m not in ON_DEMAND} - {me}
    return graph


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None (depth-first search with colours)."""
    colour, stack = {}, []

    def visit(n):
        colour[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if colour.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in colour and (found := visit(m)):
                return found
        colour[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in colour and (found := visit(n)):
            return found
    return None


def test_no_import_cycles():
    # a package's __init__ re-exporting its modules is not a cycle unless a module imports the package back
    assert _cycle(_module_graph()) is None, " -> ".join(_cycle(_module_graph()))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one
