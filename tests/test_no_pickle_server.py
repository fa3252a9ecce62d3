"""No module of arl serves pickles (issue #36): batches and orders travel through Ray's
token-authenticated transport or, on one machine, through ``multiprocessing`` queues between a
process and its children; nothing listens for them.  A source scan: a server of arl's own (a
``multiprocessing`` manager or listener, a socket that listens, a socketserver) fails this test."""
import ast
from pathlib import Path

ARL = Path(__file__).resolve().parents[1] / "arl"
SERVERS = {"BaseManager", "SyncManager", "Listener", "socketserver", "serve_forever", "listen"}


def _names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                yield a.name.rpartition(".")[2], node.lineno
            if isinstance(node, ast.ImportFrom) and node.module:
                yield node.module.rpartition(".")[2], node.lineno


def test_no_arl_module_serves_pickles():
    found = [f"{p.relative_to(ARL.parent)}:{line} {name}" for p in sorted(ARL.rglob("*.py"))
             for name, line in _names(ast.parse(p.read_text())) if name in SERVERS]
    assert not found, found


def test_the_scan_finds_a_manager():
    src = "from multiprocessing.managers import BaseManager\nclass M(BaseManager): pass\nM(address=('', 1)).get_server().serve_forever()\n"
    assert {n for n, _ in _names(ast.parse(src))} & SERVERS == {"BaseManager", "serve_forever"}
