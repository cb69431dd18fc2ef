"""`kiln import-hf HF_DIR --run-dir RUN_DIR`: a local transformers Llama/GPT-2 directory as a kiln run.

Reads only `config.json`, `tokenizer.json` and safetensors weights (`model.safetensors`, or the
shards a `model.safetensors.index.json` names) -- never pickle, so `pytorch_model.bin` is refused.
The run gets config.toml, tokenizer.json and a weights-only checkpoint step-0 (marked with
`WEIGHTS_ONLY_MARKER`): `kiln eval` scores it, and `kiln train --resume` continues from those
weights with a fresh optimizer, schedule and data position. Everything is built in a hidden
sibling directory and renamed into place, so a refused import writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from kiln.errors import KilnError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_JSON_BYTES = 64 << 20  # config/index files are small; refuse absurd ones before parsing
MAX_POSITIONS = 1 << 21  # kiln allocates RoPE tables for every position (2M x head_dim/2 x 2 floats)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise KilnError(f"{path} not found")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise KilnError(f"{path}: {path.stat().st_size} bytes is too large for a JSON config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: expected a JSON object")
    return data


def weight_files(hf_dir: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names it should hold; shard names must stay inside hf_dir."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: []}  # [] = every tensor in the file
    if not (hf_dir / INDEX_FILE).is_file():
        raise KilnError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} (kiln reads safetensors only, "
                        f"never pytorch_model.bin)")
    index_path = hf_dir / INDEX_FILE
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise KilnError(f"{index_path}: weight_map must be a non-empty object of tensor name -> file")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        # A bare file name keeps reads in HF_DIR (the entry may be a symlink, as in the HF cache).
        if (not isinstance(file, str) or Path(file).name != file or file in ("", ".", "..")
                or not file.endswith(".safetensors")):
            raise KilnError(f"{index_path}: weight_map[{name!r}]={file!r} must name a .safetensors file "
                            f"in {hf_dir}")
        if not (hf_dir / file).is_file():
            raise KilnError(f"{index_path}: shard {file} (for {name}) not found")
        files.setdefault(file, []).append(name)
    return files


def open_tensors(hf_dir: Path, stack: contextlib.ExitStack) -> dict:
    """name -> HFTensor over the safetensors files (headers read now, data memory-mapped on load)."""
    from safetensors import SafetensorError, safe_open

    from kiln.interop.hf import HFTensor

    loaders: dict = {}
    for file, names in weight_files(hf_dir).items():
        path = hf_dir / file
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            keys = set(handle.keys())
        except (SafetensorError, OSError) as e:
            raise KilnError(f"{path}: not a readable safetensors file ({e})") from None
        for name in names or sorted(keys):
            if name not in keys:
                raise KilnError(f"{path}: tensor {name} (listed in {INDEX_FILE}) is missing")
            if name in loaders:
                raise KilnError(f"{path}: tensor {name} appears in more than one file")
            header = handle.get_slice(name)
            loaders[name] = HFTensor(tuple(header.get_shape()), header.get_dtype(),
                                     lambda h=handle, n=name: h.get_tensor(n))
    return loaders


def import_hf(hf_dir: str | Path, run_dir: str | Path) -> tuple[Path, str, list[str]]:
    """Build RUN_DIR from HF_DIR; returns (run_dir, model_type, notes for the user)."""
    from kiln.config import JobConfig
    from kiln.data.tokenizer import load_tokenizer
    from kiln.errors import ConfigError
    from kiln.interop.hf import model_config_from_hf

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    if not hf_dir.is_dir():
        raise KilnError(f"{hf_dir} is not a directory (expected a local Hugging Face model directory)")
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise KilnError(f"{run_dir} already exists and is not an empty directory; choose a new --run-dir")
    config_path = hf_dir / CONFIG_FILE
    hf = read_json(config_path)
    model_cfg = model_config_from_hf(hf, str(config_path))
    model_cfg.name = run_dir.name or "imported"
    if model_cfg.max_seq_len > MAX_POSITIONS:
        key = "n_positions" if model_cfg.positions == "learned" else "max_position_embeddings"
        raise KilnError(f"{config_path}: {key}={model_cfg.max_seq_len}; kiln precomputes position tables "
                        f"for every position and supports at most {MAX_POSITIONS}")
    if not (hf_dir / TOKENIZER_FILE).is_file():
        raise KilnError(f"{hf_dir / TOKENIZER_FILE} not found (kiln reads the fast-tokenizer file; a "
                        f"SentencePiece tokenizer.model alone is not converted)")
    tokenizer = load_tokenizer(hf_dir / TOKENIZER_FILE)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise KilnError(f"{hf_dir / TOKENIZER_FILE}: {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocab_size={model_cfg.vocab_size} in {CONFIG_FILE}")
    notes = []
    hf_eos = hf.get("eos_token_id")
    if isinstance(hf_eos, int) and hf_eos != tokenizer.eos_id:
        # kiln takes EOS from tokenizer.json alone (<|endoftext|>, else its first special token).
        notes.append(f"{CONFIG_FILE} has eos_token_id={hf_eos} but kiln will separate documents and stop "
                     f"generating at token {tokenizer.eos_id}")
    cfg = JobConfig(model=model_cfg)
    # Continued training reads the imported tokenizer, not a newly trained one.
    cfg.data.tokenizer = str((run_dir / TOKENIZER_FILE).resolve())
    cfg.data.seq_len = min(cfg.data.seq_len, model_cfg.max_seq_len)
    try:
        cfg.validate()
    except ConfigError as e:
        raise KilnError(f"{config_path}: maps to an invalid kiln config: {e}") from None
    model = read_model(hf_dir, model_cfg)
    write_run(run_dir, cfg, tokenizer, model, {"imported_from": str(hf_dir.resolve()), "model_type": hf["model_type"]})
    return run_dir, hf["model_type"], notes


def read_model(hf_dir: Path, model_cfg):
    """The kiln Transformer for `model_cfg` with HF_DIR's weights (fp32, on the CPU)."""
    from kiln.interop.hf import from_hf_state
    from kiln.model.transformer import Transformer

    with contextlib.ExitStack() as stack:
        tensors = open_tensors(hf_dir, stack)
        # Checked before building even a meta model: a hostile layer count must not exhaust memory.
        if model_cfg.n_layers > len(tensors):
            raise KilnError(f"{hf_dir / CONFIG_FILE}: {model_cfg.n_layers} layers but only {len(tensors)} "
                            f"tensors in the weights")
        try:  # on meta: shapes only, but torch still refuses sizes past 64-bit element counts
            with torch.device("meta"):
                model = Transformer(model_cfg)
        except (RuntimeError, TypeError, OverflowError) as e:
            sizes = (f"hidden_size={model_cfg.dim}, intermediate_size={model_cfg.ffn_hidden}, "
                     f"head_dim={model_cfg.attention_head_dim()}, vocab_size={model_cfg.vocab_size}")
            raise KilnError(f"{hf_dir / CONFIG_FILE}: {sizes} make tensors too large to describe "
                            f"({str(e).splitlines()[0][:120]})") from None
        expected = {k: v.shape for k, v in model.state_dict().items()}
        loaders = from_hf_state(tensors, model_cfg, expected, str(hf_dir))
        model.to_empty(device="cpu")
        model.init_weights()  # fills the RoPE tables; every weight is overwritten next
        targets = model.state_dict()  # shares storage with the parameters
        missing = set(targets) - set(loaders) - ({"output.weight"} if model_cfg.tie_embeddings else set())
        assert not missing, f"HF mapping leaves {sorted(missing)} unset"  # a bug in kiln, not bad input
        with torch.no_grad():
            for name, load in loaders.items():  # one source tensor in memory at a time
                targets[name].copy_(load())
    return model


def write_run(run_dir: Path, cfg, tokenizer, model, provenance: dict) -> None:
    """config.toml, tokenizer.json and a weights-only step-0, built aside and renamed into place."""
    from kiln.checkpoint.manager import WEIGHTS_ONLY_MARKER, CheckpointManager, ModelOptimizerState
    from kiln.config import to_toml

    tmp = run_dir.parent / f".{run_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        config_text = to_toml(cfg)
        (tmp / "config.toml").write_text(config_text, encoding="utf-8")
        tokenizer.save(tmp / TOKENIZER_FILE)
        CheckpointManager(tmp / "checkpoints").save(
            0, {"app": ModelOptimizerState(model)},
            {"config.toml": config_text, WEIGHTS_ONLY_MARKER: json.dumps(provenance)})
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked by the caller)
        os.replace(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
