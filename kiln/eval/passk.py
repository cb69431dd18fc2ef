"""Functional correctness of generated code: problems, sandboxed execution, and pass@k.

A problem file is JSONL with `task_id`, `prompt` (a function signature and docstring),
`tests` (Python with asserts, or a `check(candidate)` function), `entry_point` (the function's
name) and optionally `canonical_solution`. A sample is judged by `kiln.eval.sandbox.run_tests`:
`prompt + completion` runs in one sandbox, `prompt + tests` (plus `check(entry_point)` when the
tests define `check`) in another, and the tests call the candidate across a plain-data pipe.
`build_program` gives the single-program form (`run_python`), for reading and debugging.
"""

from __future__ import annotations

import importlib.resources
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.errors import DataError
from kiln.eval.jsonl import read_jsonl
from kiln.eval.sandbox import SandboxLimits, SandboxResult, ensure_available, run_tests

# Where a completion of a function body ends: the next top-level statement.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@")


@dataclass
class Problem:
    task_id: str
    prompt: str
    tests: str
    entry_point: str
    canonical_solution: str | None = None
    where: str = ""  # file:line, for messages


@dataclass
class SampleResult:
    task_id: str
    completion: str
    result: SandboxResult


@dataclass
class PassKReport:
    pass_at_k: dict[str, float]  # "pass@1" -> mean over problems
    n_problems: int
    n_samples: int  # per problem
    per_task: dict[str, dict] = field(default_factory=dict)  # task_id -> {correct, n, statuses, errors}
    isolation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"pass_at_k": self.pass_at_k, "n_problems": self.n_problems, "n_samples": self.n_samples,
                "per_task": self.per_task, "isolation": self.isolation}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): 1 - C(n-c, k) / C(n, k), as a stable product.

    C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def default_problems_path() -> Path:
    return Path(str(importlib.resources.files("kiln") / "resources" / "problems" / "basic.jsonl"))


def load_problems(path: str | Path | None = None) -> list[Problem]:
    path = Path(path) if path is not None else default_problems_path()
    rows = read_jsonl(path, required={"task_id": str, "prompt": str, "tests": str, "entry_point": str},
                      optional={"canonical_solution": str})
    problems, seen = [], {}
    for row in rows:
        task_id = row.data["task_id"]
        if task_id in seen:
            raise DataError(f"{row.where}: duplicate task_id {task_id!r} (first at line {seen[task_id]})")
        seen[task_id] = row.line
        if not row.data["entry_point"].isidentifier():
            raise DataError(f"{row.where}: entry_point {row.data['entry_point']!r} is not a Python name")
        problems.append(Problem(task_id, row.data["prompt"], row.data["tests"], row.data["entry_point"],
                                row.data.get("canonical_solution"), row.where))
    return problems


def truncate_completion(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """Cut a generated function body at the first stop sequence."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def build_program(problem: Problem, completion: str) -> str:
    program = problem.prompt + completion + "\n\n" + problem.tests + "\n"
    if "def check(" in problem.tests:
        program += f"\ncheck({problem.entry_point})\n"
    return program


def judge(problem: Problem, completion: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """One sample's verdict; the candidate cannot reach it (see `kiln.eval.sandbox.run_tests`)."""
    return run_tests(problem.prompt + completion, problem.entry_point, checker_setup(problem.prompt),
                     problem.tests, "def check(" in problem.tests, limits)


def checker_setup(prompt: str) -> str:
    """The prompt as the checker runs it (for its helpers and imports): given a body if it lacks one."""
    for source in (prompt, prompt + "    pass\n"):
        try:
            compile(source, "prompt.py", "exec")
            return source
        except (SyntaxError, ValueError):
            continue
    return ""  # the tests then see only the candidate


def run_samples(problems: list[Problem], completions: dict[str, list[str]],
                limits: SandboxLimits | None = None, workers: int = 2) -> list[SampleResult]:
    """Judge every completion of every problem in the sandbox, `workers` at a time.

    Raises `SandboxUnavailable` before running anything where there is no sandbox and
    `limits.allow_unisolated` is not set.
    """
    limits = limits or SandboxLimits()
    ensure_available(limits)
    jobs = [(p, c) for p in problems for c in completions.get(p.task_id, [])]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda job: judge(*job, limits), jobs))
    return [SampleResult(p.task_id, c, r) for (p, c), r in zip(jobs, results)]


def score(problems: list[Problem], samples: list[SampleResult], ks: list[int]) -> PassKReport:
    """pass@k averaged over problems, for each k no larger than the samples per problem."""
    by_task: dict[str, list[SampleResult]] = {p.task_id: [] for p in problems}
    for s in samples:
        by_task[s.task_id].append(s)
    n_min = min((len(v) for v in by_task.values()), default=0)
    if n_min == 0:
        raise DataError("pass@k needs at least one sample for every problem")
    valid_ks = [k for k in ks if k <= n_min]
    per_task, scores = {}, {f"pass@{k}": [] for k in valid_ks}
    for task_id, runs in by_task.items():
        correct = sum(r.result.passed for r in runs)
        statuses: dict[str, int] = {}
        for r in runs:
            statuses[r.result.status] = statuses.get(r.result.status, 0) + 1
        per_task[task_id] = {
            "n": len(runs), "correct": correct, "statuses": statuses,
            "errors": sorted({r.result.detail for r in runs if not r.result.passed and r.result.detail})[:5],
        }
        for k in valid_ks:
            scores[f"pass@{k}"].append(pass_at_k(len(runs), correct, k))
    isolation = samples[0].result.isolation if samples else {}
    return PassKReport({key: float(np.mean(v)) for key, v in scores.items()}, len(problems), n_min,
                       per_task, isolation)
