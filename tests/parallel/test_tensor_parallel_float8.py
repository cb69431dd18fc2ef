"""train.float8 under tensor parallel: a TP=2 model built by kiln's `parallelize` (float8, then
TP, then activation checkpointing) whose blocks' linears are torchao float8 linears (torchao's fp32
emulation of the float8 GEMMs, `apply_float8(..., emulate=True)`, the same casts and scales as on a
GPU) gives the per-step losses and grad norms of one float8-emulated process, for the Llama-style
and GPT-2 architectures, a mixture-of-experts model (attention in float8, grouped experts in high
precision; activation checkpointing on) and the rowwise recipe; the tensorwise plan all-gathers
the activations in float8; torchao's float8 styles on rowwise or biased linears (which torchao
accepts) train differently; the plan picks the styles per sub-block.

Tolerance: relative 1e-5 per step, as the fp32 TP test. Not bit-exact, but close: the float8
scales are the same in both layouts (torchao takes the amax of a sharded DTensor over the whole
tensor, so input, weight and gradient casts use the one-process scale), and what differs is the
fp32 order of the row-wise partial sums and the sharded softmax (~1e-7), which moves a value across
a float8 rounding boundary (one e4m3 step is 1/8 relative) only rarely. Measured: <= 1.2e-6 over
5 steps; the negative controls differ by up to 1.6e-3 and 6.6e-4. A flip is far above fp32 noise
and a fast-moving run amplifies it (at lr 0.2 GPT-2 drifted to 1e-3 by step 5 with the right
styles, the first steps agreeing to 1e-7), hence lr 0.05 here.

gloo has no float8 dtype (its all-gather fails with "Invalid scalar type"); NCCL moves float8 as
bytes. `_gloo_all_gathers_float8_as_bytes` makes torchao's float8 all-gather send the same bytes as
uint8 over gloo, so the gathered float8 values are bit-identical to a float8 all-gather.
"""

import contextlib
import functools
import sys
from unittest import mock
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln import torch_compat
from kiln.config import ParallelConfig, load_config
from kiln.errors import ConfigError
from kiln.model.transformer import Transformer
from kiln.parallel import tensor_parallel
from kiln.parallel.dims import ParallelDims
from kiln.parallel.parallelize import apply_float8, parallelize
from kiln.train.step import train_step

sys.path.insert(0, str(Path(__file__).parent))
from ranks import run_ranks  # noqa: E402
from conftest import float8_import_error  # noqa: E402

if (_why := float8_import_error()) is not None:
    pytest.skip(_why, allow_module_level=True)
if not torch_compat.dtensor_takes_float8_scales():  # refused there: test_dims.py
    pytest.skip(f"torch {torch.__version__}'s DTensor cannot take float8 scales; kiln refuses float8 with tp",
                allow_module_level=True)

STEPS, REL, CLIP, LR = 5, 1e-5, 1.0, 0.05
BATCH, SEQ = 2, 16
# Every block linear a multiple of 16 (float8-eligible): q 32, k/v 16, o 32, MLP 32 <-> 64.
LLAMA = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=64",
         "model.ffn_hidden=64", "model.max_seq_len=32", "model.dropout=0.0", "data.seq_len=16"]
# GPT-2: learned positions, LayerNorm with bias, biases in every linear, GeLU MLP (32 <-> 128), untied head.
GPT2 = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=65", "model.max_seq_len=32",
        "model.positions=learned", "model.norm=layernorm", "model.bias=true", "model.activation=gelu",
        "model.tie_embeddings=false", "model.dropout=0.0", "data.seq_len=16"]
# One dense block, one MoE block (top-2, capacity 1.25, aux and z-losses weighted).
MOE = LLAMA + ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2", "model.moe_aux_loss_weight=0.1",
               "model.moe_z_loss_weight=0.01"]


