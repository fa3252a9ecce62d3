"""A real sandbox for model-written Python: one subprocess per run, limits, no network, private dir.

Layers (outermost first), as measured on this machine kind (root in a container, no seccomp):

1. ``unshare --net --pid --fork --kill-child`` when it works (probed once): a fresh network
   namespace has only a down loopback, so no packet leaves -- not even to 127.0.0.1; in the new
   PID namespace the sandbox cannot see or signal outside processes, and when its init dies the
   kernel kills every process left in it (no escaping a kill by ``setsid``).
2. A throw-away uid (random, > 2**20) when we are root: RLIMIT_NPROC then really caps processes
   (root ignores it), and file permissions stop writes outside world-writable places and reads of
   non-world-readable files.  This needs an interpreter the uid can read, hence the interpreter
   probe (pyenv under /root is not; /usr/bin/python3 is).
3. rlimits: CPU seconds, address space, file size, process count, open files, no core dumps.
4. A Python audit hook (installed before user code) that reports and ends the run on: files
   opened/changed outside the private directory (reads of the interpreter's own library dirs are
   allowed), subprocess/exec/fork, signals, sockets, ctypes, rlimit changes, gc introspection.
5. The parent: wall-clock limit and output-size limit (kills the whole process group, and with it
   the PID namespace; without one, everything of the throw-away uid), private temporary working
   directory removed afterwards.

Residual risks, honestly: the audit hook is not a security boundary (CPython's own docs say so);
code that reaches native calls the hook does not see could get past it, and then only layers 1-3
hold.  In particular /tmp and other world-writable places, and world-readable files such as
/etc/passwd, are protected by the hook alone; disk usage is bounded only by file size x CPU/wall
time; without root (no unshare, no uid switch) the network and process limits rest on the hook
and on killing the process group.  ``Sandbox.isolation`` says which layers are active.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Sequence

_BOOT = (Path(__file__).with_name("_sandbox_boot.py")).read_text()
_PROBE_MODULES = "import json, math, collections, itertools, re, functools, heapq, traceback"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 256  # RLIMIT_AS
    output_bytes: int = 16384  # stdout and stderr, each
    nproc: int = 16
    file_size_mb: int = 4
    open_files: int = 64
    start_timeout_s: float = 20.0  # interpreter start-up, not counted in wall_s

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "output_bytes", "nproc", "file_size_mb",
                     "open_files", "start_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {v!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]  # -N when killed by signal N; None when killed by the parent
    limit: Optional[str] = None  # which limit or rule fired (see LIMITS), None if none
    detail: str = ""
    wall_s: float = 0.0
    truncated: bool = False
    uid: Optional[int] = None  # the throw-away uid the code ran as (None: no uid switch)

    @property
    def ok(self) -> bool:
        return self.limit is None and self.exit_code == 0

    @property
    def started(self) -> bool:
        return self.limit != "start_failed"


# every value SandboxResult.limit can take
LIMITS = ("wall_time", "cpu_time", "memory", "output", "file_size", "process_count", "open_files",
          "recursion", "crash", "file_access", "network", "subprocess", "fork", "signal", "ctypes",
          "rlimit", "introspection", "start_failed")

_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu_time", signal.SIGKILL: "cpu_time",  # hard CPU limit
                  signal.SIGXFSZ: "file_size", signal.SIGSEGV: "crash", signal.SIGABRT: "crash",
                  signal.SIGBUS: "crash"}


@dataclass(frozen=True)
class Isolation:
    python: str
    uid_switch: bool
    namespaces: bool


def _run_quiet(cmd: Sequence[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@lru_cache(maxsize=None)
def probe_isolation(python: Optional[str] = None) -> Isolation:
    """Which layers work here (cached).  The interpreter is the given one, else the first of this
    process's and the system's that a throw-away uid can run."""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    candidates = [python] if python else [sys.executable, shutil.which("python3") or "",
                                          "/usr/bin/python3"]
    candidates = [c for c in dict.fromkeys(candidates) if c]
    chosen, uid_switch = None, False
    if root:
        drop = f"import os; os.setgroups([]); os.setgid(1234567); os.setuid(1234567); {_PROBE_MODULES}"
        for c in candidates:
            if _run_quiet([c, "-I", "-B", "-c", drop]):
                chosen, uid_switch = c, True
                break
    if chosen is None:
        chosen = next((c for c in candidates if _run_quiet([c, "-I", "-B", "-c", _PROBE_MODULES])),
                      candidates[0] if candidates else "python3")
    unshare = shutil.which("unshare")
    ns = bool(unshare) and root and _run_quiet(
        [unshare, "--net", "--pid", "--fork", "--kill-child", chosen, "-I", "-c", "pass"])
    return Isolation(chosen, uid_switch, ns)


class Sandbox:
    """``await Sandbox(limits).run(code, stdin="")`` -> ``SandboxResult``.  Stateless between runs
    (each run gets a fresh process and directory), safe to use concurrently."""

    def __init__(self, limits: Optional[SandboxLimits] = None, python: Optional[str] = None,
                 audit: bool = True):
        self.limits = limits or SandboxLimits()
        self._python = python
        self._audit = audit  # False only to test that the other layers hold on their own

    @property
    def isolation(self) -> Isolation:
        return probe_isolation(self._python)

    def _rlimits(self, uid_switch: bool) -> List[list]:
        L = self.limits
        mb = 1 << 20
        out = [["RLIMIT_CPU", int(L.cpu_s), int(L.cpu_s) + 1],
               ["RLIMIT_AS", L.memory_mb * mb, L.memory_mb * mb],
               ["RLIMIT_FSIZE", L.file_size_mb * mb, L.file_size_mb * mb],
               ["RLIMIT_NOFILE", L.open_files, L.open_files],
               ["RLIMIT_CORE", 0, 0]]
        if uid_switch:  # for a shared uid the count would include unrelated processes
            out.append(["RLIMIT_NPROC", L.nproc, L.nproc])
        return out

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        if not isinstance(code, str):
            raise ValueError(f"Sandbox.run: code must be str, got {type(code).__name__}")
        iso = await asyncio.to_thread(probe_isolation, self._python)
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="arl-sbx-"))
        try:
            return await self._run_in(workdir, code, stdin, iso)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run_in(self, workdir: str, code: str, stdin: str, iso: Isolation) -> SandboxResult:
        L = self.limits
        uid = random.SystemRandom().randrange(1 << 20, 1 << 30) if iso.uid_switch else None
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        if uid is not None:
            for p in (workdir, os.path.join(workdir, "main.py")):
                os.chown(p, uid, uid)
        rfd, wfd = os.pipe()
        cfg = {"report_fd": wfd, "workdir": workdir, "uid": uid, "rlimits": self._rlimits(iso.uid_switch),
               "read_files": ["/dev/null", "/dev/urandom", "/dev/zero"], "audit": self._audit}
        cmd = [iso.python, "-I", "-B", "-c", _BOOT, json.dumps(cfg)]
        if iso.namespaces:
            cmd = [shutil.which("unshare") or "unshare", "--net", "--pid", "--fork", "--kill-child"] + cmd
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=workdir, env=env, pass_fds=(wfd,),
                start_new_session=True)
        except OSError as e:
            os.close(rfd)
            return SandboxResult("", "", None, "start_failed", f"{type(e).__name__}: {e}")
        finally:
            os.close(wfd)
        run = _Run(proc, rfd, L, uid)
        try:
            return await run.collect(t0, stdin.encode("utf-8"))
        finally:
            run.kill()
            os.close(rfd)
            if uid is not None and not iso.namespaces:
                await _kill_uid(iso.python, uid)


async def _kill_uid(python: str, uid: int) -> None:
    """Without a PID namespace, processes that left the group (setsid) survive killpg; as the
    throw-away uid, kill(-1) reaches exactly the processes of that uid."""
    code = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); os.kill(-1, 9)"
    for _ in range(3):
        proc = await asyncio.create_subprocess_exec(python, "-I", "-S", "-c", code,
                                                    stderr=asyncio.subprocess.DEVNULL)
        if await proc.wait() != 0:  # ProcessLookupError: nothing of that uid is left
            return


class _Run:
    """One live sandbox process: feeds stdin, drains outputs under the cap, watches the clocks."""

    def __init__(self, proc, rfd: int, limits: SandboxLimits, uid: Optional[int]):
        self.proc, self.rfd, self.L, self.uid = proc, rfd, limits, uid
        self.out, self.err = bytearray(), bytearray()
        self.reports: List[str] = []
        self.killed_for: Optional[str] = None
        self.ready = asyncio.Event()

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group; with it the PID namespace's init
        except (ProcessLookupError, PermissionError):
            pass

    def _over(self, why: str):
        if self.killed_for is None:
            self.killed_for = why
        self.kill()

    async def _drain(self, stream, buf: bytearray):
        cap = self.L.output_bytes
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = cap - len(buf)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room:
                self._over("output")
                return

    async def _read_reports(self):
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(self.rfd), "rb", 0))
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                msg = line.decode("utf-8", "replace").strip()
                self.reports.append(msg)
                if msg == "ready" or msg.startswith("startfail"):
                    self.ready.set()
        finally:
            transport.close()
            self.ready.set()

    async def _feed(self, data: bytes):
        try:
            if data:
                self.proc.stdin.write(data)
                await self.proc.stdin.drain()
            self.proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    async def collect(self, t0: float, stdin: bytes) -> SandboxResult:
        L = self.L
        tasks = [asyncio.ensure_future(c) for c in (
            self._drain(self.proc.stdout, self.out), self._drain(self.proc.stderr, self.err),
            self._read_reports())]
        feeder = asyncio.ensure_future(self._feed(stdin))
        try:
            await asyncio.wait_for(self.ready.wait(), L.start_timeout_s)
        except asyncio.TimeoutError:
            self._over("start_failed")
        t_ready = time.monotonic()
        done_all = asyncio.ensure_future(asyncio.gather(self.proc.wait(), *tasks))
        try:
            await asyncio.wait_for(asyncio.shield(done_all), L.wall_s)
        except asyncio.TimeoutError:
            self._over("wall_time")
            try:  # in a PID namespace everything dies with its init; elsewhere, stragglers
                await asyncio.wait_for(asyncio.shield(done_all), 2.0)  # may hold the pipes
            except asyncio.TimeoutError:
                pass
        for t in tasks + [done_all, feeder]:
            t.cancel()
        await asyncio.gather(*tasks, done_all, feeder, return_exceptions=True)
        return self._result(time.monotonic() - t_ready)

    def _result(self, wall: float) -> SandboxResult:
        rc = self.proc.returncode
        limit, detail, code = self.killed_for, "", None
        exit_msgs = [r for r in self.reports if r.startswith(("exit ", "signal "))]
        if exit_msgs:
            kind, n = exit_msgs[-1].split()
            code = int(n) if kind == "exit" else -int(n)
        elif rc is not None and self.killed_for is None:
            code = rc
        for r in self.reports:
            if limit is None and r.startswith("blocked "):
                _, what, *rest = r.split(" ", 2)
                limit, detail = what, rest[0] if rest else ""
            elif limit is None and r.startswith("limit "):
                limit = r.split()[1]
            elif limit is None and r.startswith("startfail"):
                limit, detail = "start_failed", r[len("startfail "):]
        if limit is None and "ready" not in self.reports:
            limit, detail = "start_failed", f"sandbox exited with {rc} before running the code"
        if limit is None and code is not None and code < 0:
            limit = _SIGNAL_LIMITS.get(signal.Signals(-code), "crash")
            detail = signal.Signals(-code).name
        if self.killed_for == "wall_time":
            detail = f"{self.L.wall_s:g} s"
        elif self.killed_for == "output":
            detail = f"{self.L.output_bytes} bytes"
        elif limit == "cpu_time" and not detail.startswith("SIG"):
            detail = f"{self.L.cpu_s} s"
        return SandboxResult(self.out.decode("utf-8", "replace"), self.err.decode("utf-8", "replace"),
                             code, limit, detail, wall, truncated=self.killed_for == "output",
                             uid=self.uid)
