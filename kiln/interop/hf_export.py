"""`kiln export RUN_DIR --to hf OUT_DIR`: a run's checkpoint as a transformers model directory.

Everything is written to a hidden sibling directory first and renamed into place at the end, so a
refused or failed export leaves neither a half-written OUT_DIR nor any change to the run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kiln.errors import KilnError
from kiln.interop.hf import HF_CLASS, export_family, hf_config_json, to_hf_state
from kiln.interop.hf_tokenizer import save_hf_tokenizer

WEIGHTS_FILE = "model.safetensors"


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise KilnError("exporting to Hugging Face needs transformers: pip install 'kiln-lm[hf]'") from None


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise KilnError(f"{out_dir} already exists and is not an empty directory; choose a new OUT_DIR")


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> tuple[Path, str, int]:
    """Write config.json, model.safetensors and the tokenizer; returns (out_dir, HF class, step)."""
    from safetensors.torch import save_file

    from kiln.config import load_config
    from kiln.eval.load import load_run

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    require_transformers()
    check_out_dir(out_dir)
    if (run_dir / "config.toml").is_file():  # refuse an inexpressible model before loading weights
        cfg = load_config(run_dir / "config.toml").model
        export_family(cfg)
    loaded = load_run(run_dir, step)
    cfg = loaded.config.model
    family = export_family(cfg)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        eos_id = save_hf_tokenizer(loaded.tokenizer, tmp, cfg.max_seq_len)
        (tmp / "config.json").write_text(hf_config_json(cfg, eos_id))
        save_file(to_hf_state(loaded.model.state_dict(), cfg), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); os.replace needs the name free or an empty dir
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir, HF_CLASS[family], loaded.step
