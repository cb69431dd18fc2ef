"""Hostile-sample tests for kiln.eval.sandbox: none may harm the host or hang the evaluator."""

import os
import time
from pathlib import Path

import pytest

from kiln.eval.sandbox import PREIMPORT, SandboxLimits, capabilities, run_python

FAST = dict(wall_s=6.0, cpu_s=2)


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


def _wait_gone(text: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.timeout(30)
def test_passing_and_failing_programs():
    ok = run_python("import math\nassert math.sqrt(16) == 4\nprint('hello')", SandboxLimits(**FAST))
    assert ok.passed and ok.status == "passed" and ok.stdout_tail.strip() == "hello"
    bad = run_python("assert 1 + 1 == 3, 'arithmetic'", SandboxLimits(**FAST))
    assert not bad.passed and bad.status == "failed" and "arithmetic" in bad.stderr_tail
    crash = run_python("def f(:\n  pass", SandboxLimits(**FAST))
    assert crash.status == "error" and crash.detail.startswith("SyntaxError")
    raised = run_python("1 / 0", SandboxLimits(**FAST))
    assert raised.status == "error" and "ZeroDivisionError" in raised.detail


@pytest.mark.timeout(30)
def test_early_exit_does_not_count_as_pass():
    for code in ("import os\nos._exit(0)\nassert False", "raise SystemExit(0)\nassert False"):
        result = run_python(code, SandboxLimits(**FAST))
        assert result.status == "failed", (code, result)


@pytest.mark.timeout(30)
def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_python("while True:\n    pass", SandboxLimits(wall_s=4.0, cpu_s=1))
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - start < 15


@pytest.mark.timeout(30)
def test_sleeping_sample_hits_the_wall_clock_limit():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.5, cpu_s=5))
    assert result.status == "timeout" and "wall-clock" in result.detail and result.duration_s < 10


@pytest.mark.timeout(30)
def test_memory_bomb_is_stopped():
    result = run_python("x = bytearray(8 * 1024 ** 3)", SandboxLimits(memory_mb=256, **FAST))
    assert result.status == "memory"
    grow = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))",
                      SandboxLimits(memory_mb=256, **FAST))
    assert grow.status == "memory"


@pytest.mark.timeout(30)
def test_writing_outside_the_directory_is_blocked(tmp_path):
    target = tmp_path / "owned.txt"
    os.chmod(tmp_path, 0o777)  # so only the sandbox, not file permissions, can stop the write
    result = run_python(f"open({str(target)!r}, 'w').write('x')", SandboxLimits(**FAST))
    assert result.status == "error" and not target.exists()
    inside = run_python("open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'",
                        SandboxLimits(**FAST))
    assert inside.passed


@pytest.mark.timeout(30)
def test_file_size_limit():
    result = run_python("f = open('big.bin', 'wb')\nf.write(b'x' * (4 * 1024 ** 2))\nf.close()",
                        SandboxLimits(fsize_mb=1, audit_guard=False, **FAST))
    assert not result.passed and result.status == "error"
    flood = run_python("while True:\n    print('x' * 1000)", SandboxLimits(fsize_mb=1, **FAST))
    assert flood.status == "error" and "File too large" in flood.detail and len(flood.stdout_tail) <= 2000


@pytest.mark.timeout(30)
def test_os_system_and_subprocess_are_blocked(tmp_path):
    marker = tmp_path / "ran"
    os.chmod(tmp_path, 0o777)
    result = run_python(f"import os\nos.system('touch {marker}')", SandboxLimits(**FAST))
    assert result.status == "error" and "os.system" in result.detail and not marker.exists()
    fork = run_python("import os\nos.fork()", SandboxLimits(**FAST))
    assert fork.status == "error" and "os.fork" in fork.detail


@pytest.mark.timeout(30)
def test_socket_connect_fails():
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
            "try:\n    s.connect(('127.0.0.1', 9))\nexcept OSError as e:\n    print('refused', e)\n"
            "else:\n    print('connected')")
    guarded = run_python(code, SandboxLimits(preimport=PREIMPORT + ("socket",), **FAST))
    assert "connected" not in guarded.stdout_tail
    isolation = capabilities()
    if isolation.get("network") != "netns":
        pytest.skip(f"no network namespace on this machine ({isolation}); the audit hook is the guard")
    # Without the audit hook, only the network namespace stands between the sample and loopback.
    unguarded = run_python(code, SandboxLimits(preimport=PREIMPORT + ("socket",), audit_guard=False, **FAST))
    assert unguarded.passed and "refused" in unguarded.stdout_tail, unguarded


@pytest.mark.timeout(60)
def test_fork_bomb_is_contained():
    isolation = capabilities()
    if "RLIMIT_NPROC" not in isolation.get("nproc", ""):
        pytest.skip(f"process count is not enforceable here ({isolation}); refusing to run a fork bomb")
    # The audit hook is off so RLIMIT_NPROC (and the PID namespace) must do the containing.
    bomb = ("import os\nprint(os.getcwd(), flush=True)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    start = time.monotonic()
    result = run_python(bomb, SandboxLimits(wall_s=3.0, cpu_s=2, nproc=4, audit_guard=False))
    assert result.status == "timeout" and time.monotonic() - start < 20
    work_dir = result.stdout_tail.strip().splitlines()[0]
    assert "kiln-sandbox-" in work_dir
    assert _wait_gone(work_dir) == []


@pytest.mark.timeout(30)
def test_children_that_escape_the_process_group_are_killed():
    isolation = capabilities()
    if not isolation.get("pid_namespace"):
        pytest.skip("no PID namespace here: a setsid child can outlive the sample")
    code = ("import os, time\nprint(os.getcwd(), flush=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n")
    result = run_python(code, SandboxLimits(audit_guard=False, **FAST))
    assert result.passed
    assert _wait_gone(result.stdout_tail.strip().splitlines()[0]) == []


@pytest.mark.timeout(30)
def test_stdin_is_closed_and_isolation_is_reported():
    result = run_python("import sys\nassert sys.stdin.read() == ''", SandboxLimits(**FAST))
    assert result.passed
    assert {"network", "pid_namespace", "user", "nproc", "audit_guard"} <= set(result.isolation)
    if os.geteuid() == 0:
        assert result.isolation["user"] in ("nobody", "root (no 'nobody' user to drop to)")


@pytest.mark.timeout(30)
def test_without_namespaces_the_audit_hook_blocks_sockets():
    code = "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))"
    result = run_python(code, SandboxLimits(namespaces=False, preimport=PREIMPORT + ("socket",), **FAST))
    assert result.isolation["network"] == "audit-hook" and result.isolation["pid_namespace"] is False
    assert result.status == "error" and "socket" in result.detail
