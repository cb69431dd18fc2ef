"""Hostile samples against kiln.eval.sandbox: each must be scored not-passed and leave nothing behind.

Most attacks go through `kiln.eval.passk.judge`, the path `kiln eval --passk-file` scores with.
Each attack asserts its own success, so an attack the sandbox stops ends the sample as an error,
and a test also checks the host for what the attack tried to leave (files, processes, connections).

Without a working bubblewrap sandbox these tests skip, saying why; with KILN_REQUIRE_SANDBOX=1 (set
it in CI) they fail instead.
"""

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kiln.eval.passk import Problem, default_problems_path, judge
from kiln.eval.sandbox import (PREIMPORT, SandboxLimits, SandboxUnavailable, _bwrap_probe, run_python,
                               run_tests)

FAST = dict(wall_s=8.0, cpu_s=3)
ADD = Problem("t/add", "def add(a, b):\n", "def check(candidate):\n    assert candidate(2, 3) == 5\n"
              "    assert candidate(-1, 1) == 0\n", "add")

_BWRAP, _WHY = _bwrap_probe()
if _BWRAP is None and os.environ.get("KILN_REQUIRE_SANDBOX"):
    raise RuntimeError(f"KILN_REQUIRE_SANDBOX is set but the sandbox is unavailable: {_WHY}")


def needs_sandbox(test):
    """Skip without a sandbox; afterwards, no sandbox process or box directory may remain."""
    return pytest.mark.usefixtures("leaves_nothing")(
        pytest.mark.skipif(_BWRAP is None, reason=f"no namespace sandbox here: {_WHY}")(test))


