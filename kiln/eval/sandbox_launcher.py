"""The inside of the code sandbox: runs in a fresh `python -I -S -B` (see `kiln.eval.sandbox`).

Standard library only: under bubblewrap this file is bind-mounted at /kiln/launcher.py next to
`sandbox_wire.py` (the checker <-> candidate channel), and nothing else of kiln (nor any
site-packages) is visible.

The launcher process reads its config (as root when the evaluator is root), forks the worker and
reports to the evaluator, over an fd the worker closes, how the worker ended. The worker drops
root to uid 65534, sets rlimits, makes itself non-dumpable, installs a seccomp filter and
(optionally) an audit hook, then runs one of three roles:

- `program`: exec a whole program; it passes when it runs to the end (a random token the worker
  writes after the program proves that; code written to forge it can find the token in its own
  memory, so pass@k does not use this role for verdicts);
- `candidate`: exec the prompt + completion, then serve calls to the entry point
  (`sandbox_wire.serve_calls`: one request line per call on fd `req`, one response on `resp`);
- `checker`: exec the prompt (helpers), bind the entry point's name to a proxy that calls the
  candidate process, exec the tests. Candidate code never runs in this process, and results come
  back as plain data (no user classes), so the candidate can neither reach this verdict nor hand
  the tests an object whose `__eq__` lies.

The seccomp filter is a hand-written classic-BPF program loaded with prctl(2) through ctypes: the
PyPI bindings (`seccomp`, `pyseccomp`) need the system's libseccomp, which a fresh machine set up
by pip alone may lack, and the filter is a short deny list.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys

if __package__:  # imported by the evaluator (kiln.eval.sandbox) or the tests
    from kiln.eval import sandbox_wire as wire
else:  # the launcher script: `python -I` leaves its own directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sandbox_wire as wire

    del sys.path[0]  # samples must not import this directory's other files

EXIT_OK, EXIT_ASSERT, EXIT_EXCEPTION, EXIT_MEMORY, EXIT_SYSEXIT, EXIT_BLOCKED = 0, 1, 2, 3, 4, 5
EXIT_SETUP, EXIT_CANDIDATE_GONE = 6, 7

# ---- seccomp ------------------------------------------------------------------------------------
# Syscalls refused with EPERM: process creation and exec, other processes' memory and fds,
# sockets, signals to other processes (tgkill stays: abort() needs it), and the
# namespace/mount/kernel-object calls a sandbox never needs. Numbers from the kernel's
# asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64).
_DENY = {
    "x86_64": dict(fork=57, vfork=58, execve=59, execveat=322, ptrace=101, process_vm_readv=310,
                   process_vm_writev=311, kill=62, tkill=200, socket=41, mount=165, umount2=166,
                   pivot_root=155, chroot=161, unshare=272, setns=308, bpf=321, perf_event_open=298,
                   userfaultfd=323, keyctl=250, add_key=248, request_key=249, io_uring_setup=425,
                   init_module=175, finit_module=313, kexec_load=246, open_by_handle_at=304,
                   name_to_handle_at=303, personality=135, mount_setattr=442, fsopen=430,
                   fsmount=432, open_tree=428, move_mount=429, pidfd_open=434, pidfd_getfd=438,
                   pidfd_send_signal=424, process_madvise=440, rt_sigqueueinfo=129,
                   rt_tgsigqueueinfo=297),
    "aarch64": dict(execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271,
                    kill=129, tkill=130, socket=198, mount=40, umount2=39, pivot_root=41, chroot=51,
                    unshare=97, setns=268, bpf=280, perf_event_open=241, userfaultfd=282, keyctl=219,
                    add_key=217, request_key=218, io_uring_setup=425, init_module=105,
                    finit_module=273, kexec_load=104, open_by_handle_at=265, name_to_handle_at=264,
                    personality=92, mount_setattr=442, fsopen=430, fsmount=432, open_tree=428,
                    move_mount=429, pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424,
                    process_madvise=440, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435  # same number on both
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_JSET_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38


def seccomp_program(machine: str) -> bytes:
    """The filter as packed `struct sock_filter`s (seccomp_data: nr at 0, arch at 4, args at 16)."""
    deny, prog = _DENY[machine], []

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append(struct.pack("=HBBI", code, jt, jf, k))

    op(_BPF_LD_W_ABS, 4)
    op(_BPF_JEQ_K, _AUDIT_ARCH[machine], 1, 0)
    op(_BPF_RET_K, _RET_KILL_PROCESS)  # a foreign ABI (e.g. 32-bit int 0x80) has other numbers
    op(_BPF_LD_W_ABS, 0)
    if machine == "x86_64":
        op(_BPF_JGE_K, _X32_BIT, 0, 1)  # the x32 ABI reuses numbers with this bit set
        op(_BPF_RET_K, _RET_ERRNO | _EPERM)
    for nr in sorted(set(deny.values())):
        op(_BPF_JEQ_K, nr, 0, 1)
        op(_BPF_RET_K, _RET_ERRNO | _EPERM)
    op(_BPF_JEQ_K, _CLONE3, 0, 1)  # its flags sit behind a pointer BPF cannot read; glibc falls
    op(_BPF_RET_K, _RET_ERRNO | _ENOSYS)  # back to clone(2) on ENOSYS, checked below
    op(_BPF_JEQ_K, _CLONE[machine], 0, 4)
    op(_BPF_LD_W_ABS, 16)  # low 32 bits of args[0] (the flags) on little-endian machines
    op(_BPF_JSET_K, _CLONE_THREAD, 0, 1)
    op(_BPF_RET_K, _RET_ALLOW)  # a thread of this process
    op(_BPF_RET_K, _RET_ERRNO | _EPERM)  # a new process
    op(_BPF_RET_K, _RET_ALLOW)
    return b"".join(prog)


def install_seccomp(libc) -> str:
    import ctypes

    machine = os.uname().machine
    if machine not in _DENY:
        return f"unavailable (no syscall table for {machine})"
    code = seccomp_program(machine)
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0 or \
            libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) != 0:
        return f"unavailable (prctl: {os.strerror(ctypes.get_errno())})"
    return "process creation, exec, sockets, kill, ptrace, mounts, namespaces denied"


# ---- setup of the worker ------------------------------------------------------------------------

def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


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
    nproc = int(cfg["nproc"]) + int(cfg["nproc_base"])
    cap(resource.RLIMIT_NPROC, nproc)
    isolation["nproc"] = (f"RLIMIT_NPROC={nproc} (the uid's {cfg['nproc_base']} existing tasks + {cfg['nproc']}; "
                          "a backup: seccomp refuses new processes)")


def _drop_root(cfg: dict, isolation: dict) -> None:
    """A root worker becomes uid 65534 (`nobody`); without bwrap it imports PREIMPORT first."""
    if cfg["bwrap"]:
        if os.geteuid() == 0:  # bwrap left us CAP_SETUID/SETGID for this; setuid clears them
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            isolation["user"] = "uid 65534 (outside the sandbox too)"
        else:
            isolation["user"] = "uid 65534 in a user namespace (the evaluator's uid outside)"
        return
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


def _install_audit_hook(work: str) -> None:
    """Defense in depth (not a boundary): refuse process creation, sockets, ctypes, writes outside `work`."""
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


def exit_code_for(e: BaseException) -> int:
    if isinstance(e, AssertionError):
        return EXIT_ASSERT
    if isinstance(e, MemoryError):
        return EXIT_MEMORY
    if isinstance(e, SystemExit):
        return EXIT_SYSEXIT
    if isinstance(e, wire.CandidateGone):
        return EXIT_CANDIDATE_GONE
    if isinstance(e, PermissionError) and str(e).startswith("kiln sandbox:"):
        return EXIT_BLOCKED
    return EXIT_EXCEPTION


# ---- the two processes --------------------------------------------------------------------------

def _run_worker(cfg: dict, isolation: dict, done_w: int, nonce: bytes) -> None:
    """Body of the worker process; never returns."""
    import resource  # noqa: F401  (imported while the interpreter is still readable; see PREIMPORT)
    import traceback

    try:
        libc = _libc()
        os.chdir(cfg["work"])
        _drop_root(cfg, isolation)
        _set_limits(cfg, isolation)  # after the drop: RLIMIT_NPROC then applies to `nobody`
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
        # PR_SET_DUMPABLE 0: without namespaces, another sample of the same uid could otherwise
        # open this process's /proc/PID/mem (seccomp only covers ptrace and process_vm_*).
        libc.prctl(4, 0)
        isolation["seccomp"] = install_seccomp(libc) if cfg["seccomp"] else "off"
        if cfg["audit_guard"]:
            _install_audit_hook(cfg["work"])
        os.write(done_w, (json.dumps(isolation) + "\n").encode())
        sys.dont_write_bytecode = True
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_SETUP)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        try:
            exec(compile(cfg["source"], "program.py", "exec"), namespace)
        except Exception as e:  # a broken completion: tell the checker why (SyntaxError, ...)
            if cfg["role"] == "candidate":
                wire.send_quietly(cfg["resp_fd"], {"error": [type(e).__name__, str(e)[:2000]]})
            raise
        if cfg["role"] == "candidate":
            wire.serve_calls(namespace, cfg)
        elif cfg["role"] == "checker":
            namespace[cfg["entry_point"]] = proxy = wire.Proxy(cfg)
            exec(compile(cfg["tests"], "tests.py", "exec"), namespace)
            if cfg["call_check"]:
                namespace["check"](proxy)
        exit_code = EXIT_OK
    except BaseException as e:
        exit_code = exit_code_for(e)
        try:
            traceback.print_exc()
        except BaseException:
            pass
    if exit_code == EXIT_OK:
        os.write(done_w, nonce)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(exit_code)


def main(config_path: str, status_fd: int) -> None:
    with open(config_path, encoding="utf-8") as f:  # read before any fork or privilege drop
        cfg = json.load(f)
    isolation: dict = {"audit_guard": bool(cfg["audit_guard"])}
    nonce = os.urandom(16).hex().encode()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(done_r)
        os.close(status_fd)
        _run_worker(cfg, isolation, done_w, nonce)
    os.close(done_w)
    for fd in (cfg.get("req_fd"), cfg.get("resp_fd")):
        if fd is not None:
            os.close(fd)  # only the worker talks to the other process
    _, status = os.waitpid(pid, 0)
    report, verdict = b"", {}
    while len(report) <= 1 << 16 and (chunk := os.read(done_r, 65536)):
        report += chunk
    first, _, rest = report.partition(b"\n")
    try:
        verdict["isolation"] = json.loads(first.decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        verdict["setup_error"] = "the sample process ended during setup"
    if os.WIFSIGNALED(status):
        verdict["signal"] = os.WTERMSIG(status)
    else:
        verdict["exit"] = os.WEXITSTATUS(status)
        if verdict["exit"] == EXIT_SETUP:
            verdict["setup_error"] = "see stderr"
    verdict["completed"] = rest == nonce
    os.write(status_fd, json.dumps(verdict).encode())
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
