"""Sampling with a KV cache: temperature, top-k and nucleus (top-p) filtering."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) all but the top-k tokens and the smallest set whose probability >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(model, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """New token ids after the prompt (greedy when temperature == 0); stops before eos_id."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    was_training = model.training
    model.eval()
    device = model.tok_embeddings.weight.device
    max_len = model.cfg.max_seq_len
    prompt_ids = prompt_ids[-(max_len - 1):]  # keep room for at least one new token
    max_new_tokens = min(max_new_tokens, max_len - len(prompt_ids))
    cache = model.new_cache(1, max_len)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, start_pos=0)[:, -1]
    out: list[int] = []
    pos = len(prompt_ids)
    for _ in range(max_new_tokens):
        if temperature <= 0:
            next_id = int(logits.argmax(-1))
        else:
            probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        if eos_id is not None and next_id == eos_id:
            break
        out.append(next_id)
        if pos >= max_len:
            break
        logits = model(torch.tensor([[next_id]], device=device), cache=cache, start_pos=pos)[:, -1]
        pos += 1
    model.train(was_training)
    return out
