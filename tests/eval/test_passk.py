import math
import random

import pytest

from kiln.errors import DataError
from kiln.eval.passk import (Problem, build_program, load_problems, pass_at_k, run_samples, score,
                             truncate_completion)
from kiln.eval.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=3)


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_the_closed_form():
    rng = random.Random(0)
    cases = [(n, c, k) for n in range(1, 31) for c in range(0, n + 1) for k in range(1, n + 1)]
    cases += [(n, rng.randint(0, n), rng.randint(1, n)) for n in rng.sample(range(31, 400), 60)]
    for n, c, k in cases:
        assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-9, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # every 5-subset contains a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert 0 < pass_at_k(2000, 1, 1000) < 1  # huge binomials never formed
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 5, 1)


def test_truncate_completion():
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate_completion("    return 1\n") == "    return 1\n"


def test_shipped_problems_canonical_pass_and_wrong_fail():
    problems = load_problems()
    assert 10 <= len(problems) <= 20
    canonical = {p.task_id: [p.canonical_solution] for p in problems}
    wrong = {p.task_id: ["    return None\n"] for p in problems}
    results = run_samples(problems, {k: canonical[k] + wrong[k] for k in canonical}, LIMITS, workers=2)
    for r in results:
        expected = r.completion != "    return None\n"
        assert r.result.passed == expected, (r.task_id, r.completion, r.result)


def test_score_records_crashes_and_averages():
    problem = Problem("t/double", 'def double(x):\n    """Twice x."""\n', "assert double(2) == 4\n", "double")
    samples = {"t/double": ["    return 2 * x\n", "    return x + x\n", "    return x\n",
                            "    raise RuntimeError('boom')\n", "    while True:\n        pass\n"]}
    report = score([problem], run_samples([problem], samples, SandboxLimits(wall_s=3.0, cpu_s=1)), [1, 2, 10])
    assert report.per_task["t/double"]["correct"] == 2
    statuses = report.per_task["t/double"]["statuses"]
    assert statuses == {"passed": 2, "failed": 1, "error": 1, "timeout": 1}
    assert any("RuntimeError" in e for e in report.per_task["t/double"]["errors"])
    assert report.pass_at_k == {"pass@1": pytest.approx(0.4), "pass@2": pytest.approx(closed_form(5, 2, 2))}
    assert report.isolation


def test_build_program_calls_check():
    problem = Problem("t", "def f():\n", "def check(candidate):\n    assert candidate() == 1\n", "f")
    assert build_program(problem, "    return 1\n").rstrip().endswith("check(f)")


@pytest.mark.parametrize("line, message", [
    ('{"task_id": "a", "prompt": "x", "tests": "y"}', r"bad\.jsonl:2: missing field 'entry_point'"),
    ('{"task_id": "a", "prompt": 3, "tests": "y", "entry_point": "f"}', r"bad\.jsonl:2: field 'prompt' must be a string"),
    ('{"task_id": "a", "prompt": "x", ', r"bad\.jsonl:2: not valid JSON"),
    ('[1, 2]', r"bad\.jsonl:2: expected a JSON object"),
    ('{"task_id": "a", "prompt": "x", "tests": "y", "entry_point": "not a name"}', r"bad\.jsonl:2: entry_point"),
    ('{"task_id": "ok", "prompt": "x", "tests": "y", "entry_point": "f"}', r"bad\.jsonl:2: duplicate task_id"),
])
def test_malformed_problem_files_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task_id": "ok", "prompt": "x", "tests": "y", "entry_point": "f"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        load_problems(path)


def test_jsonl_tolerates_bom_blank_and_comment_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf// problems\r\n\r\n{"task_id": "a", "prompt": "def f():\\n", '
                     b'"tests": "assert f() == 1", "entry_point": "f"}\r\n# end\n')
    problems = load_problems(path)
    assert [p.task_id for p in problems] == ["a"] and problems[0].where.endswith("p.jsonl:3")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_problems(empty)
    with pytest.raises(DataError, match="not found"):
        load_problems(tmp_path / "missing.jsonl")
