"""The code sandbox: hostile programs are contained and reported, the code_exec env grades."""
import asyncio
import os
import socket
import textwrap
import time

import pytest

from arl.env import Fault, make_env
from arl.env.code import TASKS, CodeExecEnv, format_run
from arl.env.expert import expert_transcript
from arl.env.sandbox import LIMITS, Sandbox, SandboxLimits, probe_isolation

FAST = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=200, output_bytes=4096, nproc=8,
                     file_size_mb=1, open_files=32)
ISO = probe_isolation()


def run(code, limits=FAST, audit=True, stdin=""):
    return asyncio.run(Sandbox(limits, audit=audit).run(textwrap.dedent(code), stdin=stdin))


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    d = tmp_path_factory.mktemp("outside")
    p = d / "canary.txt"
    p.write_text("keep me")
    yield p
    assert p.read_text() == "keep me"


def test_plain_program_runs_with_stdin_and_private_dir():
    r = run("""
        import os, json, math
        open("a.txt", "w").write("x" * 10)
        print(json.dumps([math.sqrt(16), input(), len(open("a.txt").read())]))
        print(os.getcwd())
    """, stdin="hello\n")
    assert r.ok and r.limit is None and r.exit_code == 0, r
    out, cwd = r.stdout.splitlines()
    assert out == '[4.0, "hello", 10]' and "arl-sbx-" in cwd
    assert not os.path.exists(cwd)  # removed afterwards


def test_user_errors_are_not_limits():
    r = run("raise ValueError('boom')")
    assert r.limit is None and r.exit_code == 1 and "ValueError: boom" in r.stderr
    assert 'File "main.py", line 1' in r.stderr and "_sandbox_boot" not in r.stderr
    r = run("def f(:")
    assert r.limit is None and r.exit_code == 1 and "SyntaxError" in r.stderr
    r = run("import sys; sys.exit(3)")
    assert r.limit is None and r.exit_code == 3


