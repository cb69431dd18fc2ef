import math

import pytest
import torch

from kiln.config import ScheduleConfig
from kiln.config import load_config
from kiln.errors import ConfigError, KilnError
from kiln.train.schedule import SCHEDULES, LRSchedule, lr_factor

TOTAL = 110


def cfg(name: str, **kw) -> ScheduleConfig:
    base = dict(name=name, warmup_steps=10, min_lr_ratio=0.1, step_size=20, gamma=0.5, decay_fraction=0.2)
    base.update(kw)
    return ScheduleConfig(**base)


def optimizer(peaks=(1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "initial_lr": p} for p in peaks]
    return torch.optim.SGD(groups, lr=123.0)  # the constructor's lr is a placeholder


@pytest.mark.parametrize("name", ["cosine", "linear", "step", "wsd", "constant", "plateau"])
def test_warmup_is_linear_from_first_step(name):
    c = cfg(name)
    assert lr_factor(name, 0, c, TOTAL) == pytest.approx(0.1)  # (0 + 1) / 10, not 0
    assert lr_factor(name, 4, c, TOTAL) == pytest.approx(0.5)
    assert lr_factor(name, 9, c, TOTAL) == pytest.approx(1.0)
    assert lr_factor(name, 10, c, TOTAL) == pytest.approx(1.0)


@pytest.mark.parametrize("step,expected", [
    (35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # a quarter of the way through decay
    (60, 0.55),  # halfway: midpoint of 1 and 0.1
    (110, 0.1),
    (500, 0.1),  # past the end it stays at the floor
])
def test_cosine_closed_form(step, expected):
    assert lr_factor("cosine", step, cfg("cosine"), TOTAL) == pytest.approx(expected)


@pytest.mark.parametrize("step,expected", [(35, 0.775), (60, 0.55), (110, 0.1), (200, 0.1)])
def test_linear_closed_form(step, expected):
    assert lr_factor("linear", step, cfg("linear"), TOTAL) == pytest.approx(expected)


@pytest.mark.parametrize("step,expected", [(29, 1.0), (30, 0.5), (49, 0.5), (50, 0.25), (90, 0.0625)])
def test_step_closed_form(step, expected):
    assert lr_factor("step", step, cfg("step"), TOTAL) == pytest.approx(expected)


@pytest.mark.parametrize("step,expected", [
    (50, 1.0),
    (87, 1.0),  # decay covers the last round(0.2 * 110) = 22 steps: 88..110
    (88, 1.0),
    (99, 1.0 - 0.9 * 11 / 22),
    (110, 0.1),
])
def test_wsd_closed_form(step, expected):
    assert lr_factor("wsd", step, cfg("wsd"), TOTAL) == pytest.approx(expected)


def test_wsd_always_reaches_the_floor():
    tiny = cfg("wsd", warmup_steps=0, decay_fraction=0.001)  # 0.11 steps rounds to 0: keep one
    assert lr_factor("wsd", TOTAL - 1, tiny, TOTAL) == 1.0
    assert lr_factor("wsd", TOTAL, tiny, TOTAL) == pytest.approx(0.1)
    late = cfg("wsd", warmup_steps=100, decay_fraction=0.5)  # decay cannot start inside warmup
    assert lr_factor("wsd", 99, late, TOTAL) == pytest.approx(1.0)
    assert lr_factor("wsd", 105, late, TOTAL) == pytest.approx(1.0 - 0.9 * 5 / 10)


def test_constant_and_no_warmup():
    assert lr_factor("constant", 1000, cfg("constant"), TOTAL) == 1.0
    assert lr_factor("cosine", 0, cfg("cosine", warmup_steps=0), TOTAL) == pytest.approx(1.0)
    assert lr_factor("cosine", TOTAL, cfg("cosine", warmup_steps=0), TOTAL) == pytest.approx(0.1)


def test_schedule_names_are_checked_once_by_the_config():
    with pytest.raises(ConfigError, match="schedule.name='exp' is not one of " + ", ".join(SCHEDULES)):
        load_config(None, ["schedule.name=exp"])
    with pytest.raises(ConfigError, match="train.steps=0 must be > 0"):
        load_config(None, ["train.steps=0"])
    with pytest.raises(ValueError, match="validate the config first"):  # a bug, not a user error
        lr_factor("exp", 20, cfg("cosine"), TOTAL)


def test_groups_without_initial_lr_take_their_lr_as_torch_does():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    LRSchedule(opt, cfg("cosine"), TOTAL)
    assert opt.param_groups[0]["initial_lr"] == 0.5 and opt.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("name", ["cosine", "linear", "step", "wsd", "constant"])
def test_schedule_sets_group_lrs_each_step(name):
    opt = optimizer(peaks=(2e-3, 0.5e-3))
    sched = LRSchedule(opt, cfg(name), TOTAL)
    for step in range(TOTAL + 3):
        expected = 2e-3 * lr_factor(name, step, cfg(name), TOTAL)
        assert sched.lr == pytest.approx(expected)
        assert opt.param_groups[0]["lr"] == pytest.approx(expected)
        assert opt.param_groups[1]["lr"] == pytest.approx(0.25 * expected)
        assert sched.observe(1.0) is False  # only plateau reacts to evaluations
        opt.step()
        sched.step()


def test_lr_is_set_at_construction():
    opt = optimizer()
    LRSchedule(opt, cfg("cosine"), TOTAL)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_plateau_decays_after_patience_and_not_before():
    opt = optimizer()
    sched = LRSchedule(opt, cfg("plateau", warmup_steps=0, plateau_patience=2, plateau_threshold=0.01), TOTAL)
    assert sched.observe(1.0) is False  # first evaluation sets the best
    assert sched.observe(0.995) is False  # 0.5% better: below the 1% threshold, one bad evaluation
    assert opt.param_groups[0]["lr"] == 1.0
    assert sched.observe(0.999) is True  # second bad evaluation in a row: decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    assert sched.observe(0.98) is False  # 2% better than the best (1.0): counts as improvement
    assert sched.observe(0.975) is False  # one bad evaluation after the improvement
    assert sched.observe(0.971) is True  # 0.9% better than 0.98: second bad evaluation
    assert sched.lr == pytest.approx(0.25)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)  # decays persist across steps


