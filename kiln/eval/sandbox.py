"""Run untrusted generated Python in a separate, resource-limited interpreter.

Each call starts a fresh `python -I -S -B` running this file as a launcher. The launcher

1. moves into new network and PID namespaces (`unshare(2)` via ctypes; as non-root inside a new
   user namespace). A new network namespace has only a downed loopback, so every connect fails;
   the PID namespace means that when the sample's process (PID 1 there) dies, the kernel kills
   everything it forked, even children that escaped its process group with `setsid`;
2. forks the sample process, which sets RLIMIT_CPU / AS / FSIZE / NPROC / NOFILE / CORE, drops
   root to `nobody` (RLIMIT_NPROC is not enforced for root), installs an audit hook (defense in
   depth: blocks process creation, sockets, ctypes and writes outside its directory), and execs
   the program inside a throwaway directory with stdin closed;
3. reports to the evaluator over a pipe: how the sample ended and which isolation was active.

The evaluator enforces the wall-clock limit by killing the launcher's process group. Stdout and
stderr go to files, so RLIMIT_FSIZE also caps how much output a sample can produce.

This file must only import the standard library at top level: it is also the launcher script.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

STATUSES = ("passed", "failed", "timeout", "memory", "error")

# Launcher exit codes of the sample process (decoded by `_classify`).
_EXIT_OK, _EXIT_ASSERT, _EXIT_EXCEPTION, _EXIT_MEMORY, _EXIT_SYSEXIT, _EXIT_BLOCKED = 0, 1, 2, 3, 4, 5
_EXIT_SETUP = 6

# Modules imported before dropping to `nobody`, because a root-only interpreter install (e.g.
# pyenv under /root) is unreadable to `nobody` afterwards; they are then served from sys.modules.
PREIMPORT = (
    "math", "cmath", "collections", "collections.abc", "itertools", "functools", "operator", "re",
    "string", "heapq", "bisect", "typing", "dataclasses", "json", "random", "statistics",
    "fractions", "decimal", "copy", "array", "datetime", "enum", "textwrap", "unicodedata",
    "hashlib", "struct", "time", "traceback", "linecache",
)


@dataclass
class SandboxLimits:
    wall_s: float = 10.0  # killed (process group) after this long
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS (address space)
    nproc: int = 16  # RLIMIT_NPROC: processes the sample's user may have
    fsize_mb: int = 16  # RLIMIT_FSIZE: largest file (stdout/stderr included)
    nofile: int = 64  # RLIMIT_NOFILE
    audit_guard: bool = True  # in-child audit hook (defense in depth)
    namespaces: bool = True  # network/PID namespaces when the OS allows (False: test the fallback)
    preimport: tuple[str, ...] = PREIMPORT

    def validate(self) -> None:
        for key in ("wall_s", "cpu_s", "memory_mb", "nproc", "fsize_mb", "nofile"):
            if getattr(self, key) <= 0:
                from kiln.errors import ConfigError

                raise ConfigError(f"sandbox limit {key}={getattr(self, key)} must be > 0")


@dataclass
class SandboxResult:
    passed: bool
    status: str  # one of STATUSES
    detail: str  # why, in a few words (exception type, signal, limit hit)
    stdout_tail: str
    stderr_tail: str
    duration_s: float
    isolation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_python(code: str, limits: SandboxLimits | None = None, tail_chars: int = 2000) -> SandboxResult:
    """Run `code` as a program in the sandbox; it passes when it runs to the end without raising."""
    limits = limits or SandboxLimits()
    limits.validate()
    start = time.monotonic()
    box = tempfile.mkdtemp(prefix="kiln-sandbox-")
    try:
        work = os.path.join(box, "work")  # the sample's cwd; everything else in `box` is ours
        os.mkdir(work)
        program = os.path.join(work, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(program, 0o644)
        if os.geteuid() == 0:
            uid, gid = _nobody()
            if uid is not None:
                os.chown(work, uid, gid)
                os.chmod(box, 0o711)  # `nobody` may traverse to work/, not list or write box/
        config = {
            "program": program, "work": work, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
            "nproc": limits.nproc, "fsize_mb": limits.fsize_mb, "nofile": limits.nofile,
            "audit_guard": limits.audit_guard, "preimport": list(limits.preimport),
            "namespaces": limits.namespaces,
        }
        out_path, err_path = os.path.join(box, "stdout"), os.path.join(box, "stderr")
        verdict_r, verdict_w = os.pipe()
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config),
                     str(verdict_w)],
                    cwd=work, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    pass_fds=(verdict_w,), start_new_session=True, close_fds=True,
                )
            os.close(verdict_w)
            verdict_w = -1
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)
            proc.wait()
            verdict = _read_verdict(verdict_r)
        finally:
            os.close(verdict_r)
            if verdict_w >= 0:
                os.close(verdict_w)
        stdout, stderr = _tail(out_path, tail_chars), _tail(err_path, tail_chars)
        status, detail = _classify(timed_out, verdict, stderr, limits)
        return SandboxResult(status == "passed", status, detail, stdout, stderr,
                             round(time.monotonic() - start, 4), verdict.get("isolation", {}))
    finally:
        shutil.rmtree(box, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_verdict(fd: int) -> dict:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:  # a leftover writer holds the pipe open; take what is there
        pass
    try:
        return json.loads(b"".join(chunks).decode() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * chars))
        return f.read().decode("utf-8", errors="replace")[-chars:]


def _classify(timed_out: bool, verdict: dict, stderr: str, limits: SandboxLimits) -> tuple[str, str]:
    if timed_out:
        return "timeout", f"wall-clock limit {limits.wall_s}s"
    if not verdict:
        return "error", "the sandbox launcher ended without a verdict"
    if verdict.get("setup_error"):
        return "error", f"sandbox setup failed: {verdict['setup_error']}"
    sig, code = verdict.get("signal"), verdict.get("exit")
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "timeout", f"CPU limit {limits.cpu_s}s ({name})"
        if sig == signal.SIGXFSZ:
            return "error", f"file/output size limit {limits.fsize_mb} MB ({name})"
        if sig == signal.SIGSEGV and "MemoryError" in stderr:
            return "memory", f"memory limit {limits.memory_mb} MB ({name})"
        return "error", f"killed by {name}"
    if code == _EXIT_OK:
        return ("passed", "") if verdict.get("completed") else ("failed", "exited before the program finished")
    if code == _EXIT_MEMORY or (code == _EXIT_EXCEPTION and "MemoryError" in stderr):
        return "memory", f"memory limit {limits.memory_mb} MB (MemoryError)"
    if code == _EXIT_ASSERT:
        return "failed", "AssertionError"
    if code == _EXIT_SYSEXIT:
        return "failed", "exited (SystemExit) before the program finished"
    if code == _EXIT_BLOCKED:
        return "error", "blocked by the sandbox: " + _last_line(stderr)
    if code == _EXIT_EXCEPTION:
        return "error", _last_line(stderr) or "exception"
    return "error", f"exit status {code}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _nobody() -> tuple[int | None, int | None]:
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return None, None


def capabilities() -> dict:
    """Which isolation a sandboxed sample gets on this machine (runs a tiny probe program)."""
    result = run_python("pass", SandboxLimits(wall_s=20))
    return result.isolation


# ------------------------------------------------------------------------------------------------
# Launcher side: everything below runs in the fresh interpreter (`python -I -S -B sandbox.py ...`).

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG = 1


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _unshare(libc, flags: int) -> bool:
    import ctypes

    return libc.unshare(ctypes.c_int(flags)) == 0


def _enter_namespaces(libc, isolation: dict) -> None:
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    base = 0 if root else _CLONE_NEWUSER  # unprivileged users may create namespaces in a user ns
    if _CONFIG.get("namespaces", True) and _unshare(libc, base | _CLONE_NEWNET | _CLONE_NEWPID):
        isolation.update(network="netns", pid_namespace=True)
    elif _CONFIG.get("namespaces", True) and _unshare(libc, base | _CLONE_NEWNET):
        isolation.update(network="netns", pid_namespace=False)
    else:
        isolation.update(network="audit-hook" if _CONFIG["audit_guard"] else "none", pid_namespace=False)
    if not root and isolation["network"] == "netns":
        # Map our uid/gid to themselves, else files the sample creates would have no owner (EOVERFLOW).
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            isolation["user_namespace"] = True
        except OSError as e:
            isolation["user_namespace"] = f"unmapped ({e}); the sample cannot create files"


def _count_my_processes(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            count += int(line.split()[1]) == uid
                            break
            except OSError:
                continue
    return count


def _set_limits(cfg: dict, isolation: dict) -> None:
    import resource

    def cap(which: int, soft: int, hard: int | None = None) -> None:
        current_hard = resource.getrlimit(which)[1]
        hard = soft if hard is None else hard
        if current_hard != resource.RLIM_INFINITY:  # never try to raise a hard limit
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))

    cpu = int(cfg["cpu_s"])
    cap(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    cap(resource.RLIMIT_AS, int(cfg["memory_mb"]) << 20)
    cap(resource.RLIMIT_FSIZE, int(cfg["fsize_mb"]) << 20)
    cap(resource.RLIMIT_NOFILE, int(cfg["nofile"]))
    cap(resource.RLIMIT_CORE, 0)
    nproc = int(cfg["nproc"])
    if isolation.get("user") == "nobody":
        isolation["nproc"] = f"RLIMIT_NPROC={nproc} for uid nobody"
    elif os.geteuid() == 0:
        isolation["nproc"] = "not enforced (still root)"
    else:
        # RLIMIT_NPROC counts every process of the real uid, the evaluator's own included.
        nproc += int(cfg["existing_processes"])
        isolation["nproc"] = f"RLIMIT_NPROC={nproc} for uid {os.getuid()} (its existing processes + {cfg['nproc']})"
    cap(resource.RLIMIT_NPROC, nproc)


def _drop_privileges(cfg: dict, isolation: dict) -> None:
    if os.geteuid() != 0:
        isolation["user"] = f"uid {os.getuid()} (unchanged, not root)"
        return
    import pwd

    for name in cfg["preimport"]:
        try:
            __import__(name)
        except ImportError:
            pass
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        isolation["user"] = "root (no 'nobody' user to drop to)"
        return
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    isolation["user"] = "nobody"


def _install_guard(work: str) -> None:
    """Audit hook: refuse process creation, sockets, ctypes and filesystem writes outside `work`."""
    root = os.path.realpath(work)
    blocked = {
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "socket.__new__", "socket.connect",
        "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
        "socket.gethostbyname", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.chdir",
        "os.setuid", "resource.setrlimit", "resource.prlimit", "sys.remote_exec",
    }
    path_events = {  # event -> indexes of path arguments
        "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.chmod": (0,),
        "os.chown": (0,), "os.symlink": (0, 1), "os.link": (0, 1), "os.truncate": (0,),
        "os.utime": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
    }
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fspath, sep, join = os.path.realpath, os.fspath, os.sep, os.path.join
    busy = [False]

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an fd it already holds
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        full = realpath(join(root, path))
        return full == root or full.startswith(root + sep) or full == "/dev/null"

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            if event in blocked:
                raise PermissionError(f"kiln sandbox: {event} is not allowed")
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                    (mode is None and isinstance(flags, int) and flags & writes)
                if writing and not inside(path):
                    raise PermissionError(f"kiln sandbox: writing {path!r} outside the sandbox directory")
            elif event in path_events:
                for i in path_events[event]:
                    if i < len(args) and args[i] is not None and not inside(args[i]):
                        raise PermissionError(f"kiln sandbox: {event} on {args[i]!r} outside the sandbox directory")
        finally:
            busy[0] = False

    sys.addaudithook(hook)


def _exit_code_for(e: BaseException) -> int:
    if isinstance(e, AssertionError):
        return _EXIT_ASSERT
    if isinstance(e, MemoryError):
        return _EXIT_MEMORY
    if isinstance(e, SystemExit):
        return _EXIT_SYSEXIT
    if isinstance(e, PermissionError) and str(e).startswith("kiln sandbox:"):
        return _EXIT_BLOCKED
    return _EXIT_EXCEPTION


def _run_sample(cfg: dict, isolation: dict, done_w: int, nonce: bytes) -> None:
    """Body of the sample process; never returns."""
    import resource  # noqa: F401  (imported while the interpreter is still readable; see PREIMPORT)
    import traceback

    try:
        libc = _libc()
        with open(cfg["program"], encoding="utf-8") as f:
            source = f.read()
        os.chdir(cfg["work"])
        _drop_privileges(cfg, isolation)
        _set_limits(cfg, isolation)  # after the drop: RLIMIT_NPROC then applies to `nobody`
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the launcher (set after the uid change)
        os.write(done_w, (json.dumps(isolation) + "\n").encode())
        if cfg["audit_guard"]:
            _install_guard(cfg["work"])
        sys.dont_write_bytecode = True
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(_EXIT_SETUP)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
        exit_code = _EXIT_OK
    except BaseException as e:
        exit_code = _exit_code_for(e)
        try:
            traceback.print_exc()
        except BaseException:
            pass
    if exit_code == _EXIT_OK:
        os.write(done_w, nonce)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(exit_code)


def _launcher_main(config_json: str, verdict_fd: int) -> None:
    global _CONFIG
    cfg = _CONFIG = json.loads(config_json)
    isolation: dict = {"audit_guard": bool(cfg["audit_guard"])}
    verdict: dict = {}
    # Counted before entering a user namespace, where every unmapped uid reads as 65534.
    cfg["existing_processes"] = _count_my_processes(os.getuid()) if os.geteuid() != 0 else 0
    try:
        _enter_namespaces(_libc(), isolation)
    except OSError as e:  # ctypes/libc unavailable: rely on limits and the audit hook
        isolation.update(network="audit-hook" if cfg["audit_guard"] else "none", pid_namespace=False,
                         namespace_error=str(e))
    nonce = os.urandom(16).hex().encode()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(done_r)
        os.close(verdict_fd)
        _run_sample(cfg, isolation, done_w, nonce)
    os.close(done_w)
    _, status = os.waitpid(pid, 0)
    report = b""
    while chunk := os.read(done_r, 65536):
        report += chunk
        if len(report) > 1 << 16:
            break
    first, _, rest = report.partition(b"\n")
    try:
        isolation = json.loads(first.decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        verdict["setup_error"] = "the sample process ended during setup"
    verdict["isolation"] = isolation
    if os.WIFSIGNALED(status):
        verdict["signal"] = os.WTERMSIG(status)
    else:
        verdict["exit"] = os.WEXITSTATUS(status)
        if verdict["exit"] == _EXIT_SETUP:
            verdict["setup_error"] = "see stderr"
    verdict["completed"] = rest == nonce
    os.write(verdict_fd, json.dumps(verdict).encode())
    os._exit(0)


_CONFIG: dict = {}

if __name__ == "__main__":
    _launcher_main(sys.argv[1], int(sys.argv[2]))