def build(overrides, recipe, dims=None):
    """The float8-emulated model on the meta device: one process (dims None) or this rank's
    shard through kiln's `parallelize` (float8, then TP, then activation checkpointing)."""
    cfg = load_config(None, [*overrides, "train.float8=true", f"train.float8_recipe={recipe}"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if dims is None:
        apply_float8(model, recipe, torch.device("cpu"), emulate=True)
        return model
    # kiln train never emulates; the test's seam is apply_float8's internal `emulate` argument
    emulated = functools.partial(apply_float8, emulate=True)
    with mock.patch("kiln.parallel.parallelize.apply_float8", emulated):
        return parallelize(model, dims, cfg, torch.device("cpu"))


def run_steps(overrides, recipe, dims=None, gathers=None, micro_batches=1):
    """STEPS of SGD (momentum, clipping active) with kiln's train_step on one fixed batch:
    [loss, grad norm] per step, then the eval loss. Under data parallelism each rank takes its
    share of the batch and the losses are averaged over the ranks; `micro_batches` splits the
    batch in one process as data parallelism does (float8 scales its activations per micro-batch
    or per rank, so that is the one-process equivalent). `gathers`: records the steps' all-gathers."""
    torch.manual_seed(0)
    model = build(overrides, recipe, dims)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    dp = 1 if dims is None else dims.dp_size
    if dp > 1:
        tokens = tokens.chunk(dp)[dims.dp_rank]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens.chunk(micro_batches)]

    def mean_over_ranks(loss):  # the tp ranks of a data-parallel rank hold the same loss
        if dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        return loss.item()

    out = []
    for _ in range(STEPS):
        with gathers if gathers is not None else contextlib.nullcontext():
            loss, grad_norm, _ = train_step(model, opt, batches, autocast=contextlib.nullcontext(), scaler=None,
                                            clip=CLIP)
        out += [mean_over_ranks(loss.detach().clone()), grad_norm.item()]
    with torch.no_grad():
        out.append(mean_over_ranks(sum(model(x, y) for x, y in batches) / len(batches)))
    return out


class AllGathers(TorchDispatchMode):
    """Records the element dtype each all-gather moves (a float8 tensor's own storage dtype, not
    the high-precision dtype it stands for)."""

    def __init__(self):
        super().__init__()
        self.dtypes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            sent = args[0]
            self.dtypes.append(str(getattr(sent, "_data", sent).dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


def _gloo_all_gathers_float8_as_bytes():
    """torchao's float8 all-gather (its Float8TrainingTensor gathers the raw float8 data) with the
    data viewed as uint8, which gloo can move; the result is viewed back as float8."""
    from torchao.float8 import float8_ops
    try:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
    except ImportError:  # torchao before 0.12 (0.11, next to torch 2.7) names it Float8Tensor
        from torchao.float8.float8_tensor import Float8Tensor as Float8TrainingTensor

    def all_gather(op, args, kwargs=None):
        x = args[0]
        out = op(x._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
        return Float8TrainingTensor(out.view(x._data.dtype), x._scale, x._orig_dtype, x._linear_mm_config,
                                    x._gemm_input_role)

    for op in (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops.c10d_functional.all_gather_into_tensor.default):
        float8_ops.FLOAT8_OPS_TABLE[op] = all_gather


@contextlib.contextmanager
def _float8_styles_for(predicate):
    """Which linears the plan treats as tensorwise float8 (the control cases' wrong choices)."""
    saved = tensor_parallel._takes_float8_styles
    tensor_parallel._takes_float8_styles = predicate
    try:
        yield
    finally:
        tensor_parallel._takes_float8_styles = saved


def _is_float8_linear(module):  # what torchao's own styles check: the class, not the granularity or a bias
    return type(module).__name__ == "Float8Linear"


# name -> (model, recipe, styles override). All run in one 2-rank launch.
CASES = {"llama": (LLAMA, "tensorwise", None), "gpt2": (GPT2, "tensorwise", None),
         "moe": (MOE + ["train.activation_checkpointing=full"], "tensorwise", None),  # (AC: same numbers)
         "llama_rowwise": (LLAMA, "rowwise", None),
         # controls: torch's plain styles on tensorwise float8 linears (right numbers, high-precision
         # all-gathers), torchao's float8 styles on rowwise float8 linears (wrong numbers)...
         "tensorwise_plain_styles": (LLAMA, "tensorwise", lambda m: False),
         "rowwise_float8_styles": (LLAMA, "rowwise", _is_float8_linear),
         # and on linears with biases (the bias gradients then come from float8 output gradients)
         "gpt2_float8_styles": (GPT2, "tensorwise", _is_float8_linear)}


CONTROLS = ("tensorwise_plain_styles", "rowwise_float8_styles", "gpt2_float8_styles")


def _worker(rank, world):
    _gloo_all_gathers_float8_as_bytes()
    results = {}
    for name, (overrides, recipe, styles) in CASES.items():
        cfg = load_config(None, [*overrides, "train.float8=true", f"train.float8_recipe={recipe}",
                                 f"parallel.tp={world}"])
        dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                        local_world_size=world)
        dims.check_model(cfg)  # the layout check kiln train runs first
        dims.build_mesh("cpu")
        gathers = AllGathers()
        try:
            with _float8_styles_for(styles) if styles else contextlib.nullcontext():
                losses = run_steps(overrides, recipe, dims, gathers)
        except NotImplementedError as e:  # a control's wrong styles may fail outright in an older torchao
            if name not in CONTROLS:
                raise
            results[name] = (None, f"raised: {e}")
            continue
        results[name] = (losses, gathers.dtypes)
    return results


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    per_rank = run_ranks(_worker, 2, tmp_path_factory.mktemp("tp2_float8"), timeout=240)
    for name in CASES:  # the loss is replicated over the tp ranks
        assert per_rank[0][name][0] == per_rank[1][name][0], name
    return per_rank[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "gpt2", "moe", "llama_rowwise"])
def test_float8_tp2_matches_one_float8_process(tp2, name):
    overrides, recipe, _ = CASES[name]
    expected = run_steps(overrides, recipe)
    assert tp2[name][0] == pytest.approx(expected, rel=REL), (tp2[name][0], expected)
    assert expected[2 * STEPS - 2] < expected[0] and expected[1] > CLIP  # it trains, clipping is exercised


def _fsdp_tp_worker(rank, world):
    _gloo_all_gathers_float8_as_bytes()
    cfg = load_config(None, [*LLAMA, "parallel.tp=2", "parallel.dp_shard=2"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=world, rank=rank, local_rank=rank,
                                    local_world_size=world)
    dims.build_mesh("cpu")
    return run_steps([*LLAMA, "train.activation_checkpointing=full"], "tensorwise", dims)


@pytest.mark.timeout(300)
def test_fsdp2_over_float8_tp2_matches_one_process_with_two_micro_batches(tmp_path):
    # dp_shard=2 x tp=2 (FSDP2 around the TP'd float8 blocks, activation checkpointing): each data-
    # parallel rank scales its half of the batch, as one process does each of two micro-batches.
    got = run_ranks(_fsdp_tp_worker, 4, tmp_path, timeout=240)
    expected = run_steps(LLAMA, "tensorwise", micro_batches=2)
    assert got[0] == pytest.approx(expected, rel=REL), (got[0], expected)
    assert all(r == got[0] for r in got[1:])
    # one micro-batch (one scale for the whole batch) is not the same computation in float8
    assert run_steps(LLAMA, "tensorwise")[:2] != pytest.approx(expected[:2], rel=REL)


@pytest.mark.timeout(300)
def test_tensorwise_tp_all_gathers_the_block_inputs_in_float8(tp2):
    layers = 2
    got, plain = tp2["llama"][1], tp2["tensorwise_plain_styles"][1]
    # Per block and step: attention's and the MLP's inputs in e4m3 (forward), wo's and w2's output
    # gradients in e5m2 (backward); each of those once, not once per consuming linear.
    assert got.count("float8_e4m3fn") == 2 * layers * STEPS and got.count("float8_e5m2") == 2 * layers * STEPS
    # torch's plain styles make the same all-gathers in fp32 (the LM head's input is fp32 in both)
    assert not any(d.startswith("float8") for d in plain)
    assert len(plain) == len(got) and plain.count("float32") == got.count("float32") + 4 * layers * STEPS


@pytest.mark.timeout(300)
def test_plain_styles_on_tensorwise_linears_still_match(tp2):
    # torchtitan's path for recipes its float8 styles do not cover: cast after an fp32 all-gather
    expected = run_steps(LLAMA, "tensorwise")
    assert tp2["tensorwise_plain_styles"][0] == pytest.approx(expected, rel=REL)


@pytest.mark.timeout(300)
def test_torchao_float8_styles_on_rowwise_linears_train_differently(tp2):
    # torchao's styles check only the scaling type: on rowwise linears they cast the gathered input
    # with one scale per tensor, and nothing fails. kiln's plan gives rowwise linears torch's styles.
    got, note = tp2["rowwise_float8_styles"]
    if got is None:  # torch 2.7 with torchao 0.12: its rowwise backward refuses the gathered DTensor
        assert "not supported" in note, note
        return
    expected = run_steps(LLAMA, "rowwise")
    rel = [abs(g - e) / abs(e) for g, e in zip(got, expected)]
    assert max(rel) > 20 * REL and sum(r > 10 * REL for r in rel) >= 5, rel


@pytest.mark.timeout(300)
def test_torchao_float8_styles_on_linears_with_bias_train_differently(tp2):
    # GPT-2's linears have biases; kiln's plan gives them torch's styles (case "gpt2" matches)
    expected = run_steps(GPT2, "tensorwise")
    got = tp2["gpt2_float8_styles"][0]
    assert got[0] == pytest.approx(expected[0], rel=REL)  # the forward is the same...
    rel = [abs(g - e) / abs(e) for g, e in zip(got[1:], expected[1:])]
    assert rel[0] > 20 * REL and sum(r > 10 * REL for r in rel) >= 5, rel  # ...the bias gradients are not


def _style_names(plan, block="layers.0"):
    return {k.removeprefix(block + "."): type(v).__name__ for k, v in plan.items() if k.startswith(block + ".")}


def test_plan_picks_float8_styles_per_sub_block():
    plan = tensor_parallel.tp_plan(build(LLAMA, "tensorwise"))
    assert _style_names(plan) == {
        "attention_norm": "SequenceParallel", "ffn_norm": "SequenceParallel",
        "attention": "PrepareFloat8ModuleInput", "attention.wq": "Float8ColwiseParallel",
        "attention.wk": "Float8ColwiseParallel", "attention.wv": "Float8ColwiseParallel",
        "attention.wo": "Float8RowwiseParallel", "feed_forward": "PrepareFloat8ModuleInput",
        "feed_forward.w1": "Float8ColwiseParallel", "feed_forward.w3": "Float8ColwiseParallel",
        "feed_forward.w2": "Float8RowwiseParallel"}
    # the LM head and the embeddings stay high precision with torch's styles
    assert type(plan["output"]).__name__ == "ColwiseParallel"
    # rowwise: torch's styles everywhere (the float8 linears cast after the all-gather)
    rowwise = _style_names(tensor_parallel.tp_plan(build(LLAMA, "rowwise")))
    assert rowwise["attention"] == "PrepareModuleInput" and rowwise["attention.wq"] == "ColwiseParallel"
    # biases (GPT-2): torch's styles too
    biased = _style_names(tensor_parallel.tp_plan(build(GPT2, "tensorwise")))
    assert biased["attention.wo"] == "RowwiseParallel" and biased["feed_forward"] == "PrepareModuleInput"
    # k/v of 2 heads of 12 (24 wide) are not float8-eligible: attention keeps torch's styles (a float8
    # input cannot feed a plain linear), the MLP (48 <-> 64) gets float8's
    mixed = build(["model.dim=48", *LLAMA[1:]], "tensorwise")
    assert type(mixed.layers[0].attention.wk).__name__ == "Linear"
    names = _style_names(tensor_parallel.tp_plan(mixed))
    assert names["attention"] == "PrepareModuleInput" and names["attention.wq"] == "ColwiseParallel"
    assert names["feed_forward"] == "PrepareFloat8ModuleInput" and names["feed_forward.w2"] == "Float8RowwiseParallel"


def test_moe_router_and_experts_stay_high_precision():
    # 16 experts: the router (32 -> 16) would be float8-eligible by its shape; routing reads its
    # weight in fp32 and the grouped experts are not nn.Linear, so neither converts.
    model = build(LLAMA + ["model.moe_experts=16", "model.moe_every=2"], "tensorwise")
    moe = model.layers[1].feed_forward
    assert type(moe.router).__name__ == "Linear" and type(moe.experts).__name__ == "GroupedExperts"
    assert type(model.layers[1].attention.wq).__name__ == "Float8Linear"
    assert type(tensor_parallel.tp_plan(model)["layers.1.feed_forward"]).__name__ == "MoETensorParallel"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_with_tp_passes_the_layout_check(recipe):
    cfg = load_config(None, [*LLAMA, "train.float8=true", f"train.float8_recipe={recipe}"])
    dims = ParallelDims.from_config(ParallelConfig(tp=2), world_size=2, rank=0, local_rank=0, local_world_size=2)
    dims.check_model(cfg)


def test_float8_without_emulation_still_needs_a_gpu():
    with torch.device("meta"):
        model = Transformer(load_config(None, LLAMA).model)
    with pytest.raises(ConfigError, match="train.float8=true needs a CUDA GPU") as e:
        apply_float8(model, "tensorwise", torch.device("cpu"))
    assert "\n" not in str(e.value)