CANARY = "__CANARY__"
HOSTILE = {
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "fork"),
    "multiprocessing_bomb": ("""
        import multiprocessing as mp
        def f():
            while True: pass
        ps = [mp.Process(target=f) for _ in range(50)]
        for p in ps: p.start()""", "subprocess"),  # its import of _posixsubprocess is refused
    "thread_bomb": ("""
        import threading, time
        for _ in range(1000):
            threading.Thread(target=time.sleep, args=(5,), daemon=True).start()""", "process_count"),
    "infinite_loop": ("while True: pass", "cpu_time"),
    "busy_sleep_loop": ("import time\nwhile True:\n    time.sleep(0.05)", "wall_time"),
    "memory_bomb": ("x = bytearray(8 * 1024 ** 3)", "memory"),
    "memory_list_growth": ("x = []\nwhile True:\n    x.append('y' * 10 ** 6)", "memory"),
    "huge_output": ("while True:\n    print('spam' * 1000)", "output"),
    "huge_stderr_single_write": ("import sys\nsys.stderr.write('e' * 10 ** 7)", "output"),
    "read_etc_passwd": ("print(open('/etc/passwd').read())", "file_access"),
    "read_via_os_open": ("import os\nos.read(os.open('/etc/hostname', os.O_RDONLY), 100)",
                         "file_access"),
    "read_proc_environ": ("print(open('/proc/1/environ').read())", "file_access"),
    "write_parent_dir": ("open('../escape.txt', 'w').write('x')", "file_access"),
    "write_tmp": ("open('/tmp/arl_sandbox_escape.txt', 'w').write('x')", "file_access"),
    "symlink_to_passwd": ("import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())",
                          "file_access"),
    "delete_outside": (f"import os\nos.remove({CANARY!r})", "file_access"),
    "rmtree_outside": (f"import shutil, os\nshutil.rmtree(os.path.dirname({CANARY!r}))", "file_access"),
    "rename_outside": (f"import os\nos.rename({CANARY!r}, 'stolen.txt')", "file_access"),
    "chdir_root_listdir": ("import os\nos.chdir('/')\nprint(os.listdir('.'))", "file_access"),
    "listdir_root": ("import os\nprint(os.listdir('/'))", "file_access"),
    "socket_localhost": ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))", "network"),
    "socket_public": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", "network"),
    "dns_lookup": ("import socket\nsocket.getaddrinfo('example.com', 80)", "network"),
    "urllib": ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
               "network"),
    "subprocess_run": ("import subprocess\nsubprocess.run(['ls', '/'])", "subprocess"),
    "os_system": ("import os\nos.system('echo pwned > /tmp/arl_pwned')", "subprocess"),
    "os_execv": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'echo hi'])", "subprocess"),
    "posixsubprocess_direct": ("import _posixsubprocess", "subprocess"),
    "pty_spawn": ("import pty\npty.spawn('/bin/sh')", "fork"),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "signal"),
    "kill_test_runner": (f"import os\nos.kill({os.getpid()}, 9)", "signal"),
    "killpg_everyone": ("import os\nos.killpg(0, 9)", "signal"),
    "ctypes_libc": ("import ctypes\nctypes.CDLL(None).system(b'echo pwned')", "ctypes"),
    "recursion_bomb": ("def f(n):\n    return f(n + 1)\nf(0)", "recursion"),
    "c_recursion_raised_limit": ("""
        import sys
        sys.setrecursionlimit(10 ** 8)
        x = []
        for _ in range(200000):
            x = [x]
        print(len(repr(x)))""", "crash"),  # the C stack overflows: SIGSEGV, contained
    "raise_rlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "rlimit"),
    "gc_hunt_for_hook": ("import gc\nprint(len(gc.get_objects()))", "introspection"),
    "file_size_bomb": ("open('big', 'wb').write(b'0' * (8 << 20))", "file_size"),
    "fd_exhaustion": ("fs = [open('f%d' % i, 'w') for i in range(1000)]", "open_files"),
    "catch_and_continue": ("""
        try:
            open('/etc/shadow')
        except BaseException:
            pass
        print('escaped')""", "file_access"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained_and_reported(name, canary):
    code, expect = HOSTILE[name]
    code = textwrap.dedent(code).replace(CANARY, str(canary))
    limits = FAST
    if expect in ("cpu_time", "crash"):  # CPU-bound: on a loaded machine 1 CPU-s takes several s
        limits = SandboxLimits(**{**FAST.__dict__, "wall_s": 10.0, "cpu_s": 1 if expect == "cpu_time" else 5})
    r = run(code, limits)
    assert r.limit == expect, (r.limit, r.detail, r.exit_code, r.stderr[-300:])
    assert r.limit in LIMITS and r.started
    assert "escaped" not in r.stdout and "pwned" not in r.stdout
    assert not os.path.exists("/tmp/arl_sandbox_escape.txt") and not os.path.exists("/tmp/arl_pwned")
    assert len(r.stdout) <= FAST.output_bytes and len(r.stderr) <= FAST.output_bytes
    assert r.ok is False


def test_at_least_twenty_hostile_programs():
    assert len(HOSTILE) >= 20


def test_concurrent_runs_are_independent():
    async def go():
        sb = Sandbox(FAST)
        return await asyncio.gather(*[sb.run(f"print({i} * {i})") for i in range(4)],
                                    sb.run("while True: pass"))
    *outs, loop = asyncio.run(go())
    assert [o.stdout.strip() for o in outs] == ["0", "1", "4", "9"]
    assert loop.limit in ("cpu_time", "wall_time")


# -- the layers under the audit hook hold on their own (root only: namespaces + uid switch) ------

needs_layers = pytest.mark.skipif(not (ISO.namespaces and ISO.uid_switch),
                                  reason=f"needs root with unshare and a uid switch: {ISO}")


def _procs_of(uid):
    """Live processes of ``uid``."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    st = dict(l.split(":", 1) for l in f if ":" in l)
                # a zombie is dead, only not yet reaped by the container's init
                if st["Uid"].split()[0] == str(uid) and not st["State"].strip().startswith("Z"):
                    n += 1
            except OSError:
                pass
    return n


@needs_layers
def test_without_hook_network_namespace_blocks_packets():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    r = run(f"""
        import socket
        for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:
            try:
                socket.create_connection(addr, timeout=0.5)
                print('connected', addr)
            except OSError as e:
                print('failed', e.errno)
        """, audit=False)
    with pytest.raises(socket.timeout):
        srv.accept()  # nothing reached the listener
    srv.close()
    assert "connected" not in r.stdout and r.stdout.count("failed") == 2, r


@needs_layers
def test_without_hook_fork_bomb_is_capped_and_fully_killed():
    r = run("""
        import os, time
        for _ in range(200):
            try:
                os.fork()
            except OSError:
                pass
        os.setsid() if os.getpid() % 2 else None
        time.sleep(30)
        """, audit=False)
    assert r.limit == "wall_time" and r.uid is not None
    for _ in range(100):  # the kernel reaps the namespace asynchronously: wait until it is empty
        if _procs_of(r.uid) == 0:
            break
        time.sleep(0.05)
    assert _procs_of(r.uid) == 0


def test_without_namespaces_the_uid_is_killed_whole(monkeypatch):
    if not ISO.uid_switch:
        pytest.skip(f"needs root and a uid switch: {ISO}")
    import arl.env.sandbox as S
    monkeypatch.setattr(S, "probe_isolation", lambda python=None: S.Isolation(ISO.python, True, False))
    r = run("""
        import os, time
        for _ in range(20):
            try:
                os.fork()
            except OSError:
                pass
        os.setsid()  # leaves the process group: killpg alone would miss it
        time.sleep(30)
        """, audit=False)
    assert r.limit == "wall_time"
    for _ in range(100):
        if _procs_of(r.uid) == 0:
            break
        time.sleep(0.05)
    assert _procs_of(r.uid) == 0


@needs_layers
def test_without_hook_permissions_and_pid_namespace_hold(canary):
    r = run(f"""
        import os
        for f in [lambda: open('/etc/arl_pwned', 'w'), lambda: os.remove({str(canary)!r}),
                  lambda: open('/etc/shadow').read(), lambda: os.kill({os.getpid()}, 9)]:
            try:
                f(); print('did it')
            except OSError as e:
                print(type(e).__name__)
        """, audit=False)
    assert r.stdout.split() == ["PermissionError", "PermissionError", "PermissionError",
                                "ProcessLookupError"], r
    assert not os.path.exists("/etc/arl_pwned")


def test_start_failure_is_reported():
    r = asyncio.run(Sandbox(FAST, python="/nonexistent/python3").run("print(1)"))
    assert r.limit == "start_failed" and not r.started and r.detail


def test_bad_limits_rejected():
    with pytest.raises(ValueError, match="SandboxLimits.wall_s must be > 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="code must be str"):
        asyncio.run(Sandbox(FAST).run(b"print(1)"))  # type: ignore[arg-type]


# -- the code_exec environment ----------------------------------------------------------------

def test_code_env_expert_solves_every_task():
    envs = [CodeExecEnv(limits=FAST.__dict__, tasks=[t.func]) for t in TASKS]

    async def go():
        return await asyncio.gather(*[expert_transcript(e, 0) for e in envs])
    for env, (task, steps) in zip(envs, asyncio.run(go())):
        assert task == env.task.prompt
        (_, tool_res), (_, final) = steps
        assert tool_res.observation.startswith("exit 0\n") and not tool_res.info["tool_error"]
        assert final.done and final.reward == 1.0 and final.info["tests_passed"], final
    # the seed picks among all tasks
    env = CodeExecEnv()
    picked = set()
    for seed in range(200):
        asyncio.run(env.reset(seed))
        picked.add(env.task.func)
    assert picked == {t.func for t in TASKS}


def test_code_env_grades_wrong_and_hostile_answers_zero():
    env = make_env("code_exec", limits=FAST.__dict__, tasks=["add"])

    def answer(code):
        asyncio.run(env.reset(0))
        return asyncio.run(env.step(f"<answer>{code}</answer>"))

    assert answer("```python\ndef add(a, b):\n    return a + b\n```").reward == 1.0
    assert answer("def add(a, b):\n    return a - b").reward == 0.0
    assert answer("def add(a, b):\n    return float(a + b)").reward == 0.0  # exact types
    cheat = "class A:\n    def __eq__(s, o): return True\ndef add(a, b):\n    return A()"
    assert answer(cheat).reward == 0.0
    r = answer("import os\nos.system('true')\ndef add(a, b):\n    return a + b")
    assert r.reward == 0.0 and r.info["sandbox"] == "subprocess" and r.fault is Fault.NONE
    r = answer("print('tests passed 0123456789abcdef')\nimport sys\nsys.exit(0)")
    assert r.reward == 0.0


def test_code_env_tool_observations_and_errors():
    env = CodeExecEnv(limits=FAST.__dict__, max_turns=3)
    asyncio.run(env.reset(1))
    r = asyncio.run(env.step('<tool_call>{"name": "run_python", "arguments": '
                             '{"code": "while True: print(1)"}}</tool_call>'))
    assert r.observation.startswith("killed: output") and r.info["sandbox"] == "output"
    assert len(r.observation) <= env.obs_chars and not r.done
    r = asyncio.run(env.step('<tool_call>{"name": "run_python"}</tool_call>'))
    assert r.info["tool_error"] and "missing key 'arguments'" in r.observation
    r = asyncio.run(env.step("nothing"))
    assert r.done and r.info["truncated"] and r.reward == 0


def test_code_env_sandbox_start_failure_is_unrecoverable():
    env = CodeExecEnv(limits=FAST.__dict__, python="/nonexistent/python3")
    asyncio.run(env.reset(0))
    r = asyncio.run(env.step(env.expert_turns()[0]))
    assert r.done and r.fault is Fault.UNRECOVERABLE and r.info["sandbox"] == "start_failed"


def test_format_run_truncates():
    from arl.env.sandbox import SandboxResult
    s = format_run(SandboxResult("o" * 1000, "e" * 1000, 1), 100)
    assert len(s) <= 100 and s.startswith("exit 1\n")
