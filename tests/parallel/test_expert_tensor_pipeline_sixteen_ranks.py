"""ep x tp x pp under ddp and zero1 with edp > 1 (dp4 x tp2 x pp2 = 16 gloo ranks, ep2 over the 4
replicas: edp 2), a MoE model (SGD), against one process on the same global batch of 8, over 5
steps (loss, grad norm, aux and z loss) at test_data_tensor_pipeline_parallel.py's tolerance.
Built from that module's pieces; one 16-process launch (about 30 s on the 2-core machine)."""
import pytest

from ranks import run_ranks
from test_data_tensor_pipeline_parallel import CASES, MOE, REL, job
from test_moe_tensor_parallel_layouts import rows, train_on_rank

LAYOUT = {"train.batch_size": 2, "parallel.dp_replicate": 4, "parallel.tp": 2, "parallel.pp": 2,
          "parallel.pp_microbatches": 2, "parallel.ep": 2}
RUNS = {"ddp_1f1b": {**MOE, **CASES["ddp_1f1b"]}, "zero1_interleaved": {**MOE, **CASES["zero1_interleaved"]}}


def worker(rank, world, text_file, tmp):
    for name, extra in RUNS.items():
        train_on_rank(rank, world, job(text_file, **{**LAYOUT, **extra}), tmp / name)


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory, text_file):
    from kiln.train.trainer import train

    tmp = tmp_path_factory.mktemp("sixteen")
    train(job(text_file, **{**MOE, "train.batch_size": 8}), tmp / "one")
    run_ranks(worker, 16, tmp, text_file, tmp, timeout=900)
    return tmp


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", RUNS)
def test_sixteen_ranks_with_two_expert_replicas_match_one_process(sixteen, name):
    want, got = rows(sixteen / "one"), rows(sixteen / name)
    assert len(got) == len(want) == 20 and got == pytest.approx(want, rel=REL), name