@pytest.fixture
def leaves_nothing(tmp_path_factory, monkeypatch):
    boxes = tmp_path_factory.mktemp("boxes")  # every sandbox's box (and so its argv) lands here
    monkeypatch.setattr(tempfile, "tempdir", str(boxes))
    yield
    deadline = time.monotonic() + 5
    while (left := _processes_mentioning(str(boxes))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [] and list(boxes.iterdir()) == []


def attack(body: str, limits: dict | None = None):
    """Judge a completion of `add` that runs `body` (indented into the function) before answering."""
    completion = "".join(f"    {line}\n" for line in body.strip("\n").splitlines()) + "    return a + b\n"
    return judge(ADD, completion, SandboxLimits(**{**FAST, **(limits or {})}))


def refused(result) -> bool:
    """Scored an error because the sandbox refused (EPERM, the audit hook, or the attack's own assert)."""
    return not result.passed and result.status == "error" and any(
        why in result.detail for why in ("Operation not permitted", "blocked by the sandbox",
                                         "candidate raised AssertionError"))


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if text.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                continue
    return found


def _marker() -> str:
    return f"kiln-attack-{uuid.uuid4().hex}"


@needs_sandbox
@pytest.mark.timeout(60)
def test_canonical_passes_and_wrong_fails_through_judge():
    assert attack("pass").passed
    wrong = judge(ADD, "    return a - b\n", SandboxLimits(**FAST))
    assert wrong.status == "failed" and "AssertionError" in wrong.detail
    broken = judge(ADD, "    return (a +\n", SandboxLimits(**FAST))
    assert broken.status == "error" and broken.detail.startswith("SyntaxError"), broken
    missing = judge(ADD, "    return a + b\ndel add\n", SandboxLimits(**FAST))
    assert missing.status == "error" and "NameError" in missing.detail, missing
    expects_raise = Problem("t/inv", "def inv(x):\n", "def check(candidate):\n    try:\n        candidate(0)\n"
                            "    except ZeroDivisionError:\n        pass\n    else:\n        assert False\n"
                            "    assert candidate(4) == 0.25\n    assert candidate.__name__ == 'inv'\n", "inv")
    assert judge(expects_raise, "    return 1 / x\n", SandboxLimits(**FAST)).passed
    threads = ("import threading\nbox = []\nt = threading.Thread(target=box.append, args=(1,))\n"
               "t.start()\nt.join()\nassert box")
    assert attack(threads).passed  # the seccomp filter lets a process start threads
    isolation = attack("pass").isolation
    assert isolation["sandbox"] == "bwrap" and "denied" in isolation["seccomp"] and isolation["pid_namespace"]


@needs_sandbox
@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root the sample keeps the evaluator's uid by design")
def test_a_root_evaluator_runs_samples_as_uid_65534_outside_too():
    import threading

    done = []
    runner = threading.Thread(target=lambda: done.append(attack("import time\ntime.sleep(1.0)")))
    runner.start()
    uids = set()
    while runner.is_alive():
        for pid in _processes_mentioning("/kiln/launcher.py"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            uids.add(tuple(status.split("Uid:")[1].split("\n")[0].split()))
        time.sleep(0.05)
    runner.join()
    assert done[0].passed and done[0].isolation["user"].startswith("uid 65534 (outside")
    assert ("65534",) * 4 in uids, uids  # real, effective, saved and filesystem uid of the worker


@needs_sandbox
@pytest.mark.timeout(60)
@pytest.mark.parametrize("eq_attack", [
    "class Liar:\n    def __eq__(self, other):\n        return True\nreturn Liar()",
    "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\nreturn Liar(0)",
    "class Liar(list):\n    def __eq__(self, other):\n        return True\nreturn Liar()",
])
def test_objects_with_a_lying_eq_cannot_pass(eq_attack):
    result = judge(ADD, "".join(f"    {line}\n" for line in eq_attack.splitlines()), SandboxLimits(**FAST))
    assert not result.passed and result.status == "error" and "plain data" in result.stderr_tail


@needs_sandbox
@pytest.mark.timeout(60)
def test_walking_frames_to_the_verdict_cannot_pass():
    # What forged the old single-process verdict: find the launcher's token and fd, write, exit.
    forge = ("import sys, os, gc\nf = sys._getframe()\nwhile f is not None:\n"
             "    if 'nonce' in f.f_locals and 'done_w' in f.f_locals:\n"
             "        os.write(f.f_locals['done_w'], f.f_locals['nonce'])\n        os._exit(0)\n"
             "    f = f.f_back\n"
             "for o in gc.get_objects():\n    if type(o).__name__ == '_Proxy':\n        raise SystemExit('found')\n"
             "os._exit(0)")
    result = attack(forge)
    assert not result.passed and result.status == "failed", result
    exits = [attack("import sys\nsys.exit(0)"), attack("import os\nos._exit(0)"), attack("raise SystemExit(0)")]
    assert all(r.status == "failed" and not r.passed for r in exits), exits


@needs_sandbox
@pytest.mark.timeout(60)
def test_the_candidate_cannot_read_tests_solutions_or_host_files(tmp_path):
    run = tmp_path / "other-run"
    run.mkdir()
    (run / "config.toml").write_text("secret = 'kiln-run-secret'\n")
    os.chmod(tmp_path, 0o755)
    targets = ["/etc/passwd", str(default_problems_path()), str(run / "config.toml"), "/proc/1/cmdline",
               str(Path(__file__).resolve())]
    for target in targets:
        result = attack(f"print(open({target!r}).read())")
        assert result.status == "error" and "FileNotFoundError" in result.detail, (target, result)
        assert "root:" not in result.stdout_tail and "canonical_solution" not in result.stdout_tail
    # Not even its own config (the launcher read it as root); the tests are in the checker's sandbox.
    own = attack("print(open('/kiln/config.json').read())")
    assert own.status == "error" and "PermissionError" in own.detail, own
    root = attack("import os\nprint(sorted(os.listdir('/')), os.getuid())")
    assert root.passed and "'etc'" not in root.stdout_tail and "'proc'" not in root.stdout_tail
    found = attack("import sys\nprint([p for p in sys.path])\nimport kiln")
    assert found.status == "error" and "ModuleNotFoundError" in found.detail
    # The interpreter's own site-packages (where a non-editable kiln would live) is an empty tmpfs.
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
    if os.path.isdir(base_site) and os.listdir(base_site):
        listing = attack(f"print(sorted(__import__('os').listdir({base_site!r})))")
        assert listing.passed and set(listing.stdout_tail.split()) == {"[]"}, listing


@needs_sandbox
@pytest.mark.timeout(60)
def test_process_creation_is_refused_at_the_syscall_level(tmp_path):
    os.chmod(tmp_path, 0o777)
    marker = _marker()
    # _posixsubprocess.fork_exec never raises an audit event: the seccomp filter refuses the fork.
    fork_exec = ("import _posixsubprocess, os\n"
                 f"cmd = [b'/bin/sh', b'-c', b'touch /tmp/{marker} /dev/shm/{marker} {tmp_path}/{marker}; sleep 30']\n"
                 "r, w = os.pipe()\n"
                 "pid = _posixsubprocess.fork_exec(cmd, [cmd[0]], True, (w,), None, None, -1, -1, -1, -1, -1, -1,"
                 " r, w, True, True, -1, None, None, None, -1, None, False)\n"
                 "assert pid > 0")
    libc_calls = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
                  f"assert libc.system(b'touch /tmp/{marker}') == 0\nassert libc.fork() >= 0")
    samples = [fork_exec, libc_calls, "import os\nos.fork()",
               f"import os\nassert os.system('touch {tmp_path}/{marker}') == 0",
               f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'sleep 30 # {marker}'], check=True)",
               "import os\nos.execv('/bin/sh', ['/bin/sh', '-c', 'exit 0'])"]
    for code in samples:
        for guard in (True, False):  # without the audit hook, only seccomp and the namespaces stop it
            result = attack(code, {"audit_guard": guard, "preimport": PREIMPORT + ("ctypes", "subprocess")})
            assert refused(result), (code, guard, result)
    time.sleep(0.2)
    assert not any(Path(d, marker).exists() for d in ("/tmp", "/dev/shm", str(tmp_path)))
    assert _processes_mentioning(marker) == []


