"""What a whole-model torch.compile saves for backward, measured on CPU, against the compiled
activation term of kiln/plan/memory.py (`ModelShape.act_bytes_per_token(act, compiled=True)`).

The forward/backward split is AOTAutograd's min-cut partitioner on the joint graph after
inductor's decompositions, made before any device code is generated, so a CPU run under bf16
autocast sees the partition a GPU run gets (torch API: aot_module_simplified with inductor's
decomposition table and partition function; only the graph's outputs are read, no kernel is
compiled). Device differences left: CUDA's flash/cuDNN SDPA also saves a philox seed and offset
(two scalars), and its output's strides make the (b, s, h*d) copy the same size as here.
"""

import functools

import pytest
import torch
from conftest import float8_cpu_matmul_error, float8_import_error
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from kiln.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.parallel.parallelize import apply_activation_checkpointing
from kiln.plan.memory import ModelShape

BATCH, SEQ, VOCAB = 3, 40, 72  # leading dims 3 and 120 occur in no weight's shape (dims 64, 192, 256, 72)
TOP_K = 2  # the MoE case's experts per token (240 rows, in no weight's shape either)
VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "detach", "alias", "expand"}


def _storage_node(node):
    """The node that owns a saved tensor's memory (views share their base's)."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in VIEW_OPS:
        node = node.args[0]
    return node


def saved_token_bytes(model_cfg: ModelConfig, ac: str = "none", float8: bool = False) -> float:
    """Bytes per token of the token-sized tensors the compiled forward saves for backward (weights
    and their low-precision casts excluded; each storage once)."""
    torch._dynamo.reset()
    saved = []

    def forward_compiler(gm, example_inputs):
        saved.extend([n for n in gm.graph.nodes if n.op == "output"][0].args[0])
        return gm.forward

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=lambda g, _: g.forward,
            decompositions=select_decomp_table(),
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))

    torch.manual_seed(0)
    model = Transformer(model_cfg)
    if float8:  # as kiln/parallel/parallelize.py apply_float8 converts (its CUDA checks aside)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, fqn: fqn.startswith("layers."))
    if ac != "none":
        apply_activation_checkpointing(model, ac)
    model.compile(backend=backend)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens, tokens)
    torch._dynamo.reset()
    seen, total = set(), 0
    for node in saved[1:]:  # [0] is the loss
        val = getattr(node, "meta", {}).get("val")
        base = _storage_node(node) if val is not None else None
        if base is None or base.op == "placeholder" or base in seen or not isinstance(val, torch.Tensor):
            continue
        seen.add(base)
        bval = base.meta["val"]
        tokens = (BATCH, BATCH * SEQ, TOP_K * BATCH * SEQ)  # an MoE block's dispatched rows: k per token
        if bval.dim() and (bval.shape[0] in tokens or bval.shape[-1] in tokens[1:]):
            total += bval.numel() * bval.element_size()
    return total / (BATCH * SEQ)


@pytest.mark.parametrize("activation,norm,positions,ac,float8", [
    ("swiglu", "rmsnorm", "rope", "none", False), ("gelu", "layernorm", "learned", "none", False),
    ("swiglu", "rmsnorm", "rope", "full", False), ("swiglu", "rmsnorm", "rope", "none", True)])
def test_compiled_saved_bytes_match_the_formula(activation, norm, positions, ac, float8):
    if float8:
        if (why := float8_import_error() or float8_cpu_matmul_error()) is not None:
            pytest.skip(why)
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_layers=2, n_heads=4, activation=activation,
                      norm=norm, positions=positions)
    shape = ModelShape.from_config(cfg, VOCAB)
    measured = saved_token_bytes(cfg, ac, float8)
    # per block: the formula, or under full AC the block's fp32 input only (the first block's is the
    # embedding output); outside the blocks: the final norm's fp32 input (without AC; under AC the
    # partitioner keeps only its bf16 output), its bf16 output and statistics, the bf16 logits
    # with their fp32 max and log-sum-exp
    block = 4 * shape.dim if ac == "full" else shape.act_bytes_per_token(2, compiled=True, float8=float8)
    outside = (0 if ac == "full" else 4 * shape.dim) + 2 * shape.dim + 2 * VOCAB + 4 * 4
    predicted = shape.n_layers * block + outside
    # 2%: the norm statistics (layernorm keeps mean and rstd, rmsnorm rstd only) are an upper bound.
    # torch 2.14's partitioner keeps a block's bf16 matmul output where 2.13's kept its fp32
    # residual sum (2.6-3.4% fewer bytes at these sizes, swiglu): the formula, fitted to 2.13, is an
    # upper bound there within 4%.
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 14):
        assert predicted * 0.96 <= measured <= predicted * 1.02, (measured, predicted)
    else:
        assert measured == pytest.approx(predicted, rel=0.02), (measured, predicted)
    # the other count (eager; for float8 the bf16 compiled one) is further off: this measures the
    # graph it names, not whichever formula happens to be close
    other = shape.act_bytes_per_token(2, compiled=float8)
    assert ac == "full" or abs(measured - predicted) < abs(measured - (shape.n_layers * other + outside))


def test_compiled_moe_block_saves_at_most_the_formula():
    """An MoE block in the whole compiled model (top-2 of 4 full-width experts): the formula (the
    eager dispatch count with the compiled MLP's 3 tensors per hidden unit) is an upper bound within
    15% (seen: 10%: the partitioner recomputes part of the dispatch), where counting the block as a
    dense one (the planner before) was 38% under."""
    if not hasattr(torch.nn.functional, "grouped_mm"):  # torch 2.6, 2.7
        pytest.skip(f"torch {torch.__version__} has no grouped_mm: the experts' loop reads the counts on the host "
                    f"(a graph break), so no one graph holds the block")
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=TOP_K)
    shape = ModelShape.from_config(cfg, VOCAB)
    dense = ModelShape.from_config(ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_layers=2, n_heads=4), VOCAB)
    outside = 4 * shape.dim + 2 * shape.dim + 2 * VOCAB + 4 * 4  # as in the test above
    measured = (saved_token_bytes(cfg) - outside) / shape.n_layers
    block = shape.act_bytes_per_token(2, compiled=True)
    assert measured <= block <= 1.15 * measured, (measured, block)
    assert dense.act_bytes_per_token(2, compiled=True) < 0.7 * measured


@pytest.mark.parametrize("activation,norm,positions", [("swiglu", "rmsnorm", "rope"), ("gelu", "layernorm", "learned")])
def test_compiled_op_checkpointing_saves_the_formula_per_block(activation, norm, positions):
    """train.activation_checkpointing = "op" compiled: per block (the difference of 4 and 2
    blocks), the fp32 block input and `op_kept_bytes_per_token(compiled=True)`: the partitioner
    keeps the policy's matmul and attention outputs that backward reads (not the MLP's last one)."""
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 9):
        # 2.6's partitioner keeps more (1936 bytes per token and block here against 1680): the
        # formula is that of the releases since (checked: 2.9, 2.11, 2.12, 2.13), as the other compiled terms
        pytest.skip(f"torch {torch.__version__}: its partitioner keeps more under the op policy")
    measured = {}
    for layers in (2, 4):
        cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_layers=layers, n_heads=4,
                          activation=activation, norm=norm, positions=positions)
        measured[layers] = saved_token_bytes(cfg, "op")
    shape = ModelShape.from_config(cfg, VOCAB)
    block = (measured[4] - measured[2]) / 2
    assert block == pytest.approx(4 * shape.dim + shape.op_kept_bytes_per_token(2, compiled=True), rel=0.01)
    # what eager keeps (the MLP's last matmul output too) is further off: the check can tell them apart
    assert abs(block - 4 * shape.dim - shape.op_kept_bytes_per_token(2)) > 0.05 * block
