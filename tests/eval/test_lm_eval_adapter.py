"""The lm-eval adapter on a tiny trained run, with a local task over a local JSONL (no hub access)."""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from kiln.config import load_config
from kiln.data.corpus import stdlib_files
from kiln.eval.load import load_run

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from kiln.eval.lm_eval_adapter import KilnLM, run_lm_eval  # noqa: E402

TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "data.tokenizer=byte", "data.seq_len=32",
        "model.max_seq_len=32", "train.batch_size=2", "train.steps=3", "train.dtype=fp32",
        "metrics.progress=none", "train.eval_every=0", "metrics.peak_flops=1e12", "schedule.warmup_steps=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from kiln.train.trainer import train

    root = tmp_path_factory.mktemp("lmeval")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(p.read_text(errors="replace") for p in list(stdlib_files())[:3])[:40000])
    cfg = load_config(None, TINY + [f"data.source={corpus}"])
    train(cfg, root / "run")
    return root / "run"


def _direct_loglikelihood(model, context_ids, continuation_ids):
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = F.log_softmax(model(ids[:, :-1]).float(), -1)[0]
    n = len(continuation_ids)
    picked = logprobs[-n:].gather(-1, torch.tensor(continuation_ids)[:, None])
    return float(picked.sum()), bool((logprobs[-n:].argmax(-1) == torch.tensor(continuation_ids)).all())


def _request(kind, args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.mark.timeout(240)
def test_loglikelihood_matches_direct_computation(run_dir):
    loaded = load_run(run_dir)
    lm = KilnLM(loaded=loaded, batch_size=3)
    tok = loaded.tokenizer
    cases = [("def main(", "):\n    return"), ("import os", " path"), ("", "class A"), ("x = 1\n" * 20, "y = 2")]
    results = lm.loglikelihood([_request("loglikelihood", c) for c in cases])
    for (context, continuation), (logprob, greedy) in zip(cases, results):
        # Trailing whitespace of the context belongs to the continuation (lm_eval's convention).
        stripped = context.rstrip()
        context_ids = tok.encode(stripped) or [tok.eos_id]
        continuation_ids = tok.encode(context[len(stripped):] + continuation)
        full = (context_ids + continuation_ids)[-33:]  # the context window is max_seq_len + 1 tokens
        expected, expected_greedy = _direct_loglikelihood(loaded.model, full[:-len(continuation_ids)],
                                                          continuation_ids)
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert greedy == expected_greedy
        assert logprob < 0


@pytest.mark.timeout(240)
def test_rolling_loglikelihood_covers_every_token_once(run_dir):
    loaded = load_run(run_dir)
    lm = KilnLM(loaded=loaded)
    text = "def f(x):\n    return x * 2\n" * 4  # longer than the 32-token context: several windows
    (rolling,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    ids = loaded.tokenizer.encode(text)
    assert len(ids) > 32
    # Windows: EOS + first 31 tokens predict the first 32, then later windows each see 32 tokens.
    expected, _ = _direct_loglikelihood(loaded.model, [loaded.tokenizer.eos_id], ids[:32])
    pos = 32
    while pos < len(ids):  # each later window predicts up to 32 new tokens after a full context
        end = min(pos + 32, len(ids))
        expected += _direct_loglikelihood(loaded.model, ids[end - 33:pos], ids[pos:end])[0]
        pos = end
    assert rolling == pytest.approx(expected, rel=1e-5)


@pytest.mark.timeout(240)
def test_generate_until_stops_at_the_stop_string(run_dir):
    loaded = load_run(run_dir)
    lm = KilnLM(loaded=loaded)
    (free,) = lm.generate_until([_request("generate_until", ("def ", {"until": [], "max_gen_toks": 12}))])
    assert len(free.encode()) <= 12
    # Chunked generation (stop checks every GEN_CHUNK tokens) equals one greedy call.
    from kiln.model.generate import generate

    tok = loaded.tokenizer
    single = tok.decode(generate(loaded.model, tok.encode("def "), max_new_tokens=12, temperature=0.0,
                                 eos_id=tok.eos_id))
    lm.GEN_CHUNK = 5
    (chunked,) = lm.generate_until([_request("generate_until", ("def ", {"until": [], "max_gen_toks": 12}))])
    assert chunked == single == free
    stop = free[3:5] if len(free) >= 5 else None
    if stop:
        (cut,) = lm.generate_until([_request("generate_until", ("def ", {"until": [stop], "max_gen_toks": 12}))])
        assert stop not in cut and free.startswith(cut)


@pytest.mark.timeout(300)
def test_simple_evaluate_on_a_local_task(run_dir, tmp_path):
    data = tmp_path / "mc.jsonl"
    rows = [{"question": f"x = {i} +", "choices": [f" {i}", " banana"], "answer": 0} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kiln_tiny_mc.yaml").write_text(
        "task: kiln_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    loaded = load_run(run_dir)
    out = run_lm_eval(loaded, ["kiln_tiny_mc"], include_path=[str(tasks)], limit=4)
    result = out["results"]["kiln_tiny_mc"]
    assert 0.0 <= result["acc,none"] <= 1.0
    # The harness' accuracy agrees with our own loglikelihood comparison of the two choices.
    lm = KilnLM(loaded=loaded)
    wins = 0
    for row in rows[:4]:
        scores = lm.loglikelihood([_request("loglikelihood", (row["question"], c)) for c in row["choices"]])
        wins += scores[0][0] > scores[1][0]
    assert result["acc,none"] == pytest.approx(wins / 4)
    json.dumps(out)  # JSON-safe


def test_unknown_task_is_a_clear_error(run_dir, tmp_path):
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="unknown lm-eval task"):
        run_lm_eval(load_run(run_dir), ["no_such_task_kiln"], include_path=[str(tmp_path)],
                    include_defaults=False)  # the built-in index is tens of seconds to build
    with pytest.raises(KilnError, match="not found"):
        run_lm_eval(load_run(run_dir), ["x"], include_path=[str(tmp_path / "missing")])


def test_model_args_string_loads_the_run(run_dir):
    lm = KilnLM.create_from_arg_string(f"run_dir={run_dir},step=3,batch_size=4")
    assert lm.loaded.step == 3 and lm.batch_size == 4 and lm.max_length == 32
    from lm_eval.api.registry import get_model

    assert get_model("kiln") is KilnLM