@needs_sandbox
@pytest.mark.timeout(60)
def test_namespaces_still_contain_a_shell_without_seccomp(tmp_path):
    # Defense in depth, and proof the attack above is real: with seccomp and the audit hook off,
    # fork_exec does start /bin/sh, whose files and processes still end with the sandbox.
    os.chmod(tmp_path, 0o777)
    marker = _marker()
    code = ("import _posixsubprocess, os, time\n"
            f"cmd = [b'/bin/sh', b'-c', b'touch /tmp/{marker} /dev/shm/{marker} {tmp_path}/{marker}; sleep 30; true']\n"
            "r, w = os.pipe()\n"
            "pid = _posixsubprocess.fork_exec(cmd, [cmd[0]], True, (w,), None, None, -1, -1, -1, -1, -1, -1,"
            " r, w, True, True, -1, None, None, None, -1, None, False)\n"
            f"for _ in range(100):\n    if os.path.exists('/tmp/{marker}'):\n        break\n    time.sleep(0.05)\n"
            f"assert os.path.exists('/tmp/{marker}')")
    result = attack(code, {"seccomp": False, "audit_guard": False})
    assert result.passed and result.isolation["seccomp"] == "off", result
    time.sleep(0.2)
    assert not any(Path(d, marker).exists() for d in ("/tmp", "/dev/shm", str(tmp_path)))
    assert _processes_mentioning(marker) == []


@needs_sandbox
@pytest.mark.timeout(60)
def test_signals_cannot_reach_host_processes():
    victim = subprocess.Popen(["sleep", "60"], user=65534, group=65534, extra_groups=[]) if os.geteuid() == 0 \
        else subprocess.Popen(["sleep", "60"])
    try:
        for code in (f"import os\nos.kill({victim.pid}, 9)", "import os\nos.kill(-1, 9)",
                     f"import ctypes\nassert ctypes.CDLL(None).kill({victim.pid}, 9) == 0",
                     "import ctypes\nassert ctypes.CDLL(None).kill(-1, 9) == 0"):
            result = attack(code, {"audit_guard": False})
            assert refused(result), (code, result)
        assert victim.poll() is None  # still alive
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


@needs_sandbox
@pytest.mark.timeout(60)
def test_no_connection_leaves_the_sandbox():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')"
        for guard in (True, False):
            result = attack(code, {"audit_guard": guard, "preimport": PREIMPORT + ("socket",)})
            assert refused(result), result
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@needs_sandbox
@pytest.mark.timeout(60)
def test_writes_through_open_cannot_reach_the_host(tmp_path):
    os.chmod(tmp_path, 0o777)  # so only the sandbox, not file permissions, can stop the write
    marker = _marker()
    for target, guard in ((tmp_path / marker, True), (tmp_path / marker, False),
                          (Path(sys.base_prefix) / marker, False), (Path("/usr/lib") / marker, False)):
        result = attack(f"open({str(target)!r}, 'w').write('x')", {"audit_guard": guard})
        assert result.status == "error" and any(why in result.detail for why in (
            "FileNotFoundError", "Read-only file system", "outside the sandbox")), (target, result)
        assert not target.exists()


