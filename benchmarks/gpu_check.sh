#!/usr/bin/env bash
# Everything one GPU must show for kiln, in one go, with no network, in under 8 minutes on one
# H100/H200: a device-side check of the sync-free step (and of kiln's Adafactor against torch's on
# the GPU, ADAFACTOR_CHECK_DEVICE=cpu dry-runs that block here), then `benchmarks/throughput.py --device
# cuda` (kiln vs a plain nanoGPT-style loop at GPT-2 124M and Llama-1B shapes, eager/compiled,
# bf16/float8, the kiln train loop, CUDA graphs at the shakespeare-char size, float8 vs bf16 loss
# curves, time to a target validation loss). Cases run in priority order under BUDGET_S seconds
# (ONLY="case a|case b" picks some). Then `kiln train` under torchrun on the GPU, and the
# torch-sensitive tests (TESTS) on this machine's torch, the unlearning proof among them.
#
#   bash benchmarks/gpu_check.sh            # CORPUS=path/to/tinyshakespeare.txt for the text cases
#
# Packages the GPU image may lack (torchao for float8, tomli-w) are installed from wheels in .whl/
# when that folder exists (see benchmarks/README.md, "One GPU"). Results: $OUT or benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
if compgen -G ".whl/*.whl" >/dev/null; then
  # One wheel pip cannot take (another Python's, e.g. a cp311 build on the image's 3.12) stops the
  # whole install; everything after would fail for want of tomli-w, so stop here, saying which.
  # Fetch them for the image: pip download --no-deps --only-binary=:all: --python-version 3.12 ...
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kiln-site .whl/*.whl \
    || { echo "gpu_check.sh: the wheels in .whl/ did not install (pip's reason above); fetch them for this Python ($(python3 -V))" >&2; exit 1; }
  export PYTHONPATH=/tmp/kiln-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
[ "${SKIP_CHECK:-1}" = 1 ] && python3 - <<'PY'
# The step skips a non-finite update on the device: parameters and optimizer state stay
# bit-identical, and (sync debug mode "error") nothing in the step waits for the device, with fused
# AdamW and with kiln's Lion/LAMB/Muon (found_inf, kiln/train/optimizers/skip.py).
import contextlib, torch
from kiln.config import ModelConfig, OptimConfig
from kiln.model.transformer import Transformer
from kiln.train.optim import build_optimizer
from kiln.train.step import skips_on_device, train_step
dev = torch.device("cuda")
ac = torch.autocast("cuda", dtype=torch.bfloat16)
for name in ("adamw", "lion", "lamb", "muon"):
    m = Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)).to(dev)
    m.init_weights(torch.Generator(device=dev).manual_seed(0))
    opt = build_optimizer(m, OptimConfig(name=name), "cuda")
    x = torch.randint(1, 256, (2, 64), device=dev)
    train_step(m, opt, [(x, x)], autocast=ac, scaler=None, clip=1.0)  # creates the optimizer state
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in m.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    m.loss_impl = "chunked"
    with torch.no_grad():
        m.tok_embeddings.weight[0, 0] = float("nan")  # poisons the loss of any batch with token 0
        before[0][0, 0] = float("nan")
    x[0, 0] = 0
    torch.cuda.synchronize()
    synced = "none"
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, gn, skipped = train_step(m, opt, [(x, x)], autocast=ac, scaler=None, clip=1.0)
    except RuntimeError as e:  # a synchronizing call: say which, then run the step without the check
        synced = str(e).splitlines()[0][:120]
        torch.cuda.set_sync_debug_mode("default")
        loss, gn, skipped = train_step(m, opt, [(x, x)], autocast=ac, scaler=None, clip=1.0)
    torch.cuda.set_sync_debug_mode("default")
    same = all(torch.equal(a.nan_to_num(), b.detach().nan_to_num()) for a, b in zip(before, m.parameters()))
    after = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    same_state = all(torch.equal(a, b) for a, b in zip(state, after))
    print(f"device-side skip, {name}: {'found_inf' if skips_on_device(opt) else 'host check'}, "
          f"skipped={bool(skipped)}, parameters unchanged={same}, state unchanged={same_state}, "
          f"host sync in the step: {synced}")
PY
[ "${SKIP_CHECK:-1}" = 1 ] && python3 - <<'PY'
# kiln's Adafactor on the GPU (its device-side alpha and denominator, kiln/train/optimizers/adafactor.py):
# torch's numbers (torch.optim.Adafactor on the same gradients, 5 steps) and no host sync in its step.
import copy, os, torch
from kiln.config import ModelConfig
from kiln.model.transformer import Transformer
from kiln.train.optimizers import Adafactor
dev = torch.device(os.environ.get("ADAFACTOR_CHECK_DEVICE", "cuda"))  # cpu: a dry run of this block
torch.manual_seed(0)
ours = Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)).to(dev)
theirs = copy.deepcopy(ours)
opt = Adafactor(ours.parameters(), lr=0.01, weight_decay=0.1)
ref = torch.optim.Adafactor(theirs.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
synced = "none"
for step in range(5):
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(step)).to(dev)
    for model in (ours, theirs):
        model(x, x).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    except RuntimeError as e:  # a synchronizing call: say which, then step without the check
        synced = str(e).splitlines()[0][:120]
        torch.cuda.set_sync_debug_mode("default")
        opt.step()
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    ref.step()
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
apart = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours.parameters(), theirs.parameters()))
print(f"adafactor on {dev.type}: largest difference to torch's after 5 steps {apart:.1e} (relative), "
      f"host sync in its step: {synced}")
PY
CORPUS=${CORPUS:-.gpudata/tinyshakespeare.txt}
python3 benchmarks/throughput.py --device cuda --budget-s "${BUDGET_S:-300}" --corpus "$CORPUS" --only "${ONLY:-}" \
  --json "$RESULTS/gpu_throughput_partial.json" --out "$RESULTS/gpu_throughput.json" 2>&1 | tee "$RESULTS/gpu_check.log"
# Issue 7 on a one-GPU machine: `kiln train` under torchrun on CUDA (NCCL) with Lion; its checkpoint,
# taken on the GPU, continues on the CPU; two processes on one GPU stop with one line, not a crash.
if [ "${LAUNCH_CHECK:-1}" = 1 ]; then
  d=$(mktemp -d)
  { timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m kiln.cli train --steps 40 --stop-at 20 \
      --run-dir "$d/run" --set "optim.name='lion'" --set checkpoint.every=20 2>&1 | tail -4
    timeout 120 python3 -m kiln.cli train --resume "$d/run" --set "train.device='cpu'" 2>&1 | tail -3
    timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m kiln.cli train --steps 2 --run-dir "$d/two" 2>&1 \
      | grep -m 2 "error" ; } 2>&1 | tee "$RESULTS/gpu_launch.log"
fi
# The test suite's torch-sensitive part on this machine's torch (2.11 on the lent GPUs), where
# train.device=auto takes the GPU; pytest-xdist spreads it over the cores. TESTS= skips it.
TESTS=${TESTS-tests/parallel tests/train tests/model tests/checkpoint tests/plan tests/privacy tests/interop}
if [ -n "$TESTS" ]; then
  # SIGINT at the limit: pytest still prints its summary of what failed so far
  # --dist loadfile: a module's launch fixture runs once, on the worker that takes the module
  timeout -s INT "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-12}" \
    --dist loadfile -rfE \
    $TESTS 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -40
fi
