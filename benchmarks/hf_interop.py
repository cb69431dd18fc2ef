"""`kiln import-hf` and `kiln export --to hf` at a released model's size: a randomly initialized
transformers model of that shape is saved in bf16 (as the hub ships them), imported into a kiln
run, its logits compared with transformers' fp32 load of the same file, exported again and
reloaded by transformers. Prints and writes the seconds of each step, the largest logit
differences and the process's peak RSS (all in one process: transformers' models included).

Shapes: qwen3-0.6b (Qwen3ForCausalLM: 16 heads of 128 on a width of 1024, QK-norm, 596M
parameters), llama-3.2-1b (LlamaForCausalLM with Llama 3.2's llama3 RoPE scaling, 1.24B),
mixtral-8e-0.4b and qwen3-moe-16e-0.4b (MixtralForCausalLM / Qwen3MoeForCausalLM, mostly
experts), tiny-mixtral (a window of 8), tiny-qwen3-moe (unnormalized gates, an MoE in every
2nd block) and tiny-qwen2-moe (q/k/v biases, a gated shared expert, dense blocks between); --quick: a tiny Qwen3 (the smoke test).

    python benchmarks/hf_interop.py [--shape qwen3-0.6b|llama-3.2-1b] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR, machine_info  # noqa: E402

SHAPES = {
    "qwen3-0.6b": ("Qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    "llama-3.2-1b": ("Llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})),
    # Mixture of experts (kiln/interop/hf_moe.py): no released MoE fits this machine in fp32, so
    # two of ~0.4B parameters, mostly experts (per-expert tensors, stacked on import).
    "mixtral-8e-0.4b": ("Mixtral", dict(vocab_size=32000, hidden_size=1024, intermediate_size=1408,
                                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                                        rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3-moe-16e-0.4b": ("Qwen3Moe", dict(vocab_size=32000, hidden_size=1024, intermediate_size=512,
                                            moe_intermediate_size=512, num_hidden_layers=12, num_attention_heads=16,
                                            num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                                            norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6,
                                            tie_word_embeddings=False)),
    "tiny": ("Qwen3", dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                           rope_theta=1e6, tie_word_embeddings=True)),
    "tiny-mixtral": ("Mixtral", dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                                     tie_word_embeddings=False)),
    "tiny-qwen3-moe": ("Qwen3Moe", dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                                        norm_topk_prob=False, max_position_embeddings=64, tie_word_embeddings=False)),
    "tiny-qwen2-moe": ("Qwen2Moe", dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                        decoder_sparse_step=2, max_position_embeddings=64, tie_word_embeddings=False)),
}


def run(shape: str, root: Path, tokens: int = 64) -> dict:
    import transformers

    from kiln.cli import main as kiln
    from kiln.data.tokenizer import train_bpe
    from kiln.eval.load import load_run

    family, kwargs = SHAPES[shape]
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}ForCausalLM")
    out: dict = {"shape": shape, "class": model_class.__name__}
    torch.manual_seed(0)
    t = time.perf_counter()
    model = model_class(config_class(**kwargs)).to(torch.bfloat16)
    model.save_pretrained(str(root / "hf"))
    train_bpe(iter(["def f(x):\n    return x * 2\n" * 50]), 290).save(root / "hf" / "tokenizer.json")
    out.update(params=sum(p.numel() for p in model.parameters()), hf_build_and_save_s=time.perf_counter() - t)
    del model
    ids = torch.randint(0, kwargs["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    reference = model_class.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    del reference

    t = time.perf_counter()
    if kiln(["import-hf", str(root / "hf"), "--run-dir", str(root / "run")]) != 0:
        raise SystemExit("hf_interop: kiln import-hf failed")
    out["import_s"] = time.perf_counter() - t
    with torch.no_grad():
        got = load_run(root / "run").model(ids)
    out["import_max_abs_logit_diff"] = (got - expected).abs().max().item()
    out["max_abs_logit"] = expected.abs().max().item()

    t = time.perf_counter()
    if kiln(["export", str(root / "run"), "--to", "hf", str(root / "out")]) != 0:
        raise SystemExit("hf_interop: kiln export failed")
    out["export_s"] = time.perf_counter() - t
    again = transformers.AutoModelForCausalLM.from_pretrained(str(root / "out")).eval()
    with torch.no_grad():
        out["export_max_abs_logit_diff"] = (again(input_ids=ids).logits - got).abs().max().item()
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="qwen3-0.6b",
                    help="tiny-*: seconds-long checks of the MoE families (e.g. under another transformers)")
    ap.add_argument("--quick", action="store_true", help="a tiny Qwen3 (the smoke test)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "hf_interop.json"))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kiln-hf-interop-"))
    try:
        row = run("tiny" if args.quick else args.shape, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(row, indent=1))
    Path(args.out).write_text(json.dumps({**row, "command": "python " + " ".join(sys.argv),
                                          "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