@needs_sandbox
@pytest.mark.timeout(60)
def test_disk_quota_and_no_files_outlive_the_sample():
    marker = _marker()
    # 120 MB in many files: each below RLIMIT_FSIZE, together over the tmpfs size.
    flood = (f"chunk = b'x' * (4 << 20)\nfor i in range(30):\n    with open(f'/tmp/{marker}-{{i}}', 'wb') as f:\n"
             "        f.write(chunk)")
    result = attack(flood, {"disk_mb": 16, "fsize_mb": 8, "audit_guard": False})
    assert result.status == "error" and "No space left" in result.detail, result
    shm = attack(f"open('/dev/shm/{marker}', 'wb').write(b'x')", {"audit_guard": False})
    assert shm.status == "error" and "Read-only" in shm.detail, shm
    kept = attack(f"open('/tmp/{marker}', 'w').write('x')\nopen('/work/{marker}', 'w').write('x')")
    assert kept.passed  # allowed inside, and gone with the sandbox's tmpfs
    assert [p for d in ("/tmp", "/dev/shm") for p in Path(d).glob(f"{marker}*")] == []
    assert list(Path("/tmp").glob(f"*/{marker}*")) == []


@needs_sandbox
@pytest.mark.timeout(60)
def test_runaway_candidates_are_stopped():
    start = time.monotonic()
    loop = attack("while True:\n    pass", {"wall_s": 4.0, "cpu_s": 1})
    assert loop.status == "timeout" and time.monotonic() - start < 15
    sleeper = attack("import time\ntime.sleep(60)", {"wall_s": 1.5})
    assert sleeper.status == "timeout" and "wall-clock" in sleeper.detail
    bomb = attack("x = bytearray(8 * 1024 ** 3)", {"memory_mb": 256})
    assert bomb.status == "memory", bomb
    grow = attack("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))", {"memory_mb": 256})
    assert grow.status == "memory", grow


@needs_sandbox
@pytest.mark.timeout(60)
def test_tests_from_a_hostile_problem_file_are_sandboxed_too(tmp_path):
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / _marker()
    result = run_tests("def f():\n    return 1\n", "f", "", f"open({str(marker)!r}, 'w').write('x')\nassert f() == 1\n",
                       False, SandboxLimits(**FAST))
    assert result.status == "error" and not marker.exists()