def test_plateau_counts_nan_as_no_improvement():
    sched = LRSchedule(optimizer(), cfg("plateau", warmup_steps=0, plateau_patience=1), TOTAL)
    assert sched.observe(2.0) is False
    assert sched.observe(float("nan")) is True


@pytest.mark.parametrize("name", ["cosine", "plateau"])
def test_state_dict_round_trip_resumes_identical_lrs(name):
    c = cfg(name, plateau_patience=1)
    opt = optimizer(peaks=(3e-3, 1.5e-3))
    sched = LRSchedule(opt, c, TOTAL)
    losses = iter([3.0, 3.0, 2.0, 2.0, 2.0, 1.0] * 10)
    for step in range(40):
        sched.step()
        if step % 5 == 0:
            sched.observe(next(losses))
    state = sched.state_dict()
    assert all(type(v) in (int, float) for v in state.values())

    opt2 = optimizer(peaks=(3e-3, 1.5e-3))
    resumed = LRSchedule(opt2, c, TOTAL)
    resumed.load_state_dict(dict(state))
    for step in range(40, 80):
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
        sched.step()
        resumed.step()
        if step % 5 == 0:
            loss = next(losses)
            assert sched.observe(loss) == resumed.observe(loss)


def test_load_state_dict_rejects_foreign_state():
    sched = LRSchedule(optimizer(), cfg("cosine"), TOTAL)
    with pytest.raises(KilnError, match="missing"):
        sched.load_state_dict({"step": 3})


def test_tensor_lr_is_updated_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [p], "initial_lr": 1.0}], lr=torch.tensor(1.0))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = LRSchedule(opt, cfg("linear"), TOTAL)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.1)
    sched.step()
    assert float(lr_tensor) == pytest.approx(0.2)
