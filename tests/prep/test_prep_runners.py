import pytest

from kiln.errors import ConfigError, DataError
from kiln.prep.pipeline import RunConfig
from kiln.prep.readers import ReaderConfig, list_shards
from kiln.prep.runners import LocalRunner, make_runner


def test_make_runner_picks_by_executor():
    runner = make_runner(RunConfig(executor="local", workers=3))
    assert isinstance(runner, LocalRunner) and runner.workers == 3
    runner.close()
    with pytest.raises(ConfigError, match="run.executor='slurm' is not one of local, ray"):
        make_runner(RunConfig(executor="slurm"))


@pytest.mark.parametrize("workers", [1, 2])
def test_local_runner_maps_calls_and_closes(workers):
    runner = LocalRunner(workers)
    try:
        assert sorted(runner.map(pow, [(i, 2) for i in range(6)])) == [0, 1, 4, 9, 16, 25]
        assert runner.call(pow, 3, 3) == 27
        assert sorted(runner.map(pow, [(2, 5), (2, 6)])) == [32, 64]  # the pool is reused
    finally:
        runner.close()
        runner.close()  # twice is fine


@pytest.mark.parametrize("workers", [1, 2])
def test_a_task_user_error_reaches_the_driver_as_itself(tmp_path, workers):
    # The CLI prints a KilnError in one line; a pool must not turn it into something else.
    runner = LocalRunner(workers)
    missing = [(ReaderConfig(path=str(tmp_path / f"none-{i}")),) for i in range(2)]
    try:
        with pytest.raises(DataError, match="not found"):
            list(runner.map(list_shards, missing))
    finally:
        runner.close()