@needs_sandbox
@pytest.mark.timeout(60)
def test_the_user_namespace_mode_contains_samples_too(monkeypatch, tmp_path):
    # What a root evaluator gets where bwrap cannot run privileged (a container without CAP_SYS_ADMIN).
    import kiln.eval.sandbox as sandbox

    try:
        userns = subprocess.run([_BWRAP, *sandbox._bwrap_args(str(tmp_path), 1 << 20, False), "--", "true"],
                                capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        userns = False
    if not userns:
        pytest.skip("no unprivileged user namespaces here; the privileged mode is tested above")
    monkeypatch.setattr(sandbox, "_bwrap_setup", lambda: (_BWRAP, "", False))
    ok = attack("pass")
    assert ok.passed and ok.isolation["user"].startswith("uid 65534 in a user namespace"), ok
    assert refused(attack("import os\nos.fork()", {"audit_guard": False}))
    passwd = attack("print(open('/etc/passwd').read())")
    assert passwd.status == "error" and "FileNotFoundError" in passwd.detail
    flood = attack("open('/tmp/big', 'wb').write(b'x' * (8 << 20))", {"disk_mb": 4, "audit_guard": False})
    assert flood.status == "error" and "No space left" in flood.detail, flood


# ---- whole programs (run_python) --------------------------------------------------------------------

@needs_sandbox
@pytest.mark.timeout(60)
def test_programs_pass_fail_and_crash():
    ok = run_python("import math\nassert math.sqrt(16) == 4\nprint('hello')", SandboxLimits(**FAST))
    assert ok.passed and ok.stdout_tail.strip() == "hello"
    bad = run_python("assert 1 + 1 == 3, 'arithmetic'", SandboxLimits(**FAST))
    assert bad.status == "failed" and "arithmetic" in bad.stderr_tail
    crash = run_python("def f(:\n  pass", SandboxLimits(**FAST))
    assert crash.status == "error" and crash.detail.startswith("SyntaxError")
    for code in ("import os\nos._exit(0)\nassert False", "raise SystemExit(0)\nassert False"):
        assert run_python(code, SandboxLimits(**FAST)).status == "failed"
    stdin = run_python("import sys\nassert sys.stdin.read() == ''", SandboxLimits(**FAST))
    assert stdin.passed and {"sandbox", "seccomp", "user", "nproc", "network"} <= set(stdin.isolation)
    flood = run_python("while True:\n    print('x' * 1000)", SandboxLimits(fsize_mb=1, **FAST))
    assert flood.status == "error" and "File too large" in flood.detail and len(flood.stdout_tail) <= 2000


# ---- where namespaces are refused -----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_without_namespaces_untrusted_code_needs_an_explicit_opt_in(tmp_path):
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    with pytest.raises(SandboxUnavailable, match="--passk-allow-unsandboxed"):
        run_python(code, SandboxLimits(namespaces=False, **FAST))
    with pytest.raises(SandboxUnavailable):
        judge(ADD, "    return a + b\n", SandboxLimits(namespaces=False, **FAST))
    assert not marker.exists()
    with pytest.warns(RuntimeWarning, match="WITHOUT namespaces"):
        fallback = judge(ADD, "    import os\n    os.fork()\n", SandboxLimits(namespaces=False, allow_unisolated=True,
                                                                          audit_guard=False, **FAST))
    assert refused(fallback) and "Operation not permitted" in fallback.detail
    assert fallback.isolation["filesystem"].startswith("host")
    assert "denied" in fallback.isolation["seccomp"]  # seccomp needs no namespace
    with pytest.warns(RuntimeWarning):
        assert judge(ADD, "    return a + b\n", SandboxLimits(namespaces=False, allow_unisolated=True, **FAST)).passed
    # Without namespaces the checker is visible in /proc; its memory must still be out of reach.
    peek = ("    import os\n    pids = [p for p in os.listdir('/proc') if p.isdigit()"
            " and os.path.exists(f'/proc/{p}/cmdline')"
            " and b'checker.json' in open(f'/proc/{p}/cmdline', 'rb').read()]\n    assert pids\n"
            "    for p in pids:\n        open(f'/proc/{p}/mem', 'rb')\n    return a + b\n")
    with pytest.warns(RuntimeWarning):
        result = judge(ADD, peek, SandboxLimits(namespaces=False, allow_unisolated=True, audit_guard=False, **FAST))
    assert result.status == "error" and "PermissionError" in result.detail, result


def test_sandbox_limits_are_validated():
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="disk_mb"):
        run_python("pass", SandboxLimits(disk_mb=0))


# ---- pieces of the launcher, without a sandbox -------------------------------------------------------

@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_program_is_well_formed(machine):
    import struct

    from kiln.eval import sandbox_launcher as launcher

    code = launcher.seccomp_program(machine)
    ops = [struct.unpack("=HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
    assert 0 < len(ops) < 4096 and ops[-1] == (0x06, 0, 0, 0x7FFF0000)  # ends allowing
    assert ops[0][3] == 4 and ops[1][3] == launcher._AUDIT_ARCH[machine]  # checks the ABI first
    for i, (op, jt, jf, k) in enumerate(ops):
        if op & 0x07 == 0x05:  # a jump: both targets inside the program
            assert i + 1 + max(jt, jf) < len(ops)
    denied = {k for op, jt, jf, k in ops if op == 0x15}
    for name in ("execve", "socket", "kill", "ptrace", "process_vm_writev", "unshare"):
        assert launcher._DENY[machine][name] in denied


def test_plain_data_codec_round_trips_and_refuses_objects():
    from kiln.eval.sandbox_wire import decode, encode

    value = [None, True, 3, -0.5, "s", (1, (2,)), {"k": [1], (1, 2): {3}}, frozenset({1}), b"\x00", 1 + 2j, []]
    assert decode(encode(value)) == value and type(decode(encode(value))[5]) is tuple

    class Liar(int):
        def __eq__(self, other):
            return True

    for bad in (object(), Liar(1), [Liar(1)], {"k": Liar(1)}, lambda: 0):
        with pytest.raises(TypeError, match="plain data"):
            encode(bad)
    for forged in ({"x": 1}, {"t": 1}, {"d": [[1]]}, {"t": [], "d": []}):
        with pytest.raises((ValueError, TypeError)):
            decode(forged)
