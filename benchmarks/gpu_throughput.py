"""One GPU: kiln's step against a plain nanoGPT-style compiled loop, at GPT-2 124M and Llama-1B
shapes, bf16 and float8; the full `kiln train` loop; CUDA graphs at the shakespeare-char size;
and time to a target validation loss, kiln's default recipe against a GPT-2-style one.

Called by `benchmarks/throughput.py --device cuda` (and `benchmarks/gpu_check.sh`). Cases run in
priority order under a time budget (`--budget-s`): what does not fit is listed as skipped, never
estimated. Each case: build, warm up (compiles), then `--steps` timed steps between two device
synchronizations; tokens/s and MFU against the card's dense bf16 peak (kiln/train/peak.py).
The baseline is the nanoGPT-style model in throughput.py with its loss inside the compiled
forward, fused AdamW, bf16 autocast and no per-step host sync, as nanoGPT's train.py runs it.

`--device cpu --quick` runs every code path at toy sizes (a dry run before a GPU lease).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kiln.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, load_config
from kiln.model.transformer import count_params, flops_per_token
from kiln.parallel.dims import ParallelDims
from kiln.train.attention import configure_attention
from kiln.train.optim import build_optimizer
from kiln.train.peak import peak_flops
from kiln.train.step import train_step

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Shape:
    name: str
    model: ModelConfig  # the kiln-default (Llama-style) architecture at this shape
    batch: int
    seq: int
    grad_accum: int = 1  # micro-batches per optimizer step (tokens per step = batch * seq * grad_accum)
    ac: str = "none"  # train.activation_checkpointing
    steps: int = 0  # timed steps for this shape (0: --gpu-steps)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq * self.grad_accum


def shapes(quick: bool) -> dict[str, Shape]:
    if quick:
        tiny = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
        return {"gpt2-124m": Shape("gpt2-124m", tiny, 2, 64), "llama-1b": Shape("llama-1b", tiny, 2, 64),
                "shakespeare-char": Shape("shakespeare-char", replace(tiny, vocab_size=256), 4, 64)}
    gpt2 = ModelConfig(vocab_size=50304, dim=768, n_layers=12, n_heads=12, max_seq_len=1024)
    llama = load_config(REPO / "configs" / "llama-1b.toml").model
    llama = replace(llama, max_seq_len=2048)
    char = ModelConfig(vocab_size=256, dim=384, n_layers=6, n_heads=6, max_seq_len=256)
    return {"gpt2-124m": Shape("gpt2-124m", gpt2, 12, 1024), "llama-1b": Shape("llama-1b", llama, 4, 2048),
            "shakespeare-char": Shape("shakespeare-char", char, 64, 256)}


def gpt2_style(m: ModelConfig) -> ModelConfig:
    """The baseline's architecture in kiln's config: LayerNorm, GeLU, learned positions, no bias."""
    return replace(m, norm="layernorm", activation="gelu", positions="learned", bias=False, n_kv_heads=0,
                   ffn_hidden=0, init="normal")


# ---------------------------------------------------------------------------- cases


@dataclass
class Result:
    case: str
    shape: str
    tokens_per_s: float = math.nan
    step_ms: float = math.nan
    mfu: float = math.nan
    compile_s: float = 0.0
    peak_mem_gib: float = math.nan  # torch.cuda.max_memory_allocated / 2**30
    seconds: float = math.nan  # time-to-target cases
    note: str = ""
    plan: dict | None = None  # what `kiln plan` needs to predict this case (benchmarks/plan_validation.py --gpu-results)


def _batches(vocab: int, batch: int, seq: int, device: torch.device, n: int = 4):
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(n):  # several batches: a timed loop over one would measure the cache
        t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def _time_steps(step: Callable[[int], Any], warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds of the first `warmup` steps, median seconds per step over timed windows)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    sync()
    warm = time.perf_counter() - t0
    windows = []
    per = max(1, steps // 3)
    for w in range(3):
        sync()
        t0 = time.perf_counter()
        for i in range(per):
            step(warmup + w * per + i)
        sync()
        windows.append((time.perf_counter() - t0) / per)
    return warm, sorted(windows)[1]


def kiln_case(shape: Shape, model_cfg: ModelConfig, device: torch.device, *, compile_model: bool,
              loss: str, float8: str = "", cuda_graphs: bool = False, autotune: bool = False
              ) -> tuple[Callable, float, int]:
    from kiln.train.trainer import build_model

    cfg = JobConfig()
    cfg.model = replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, shape.seq))
    cfg.train.compile, cfg.train.compile_scope, cfg.train.cuda_graphs = compile_model, "model", cuda_graphs
    cfg.train.autotune = autotune
    cfg.train.float8, cfg.train.float8_recipe = bool(float8), float8 or "tensorwise"
    cfg.train.dtype = "bf16" if device.type == "cuda" else "fp32"
    cfg.train.activation_checkpointing, cfg.train.grad_accum = shape.ac, shape.grad_accum
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1, rank=0, local_rank=0)
    model = build_model(cfg, dims, device)
    model.train()
    model.loss_impl = loss
    attention = configure_attention(model, "auto", device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                    shape.batch, shape.seq)
    optimizer = build_optimizer(model, OptimConfig(), device.type)
    batches = _batches(cfg.model.vocab_size, shape.batch, shape.seq, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step(i: int) -> None:
        micro = [batches[(i * shape.grad_accum + k) % len(batches)] for k in range(shape.grad_accum)]
        train_step(model, optimizer, micro, autocast=autocast, scaler=None, clip=1.0)

    note = f"sdpa {attention['attention_backend']}" + (" (kv expanded)" if attention["attention_expand_kv"] else "")
    plan = {"model": asdict(cfg.model), "batch": shape.batch, "seq": shape.seq, "grad_accum": shape.grad_accum,
            "ac": shape.ac, "compile": compile_model, "loss": loss, "precision": "float8" if float8 else "bf16",
            "optimizer": "adamw", "cuda_graphs": cuda_graphs, "autotune": autotune}
    return step, flops_per_token(model, shape.seq), count_params(model)["total"], note, plan


def baseline_case(shape: Shape, device: torch.device, compile_model: bool, mode: str | None = None
                  ) -> tuple[Callable, float, int]:
    from baseline_gpt import BaselineGPT, Size

    m = shape.model
    s = Size(shape.name, vocab=m.vocab_size, dim=m.dim, layers=m.n_layers, heads=m.n_heads, seq=shape.seq,
             batch=shape.batch)
    model = BaselineGPT(s).to(device)

    def forward(x, y):  # nanoGPT computes the loss inside the (compiled) forward
        logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    fwd = torch.compile(forward, mode=mode) if compile_model else forward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    batches = _batches(m.vocab_size, shape.batch, shape.seq, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with autocast:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return step, model.flops_per_token(), n, ""


def run_case(label: str, shape: Shape, build: Callable[[], tuple[Callable, float, int]], device: torch.device,
             peak: float, steps: int) -> Result:
    result = Result(label, shape.name)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step, flops_tok, _, result.note, *plan = build()
        result.plan = plan[0] if plan else None
        warm, step_s = _time_steps(step, 3, shape.steps or steps, device)
        result.compile_s = warm
        result.step_ms = 1000 * step_s
        result.tokens_per_s = shape.tokens / step_s
        result.mfu = flops_tok * result.tokens_per_s / peak
        if device.type == "cuda":
            result.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as e:  # one failing case must not cost the others (one GPU lease)
        result.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        traceback.print_exc()
    finally:
        _release(device)
    return result


def _release(device: torch.device) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- whole-loop cases


def trainer_loop_case(shape: Shape, model_cfg: ModelConfig, device: torch.device, steps: int,
                      workdir: Path) -> Result:
    """`kiln train` itself (loader, metrics rows, the batched fetch) at this shape, compiled."""
    from kiln.train.trainer import train

    result = Result("kiln train loop (gpt2 arch, compiled)", shape.name)
    try:
        corpus = workdir / "corpus.txt"
        gen = torch.Generator().manual_seed(0)
        words = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (int(n),), generator=gen))
                 for n in torch.randint(2, 9, (4000,), generator=gen)]
        n_bytes = (steps + 4) * shape.batch * (shape.seq + 1) * 12 // 10
        text = " ".join(words[i % len(words)] for i in range(n_bytes // 5))
        corpus.write_text(text, encoding="utf-8")
        m = model_cfg
        overrides = [f"model.{k}={json.dumps(v)}" for k, v in vars(m).items() if k != "name"]
        overrides += [f"data.source={json.dumps(str(corpus))}", "data.tokenizer='byte'", f"data.seq_len={shape.seq}",
                      "data.val_fraction=0.05", f"train.batch_size={shape.batch}", f"train.steps={steps}",
                      "train.eval_every=0", "checkpoint.every=0", "checkpoint.save_final=false",
                      f"train.compile={'true' if device.type == 'cuda' else 'false'}", "metrics.progress='none'",
                      f"train.device='{device.type}'", "schedule.warmup_steps=10", "metrics.log_every=10"]
        run_dir = workdir / "loop-run"
        train(load_config(None, overrides), run_dir, resume=False)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if r["kind"] == "train" and r["step"] > 10]
        run_row = next(r for r in rows if r["kind"] == "run")
        tps = sorted(r["tokens_per_s"] for r in train_rows)[len(train_rows) // 2]
        result.tokens_per_s, result.step_ms = tps, 1000 * shape.batch * shape.seq / tps
        result.mfu = sorted(r["mfu"] for r in train_rows)[len(train_rows) // 2]
        result.note = (f"loss {run_row['loss_impl']}, attention {run_row['attention_backend']}, "
                       f"nonfinite check {run_row['nonfinite_check']}")
    except Exception as e:
        result.note = f"failed: {type(e).__name__}: {str(e)[:160]}"
        traceback.print_exc()
    finally:
        _release(device)
    return result


def time_to_target(corpus: Path | None, device: torch.device, target: float, steps: int, quick: bool,
                   workdir: Path) -> list[Result]:
    """kiln's default recipe vs a GPT-2-style recipe (nanoGPT's shakespeare-char) to `target` val loss,
    both through `kiln train` at 6 x 384, batch 64 x 256, byte vocabulary; seconds exclude evals."""
    from kiln.train.trainer import train

    if corpus is None or not corpus.is_file():
        return [Result("time to target", "shakespeare-char", note=f"skipped: corpus {corpus} not found")]
    common = [f"data.source={json.dumps(str(corpus))}", "data.tokenizer='byte'", "data.val_fraction=0.1",
              f"train.device='{device.type}'", "checkpoint.every=0", "checkpoint.save_final=false",
              "metrics.progress='none'", "train.eval_batches=8", "metrics.log_every=25"]
    size = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.seq_len=64", "model.max_seq_len=64",
            "train.batch_size=8", "train.steps=40", "train.eval_every=20"] if quick else [
        "model.dim=384", "model.n_layers=6", "model.n_heads=6", "data.seq_len=256", "model.max_seq_len=256",
        "train.batch_size=64", f"train.steps={steps}", "train.eval_every=100", "train.compile=true"]
    recipes = {
        "kiln default recipe": [],
        "GPT-2-style recipe": ["model.norm='layernorm'", "model.activation='gelu'", "model.positions='learned'",
                               "model.init='normal'", "optim.lr=1e-3", "optim.betas=[0.9, 0.99]",
                               "schedule.warmup_steps=100", "model.dropout=0.2"],
    }
    out = []
    for name, extra in recipes.items():
        result = Result(f"time to val {target}: {name}", "shakespeare-char")
        run_dir = workdir / name.replace(" ", "-")
        try:
            train(load_config(None, common + size + extra), run_dir, resume=False)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            result.seconds, result.note = _seconds_to_target(rows, target)
        except Exception as e:
            result.note = f"failed: {type(e).__name__}: {str(e)[:160]}"
            traceback.print_exc()
        finally:
            _release(device)
        out.append(result)
    return out


def float8_loss_check(corpus: Path | None, device: torch.device, quick: bool, workdir: Path) -> Result:
    """The same short run (shakespeare-char shape, eager) in bf16 and with float8 linears: the loss
    curves must stay close. Reports both final losses and the largest gap over the curve."""
    from kiln.train.trainer import train

    result = Result("float8 vs bf16 loss curve (200 steps)", "shakespeare-char")
    if corpus is None or not corpus.is_file():
        result.note = f"skipped: corpus {corpus} not found"
        return result
    steps = 20 if quick else 200
    common = [f"data.source={json.dumps(str(corpus))}", "data.tokenizer='byte'", "data.val_fraction=0.1",
              f"train.device='{device.type}'", "checkpoint.every=0", "checkpoint.save_final=false",
              "metrics.progress='none'", "train.eval_every=0", f"train.steps={steps}", "schedule.warmup_steps=20"]
    common += (["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.seq_len=64", "model.max_seq_len=64",
                "train.batch_size=8"] if quick else
               ["model.dim=384", "model.n_layers=6", "model.n_heads=6", "data.seq_len=256", "model.max_seq_len=256",
                "train.batch_size=64"])
    curves = {}
    try:
        for name, extra in (("bf16", []), ("float8", ["train.float8=true"] if device.type == "cuda" else [])):
            run_dir = workdir / f"f8-{name}"
            train(load_config(None, common + extra), run_dir, resume=False)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            curves[name] = [r["loss"] for r in rows if r["kind"] == "train"]
            _release(device)
        gap = max(abs(a - b) for a, b in zip(curves["bf16"], curves["float8"]))
        tail = [abs(a - b) for a, b in zip(curves["bf16"][-20:], curves["float8"][-20:])]
        result.note = (f"final loss bf16 {curves['bf16'][-1]:.4f}, float8 {curves['float8'][-1]:.4f}; "
                       f"max gap {gap:.4f}, mean gap last 20 steps {sum(tail) / len(tail):.4f}")
    except Exception as e:
        result.note = f"failed: {type(e).__name__}: {str(e)[:160]}"
        traceback.print_exc()
    return result


def _seconds_to_target(rows: list[dict], target: float) -> tuple[float, str]:
    """(steady-state training seconds to the first eval at or under target, a note): steps to the
    target times the median step time after the first logged windows, which hold the compile."""
    train_rows = [r for r in rows if r["kind"] == "train"]
    steady = sorted(r["step_ms"] for r in train_rows[len(train_rows) // 10 + 25:]) or [math.nan]
    step_ms = steady[len(steady) // 2]
    for r in rows:
        if r["kind"] == "eval" and r["val_loss"] <= target:
            return r["step"] * step_ms / 1000, f"reached at step {r['step']} ({step_ms:.1f} ms/step steady)"
    best = min((r["val_loss"] for r in rows if r["kind"] == "eval"), default=math.nan)
    return math.nan, f"not reached in {len(train_rows)} steps ({step_ms:.1f} ms/step); best val {best:.3f}"


# ---------------------------------------------------------------------------- driver


def run_all(device_name: str, quick: bool, budget_s: float, steps: int, corpus: str | None, target: float,
            target_steps: int, out: str | None, only: str = "") -> list[Result]:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    sh = shapes(quick)
    g, l, c = sh["gpt2-124m"], sh["llama-1b"], sh["shakespeare-char"]
    peak, peak_source = peak_flops(device, "bf16" if device.type == "cuda" else "fp32")
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, peak {peak / 1e12:.0f} TFLOP/s ({peak_source})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-gpu-"))
    gm, dm = gpt2_style(g.model), g.model
    # configs/llama-1b.toml as written (8 x 2048 per micro-batch, 4 micro-batches, selective AC),
    # without AC, and single-GPU layouts for `kiln plan`'s validation (full AC at both shapes).
    l_cfg = replace(l, name="llama-1b-cfg", batch=l.batch * 2, grad_accum=4, ac="selective", steps=6)
    l_cfg_noac = replace(l_cfg, ac="none")
    l_full_ac, g_full_ac = replace(l, ac="full"), replace(g, ac="full")
    # op checkpointing (matmul and attention outputs kept): against no AC and full AC at both sizes
    l_op, l_cfg_op = replace(l, ac="op"), replace(l_cfg, ac="op")
    g_mb4 = replace(g, name="gpt2-124m-ga3", batch=4, grad_accum=3)
    # In priority order: the headline comparison first, what is nice to have last. Under a
    # whole-model compile kiln's `train.loss=auto` takes the plain loss (kiln/train/system.py).
    plan: list[tuple[str, Shape, Callable[[], Any]]] = [
        ("nanoGPT baseline compiled", g, lambda: baseline_case(g, device, True)),
        ("kiln gpt2-arch compiled", g, lambda: kiln_case(g, gm, device, compile_model=True, loss="full")),
        # torch.compile's max-autotune (train.autotune): the baseline given the same mode, for a fair pair
        ("nanoGPT baseline compiled, max-autotune", g,
         lambda: baseline_case(g, device, True, mode="max-autotune-no-cudagraphs")),
        ("kiln gpt2-arch compiled, max-autotune", g,
         lambda: kiln_case(g, gm, device, compile_model=True, loss="full", autotune=True)),
        ("kiln default compiled, max-autotune", g,
         lambda: kiln_case(g, dm, device, compile_model=True, loss="full", autotune=True)),
        ("kiln gpt2-arch compiled, max-autotune + CUDA graphs", g,
         lambda: kiln_case(g, gm, device, compile_model=True, loss="full", autotune=True, cuda_graphs=True)),
        ("kiln default compiled, ga 4, no AC, max-autotune", l_cfg_noac,
         lambda: kiln_case(l_cfg_noac, l.model, device, compile_model=True, loss="full", autotune=True)),
        ("kiln gpt2-arch compiled + CUDA graphs", g,
         lambda: kiln_case(g, gm, device, compile_model=True, loss="full", cuda_graphs=True)),
        # Issue 9: q/k/v (and w1/w3) as one GEMM vs one GEMM each, pinned both ways whatever the default
        ("kiln gpt2-arch compiled, fused projections", g,
         lambda: kiln_case(g, replace(gm, fused_projections=True), device, compile_model=True, loss="full")),
        ("kiln default compiled, fused projections", g,
         lambda: kiln_case(g, replace(dm, fused_projections=True), device, compile_model=True, loss="full")),
        ("kiln gpt2-arch compiled, separate projections", g,
         lambda: kiln_case(g, replace(gm, fused_projections=False), device, compile_model=True, loss="full")),
        ("kiln default compiled, separate projections", g,
         lambda: kiln_case(g, replace(dm, fused_projections=False), device, compile_model=True, loss="full")),
        ("kiln default compiled", l, lambda: kiln_case(l, l.model, device, compile_model=True, loss="full")),
        ("kiln default compiled (configs/llama-1b.toml)", l_cfg,
         lambda: kiln_case(l_cfg, l.model, device, compile_model=True, loss="full")),
        ("kiln default compiled, ga 4, no AC", l_cfg_noac,
         lambda: kiln_case(l_cfg_noac, l.model, device, compile_model=True, loss="full")),
        ("kiln default compiled, op AC", l_op, lambda: kiln_case(l_op, l.model, device, compile_model=True, loss="full")),
        ("kiln default compiled, ga 4, op AC", l_cfg_op,
         lambda: kiln_case(l_cfg_op, l.model, device, compile_model=True, loss="full")),
        ("kiln default compiled, ga 4, no AC, fused projections", l_cfg_noac,
         lambda: kiln_case(l_cfg_noac, replace(l.model, fused_projections=True), device, compile_model=True,
                           loss="full")),
        ("kiln gpt2-arch compiled, fused projections + CUDA graphs", g,
         lambda: kiln_case(g, replace(gm, fused_projections=True), device, compile_model=True, loss="full",
                           cuda_graphs=True)),
        ("kiln train loop", g, None),
        ("kiln default compiled", g, lambda: kiln_case(g, dm, device, compile_model=True, loss="full")),
        ("kiln gpt2-arch compiled, full AC", g_full_ac,
         lambda: kiln_case(g_full_ac, gm, device, compile_model=True, loss="full")),
        ("kiln gpt2-arch compiled, 4 x 1024 ga 3", g_mb4,
         lambda: kiln_case(g_mb4, gm, device, compile_model=True, loss="full")),
        ("kiln default compiled, full AC", l_full_ac,
         lambda: kiln_case(l_full_ac, l.model, device, compile_model=True, loss="full")),
        ("kiln gpt2-arch compiled, chunked loss", g,
         lambda: kiln_case(g, gm, device, compile_model=True, loss="chunked")),
        ("kiln default compiled float8 tensorwise", l,
         lambda: kiln_case(l, l.model, device, compile_model=True, loss="full", float8="tensorwise")),
        ("nanoGPT baseline compiled", c, lambda: baseline_case(c, device, True)),
        ("kiln default compiled", c, lambda: kiln_case(c, c.model, device, compile_model=True, loss="full")),
        ("kiln default compiled + CUDA graphs", c,
         lambda: kiln_case(c, c.model, device, compile_model=True, loss="full", cuda_graphs=True)),
        ("nanoGPT baseline eager", g, lambda: baseline_case(g, device, False)),
        ("kiln gpt2-arch eager", g, lambda: kiln_case(g, gm, device, compile_model=False, loss="chunked")),
        ("kiln default eager", g, lambda: kiln_case(g, dm, device, compile_model=False, loss="chunked")),
        ("kiln gpt2-arch compiled float8 tensorwise", g,
         lambda: kiln_case(g, gm, device, compile_model=True, loss="full", float8="tensorwise")),
        ("float8 vs bf16 loss curve", c, None),
        ("time to target", c, None),
        ("kiln default compiled float8 rowwise", l,
         lambda: kiln_case(l, l.model, device, compile_model=True, loss="full", float8="rowwise")),
        ("kiln default eager", l, lambda: kiln_case(l, l.model, device, compile_model=False, loss="chunked")),
    ]
    if device.type != "cuda":  # dry run: float8 and CUDA graphs refuse a CPU (that path is tested)
        plan = [p for p in plan if not p[0].startswith("kiln") or ("float8" not in p[0] and "CUDA" not in p[0])]
    if only:
        wanted = only.split("|")  # alternatives: "case A @ shape|case B @ shape"
        plan = [p for p in plan if any(w in f"{p[0]} @ {p[1].name}" for w in wanted)]
    results: list[Result] = []
    t0 = time.perf_counter()
    for label, shape, build in plan:
        if time.perf_counter() - t0 > budget_s:
            results.append(Result(label, shape.name, note="skipped: time budget spent"))
            if out:
                Path(out).write_text(json.dumps([vars(r) for r in results], indent=1), encoding="utf-8")
            continue
        print(f"-- {label} @ {shape.name}", flush=True)
        if label == "kiln train loop":
            results.append(trainer_loop_case(shape, gm, device, 40 if not quick else 12, workdir))
        elif label == "float8 vs bf16 loss curve":
            results.append(float8_loss_check(Path(corpus) if corpus else None, device, quick, workdir))
        elif label == "time to target":
            results += time_to_target(Path(corpus) if corpus else None, device, target, target_steps, quick, workdir)
        else:
            results.append(run_case(label, shape, build, device, peak, steps))
        print_results(results)
        if out:
            Path(out).write_text(json.dumps([vars(r) for r in results], indent=1), encoding="utf-8")
    return results


def print_results(results: list[Result]) -> None:
    base = {r.shape: r.tokens_per_s for r in results if r.case == "nanoGPT baseline compiled"}
    base.update({k: v for k, v in (("gpt2-124m-ga3", base.get("gpt2-124m")),) if v})
    print(f"{'shape':<17} {'case':<42} {'tok/s':>10} {'ms/step':>8} {'MFU':>6} {'vs base':>7} {'warm s':>7} "
          f"{'GiB':>6}  note")
    for r in results:
        ratio = r.tokens_per_s / base[r.shape] if r.shape in base and math.isfinite(r.tokens_per_s) else math.nan
        tps = f"{r.tokens_per_s:,.0f}" if math.isfinite(r.tokens_per_s) else (
            f"{r.seconds:.1f} s" if math.isfinite(r.seconds) else "-")
        print(f"{r.shape:<17} {r.case:<42} {tps:>10} {r.step_ms:>8.1f} {100 * r.mfu:>5.1f}% {ratio:>6.2f}x "
              f"{r.compile_s:>7.1f} {r.peak_mem_gib:>6.1f}  {r.note}", flush=True)
