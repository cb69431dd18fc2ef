"""Where prep tasks run: one small interface, with a local (process pool) and a Ray implementation.

The executor (`kiln/prep/executor.py`) decides *what* runs (stages, per-shard tasks, resume);
a runner only decides *where*. A task is a module-level function and a tuple of picklable
arguments; it writes its own outputs to the shared output directory and returns a small
JSON-able dict, so any runner that can ship a function call to a machine and bring its return
value back will do.

    runner = make_runner(cfg.run)            # chosen by run.executor
    for result in runner.map(fn, [(a, b), ...]):   # any order; the executor sorts
        ...
    one = runner.call(fn, a, b)               # a single task (e.g. a global step's prepare)
    runner.close()                            # always, also after an error

Adding a runner (e.g. Slurm): write a class with the three methods of `Runner` — `map` submits one
job (or one job-array element) per argument tuple, for instance with `submitit`, which pickles the
function and arguments and returns each job's result, and yields results as jobs finish;
`call` submits one job and waits; `close` cancels what is still queued. Tasks already write
their outputs atomically and record `.work/done/...` files, so a runner may retry a failed task
or rerun the whole job after preemption without extra bookkeeping; it must re-raise a task's
`KilnError` as itself so the CLI prints one line. Register it in `make_runner` under a new
`run.executor` value (and in `RunConfig.validate`). The output directory must be on a filesystem
every node sees.

Process pools come from `multiprocessing` (spawn) and remote tasks from Ray's own API; nothing
here schedules work by hand.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Protocol

from kiln.errors import ConfigError

# One tokenizer thread per task: each worker already owns a shard, and the `tokenizers` Rust
# pool would otherwise start a thread per CPU in every worker.
WORKER_ENV = {"RAYON_RS_NUM_CPUS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Runner(Protocol):
    """Runs picklable task calls somewhere and returns their results."""

    def map(self, fn: Callable[..., Any], args: list[tuple]) -> Iterator[Any]:
        """fn(*a) for each tuple in args; results are yielded in completion order."""
        ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) as one task; returns its result."""
        ...

    def close(self) -> None:
        """Release workers; safe to call more than once."""
        ...


def _star(item: tuple[Callable, tuple]) -> Any:
    fn, args = item
    return fn(*args)


def _one_thread_per_worker() -> None:
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)


class LocalRunner:
    """Tasks in a pool of spawned processes on this machine (in this process for one worker)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = None

    def map(self, fn: Callable[..., Any], args: list[tuple]) -> Iterator[Any]:
        if self.workers <= 1 or len(args) <= 1:
            for a in args:
                yield fn(*a)
            return
        if self._pool is None:
            import multiprocessing as mp

            # spawn: no forked Rust thread pools (tokenizers) or held locks; workers import kiln afresh.
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_one_thread_per_worker)
        yield from self._pool.imap_unordered(_star, [(fn, a) for a in args])

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


class RayRunner:
    """The same tasks as Ray remote functions; starts a local Ray instance unless given an address."""

    def __init__(self, workers: int, address: str = ""):
        try:
            import ray
        except ModuleNotFoundError:
            raise ConfigError("run.executor='ray' needs Ray: pip install 'kiln-lm[prep]'") from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            env = {"env_vars": dict(WORKER_ENV)}
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=env)
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, runtime_env=env)
            self.started = True
        # max_retries=0: a failing task is a bug or bad input to report, not a flaky node to retry.
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_star)

    def map(self, fn: Callable[..., Any], args: list[tuple]) -> Iterator[Any]:
        pending = [self._remote.remote((fn, a)) for a in args]
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            for ref in ready:
                yield self._get(ref)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._get(self._remote.remote((fn, args)))

    def _get(self, ref: Any) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None  # a KilnError stays a KilnError for the CLI

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


EXECUTORS = ("local", "ray")


def make_runner(run: Any) -> Runner:
    """The runner `run.executor` names, with `run.workers` workers (0 = every CPU here)."""
    workers = run.workers or os.cpu_count() or 1
    if run.executor == "local":
        return LocalRunner(workers)
    if run.executor == "ray":
        return RayRunner(workers, run.ray_address)
    raise ConfigError(f"run.executor={run.executor!r} is not one of {', '.join(EXECUTORS)}")
