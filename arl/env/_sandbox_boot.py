"""Runs INSIDE the sandbox interpreter (passed with ``-c``; stdlib only, any python >= 3.8).

argv[1] is a JSON config from ``arl.env.sandbox``.  The process forks: the parent only waits and
reports how the child ended (in a new PID namespace it is PID 1, whose exit kills every process
left in the namespace); the child sets resource limits, drops to a throw-away uid, installs the
audit hook and executes ``main.py``.  Everything the parent should know goes, one line per
message, to the report pipe: ``ready``, ``blocked <what> <detail>``, ``limit <name>``,
``exit <code>``, ``signal <n>``.
"""
import errno
import json
import os
import sys
import traceback

CFG = json.loads(sys.argv[1])
REPORT_FD = CFG["report_fd"]
EXIT_BLOCKED = 97


def report(msg):
    try:
        os.write(REPORT_FD, (msg.replace("\n", " ")[:400] + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def relay(pid):
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        report("signal %d" % os.WTERMSIG(status))
        os._exit(128 + os.WTERMSIG(status))
    report("exit %d" % os.WEXITSTATUS(status))
    os._exit(os.WEXITSTATUS(status))


def set_limits():
    import resource
    for name, soft, hard in CFG["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def drop_privileges():
    uid = CFG["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


# event -> what is reported when it is blocked
BLOCKED_EVENTS = {
    "os.system": "subprocess", "os.exec": "subprocess", "os.posix_spawn": "subprocess",
    "os.spawn": "subprocess", "subprocess.Popen": "subprocess", "os.startfile": "subprocess",
    "os.fork": "fork", "os.forkpty": "fork",
    "os.kill": "signal", "os.killpg": "signal", "signal.pthread_kill": "signal",
    "resource.setrlimit": "rlimit", "resource.prlimit": "rlimit",
    "gc.get_objects": "introspection", "gc.get_referrers": "introspection",
    "gc.get_referents": "introspection",
}
BLOCKED_PREFIXES = (("socket.", "network"), ("ctypes.", "ctypes"))
# extension modules that reach the OS without audit events of their own
BLOCKED_MODULES = {"_posixsubprocess": "subprocess", "ctypes": "ctypes", "_ctypes": "ctypes",
                   "_testcapi": "ctypes", "_testinternalcapi": "ctypes",
                   "_xxsubinterpreters": "subprocess"}
# events whose path arguments must all lie inside the working directory
WRITE_PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown",
                     "os.link", "os.truncate", "os.utime", "os.chflags", "os.lchflags",
                     "os.mkfifo", "os.mknod", "os.chdir", "os.chroot", "shutil.rmtree",
                     "shutil.chown", "shutil.move", "shutil.copyfile", "shutil.copytree",
                     "shutil.make_archive", "shutil.unpack_archive", "os.setxattr",
                     "os.removexattr"}
READ_PATH_EVENTS = {"os.listdir", "os.scandir", "glob.glob", "os.getxattr", "os.listxattr"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_hook(workdir, read_roots, read_files):
    realpath, join, getcwd, fspath = os.path.realpath, os.path.join, os.getcwd, os.fspath
    sep, wroots = os.sep, (workdir,)

    def inside(p, roots):
        for r in roots:
            if p == r or p.startswith(r + sep):
                return True
        return False

    def resolve(p):
        p = fspath(p)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        return realpath(join(getcwd(), p))

    def deny(what, detail):
        report("blocked %s %s" % (what, detail))
        try:
            sys.stderr.write("sandbox: blocked %s: %s\n" % (what, detail))
            sys.stderr.flush()
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(EXIT_BLOCKED)

    def paths(args):
        return [a for a in args if isinstance(a, (str, bytes)) or hasattr(a, "__fspath__")]

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            if isinstance(path, int):
                return
            writing = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
            p = resolve(path)
            if inside(p, wroots) or (not writing and (inside(p, read_roots) or p in read_files)):
                return
            deny("file_access", ("write " if writing else "read ") + p)
        elif event in BLOCKED_EVENTS:
            deny(BLOCKED_EVENTS[event], event)
        elif event == "import":
            if args and args[0] in BLOCKED_MODULES:
                deny(BLOCKED_MODULES[args[0]], "import " + str(args[0]))
        elif event in WRITE_PATH_EVENTS or event == "os.symlink":
            ps = paths(args)[1:] if event == "os.symlink" else paths(args)  # a link's target is inert
            for a in ps:
                p = resolve(a)
                if not inside(p, wroots):
                    deny("file_access", "%s %s" % (event, p))
        elif event in READ_PATH_EVENTS:
            for a in paths(args):
                p = resolve(a)
                if not (inside(p, wroots) or inside(p, read_roots)):
                    deny("file_access", "%s %s" % (event, p))
        else:
            for prefix, what in BLOCKED_PREFIXES:
                if event.startswith(prefix):
                    deny(what, event)

    return hook


def read_roots(workdir):
    roots = set()
    for p in sys.path + [os.path.dirname(os.__file__)]:
        if p and os.path.isdir(p):
            rp = os.path.realpath(p)
            if rp.count(os.sep) >= 2 and not rp.startswith(("/proc", "/sys", "/dev", "/etc")):
                roots.add(rp)
    roots.discard(workdir)
    return tuple(sorted(roots))


# uncaught exception -> limit that caused it
def classify(exc):
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, RecursionError):
        return "recursion"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file_size"
    if isinstance(exc, OSError) and exc.errno == errno.EAGAIN and "fork" in str(exc).lower():
        return "process_count"
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return "process_count"
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        return "open_files"
    return None


def child():
    workdir = CFG["workdir"]
    os.chdir(workdir)
    with open("main.py", encoding="utf-8") as f:
        src = f.read()
    roots, files = read_roots(workdir), frozenset(CFG["read_files"])
    set_limits()
    drop_privileges()
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p]  # no import from the working directory's parent
    code = compile(src, "main.py", "exec")  # a SyntaxError is reported as the user's error below
    if CFG.get("audit", True):
        sys.addaudithook(make_hook(workdir, roots, files))
    report("ready")
    g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(code, g)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        finish(status)
    except BaseException as e:  # noqa: B902 -- report and exit, whatever it was
        what = classify(e)
        if what:
            report("limit " + what)
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            sys.stderr.write("%s\n" % type(e).__name__)
        finish(1)
    finish(0)


def finish(status):
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status)


def main():
    try:
        pid = os.fork()
    except OSError as e:
        report("startfail fork: %s" % e)
        os._exit(70)
    if pid:
        relay(pid)
    try:
        child()
    except SyntaxError:
        traceback.print_exc(limit=0)
        report("ready")
        finish(1)
    except BaseException as e:  # noqa: B902 -- the sandbox itself failed to start
        report("startfail %s: %s" % (type(e).__name__, e))
        finish(70)


main()
