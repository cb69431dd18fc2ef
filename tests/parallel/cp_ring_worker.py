"""Run under torchrun (gloo, CPU): ring attention on zig-zag slices equals full causal attention,
forward and backward, with either block kernel (kiln/parallel/ring_blocks.py), and the
comparison detects a wrong mask or a wrong chunk order.

Exits non-zero (an AssertionError) on any mismatch; tests/parallel/test_context_parallel.py runs
check_ring_attention in its 2-rank launch (ranks.run_ranks) instead of a torchrun launch of its own.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.parallel.context_parallel import zigzag_positions
from kiln.parallel.ring_attention import Ring, ring_attention
from kiln.parallel.ring_blocks import block_keep

ATOL = 1e-5  # fp32; observed < 1e-6


def full_and_ring(ring, n_heads, n_kv, seq_len, index, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(2, n_heads, seq_len, 16, generator=g)
    k = torch.randn(2, n_kv, seq_len, 16, generator=g)
    v = torch.randn(2, n_kv, seq_len, 16, generator=g)
    dout = torch.randn(2, n_heads, seq_len, 16, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=n_heads != n_kv)
    ref.backward(dout)
    local = [t[:, :, index].clone().to(dtype).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, ring)
    out.backward(dout[:, :, index].to(dtype))
    return ref[:, :, index], [t.grad[:, :, index] for t in full], out, [t.grad for t in local], full


class MatmulBlocks:
    """Within `with`: ring blocks run the matmul kernel (ring_blocks.py; what GPUs run) instead of
    torch's fused CPU kernel, which this machine runs otherwise."""

    def __enter__(self):
        from kiln.parallel import ring_blocks

        assert ring_blocks.fused_kernel(torch.device("cpu"), dropout=False)  # the other kernel, outside
        self.original = ring_blocks.fused_kernel
        ring_blocks.fused_kernel = lambda device, dropout: False
        return self

    def __exit__(self, *exc):
        from kiln.parallel import ring_blocks

        ring_blocks.fused_kernel = self.original
        return False


def check_ring_attention(kinds=("causal", "window", "documents", "dropout")):
    """The checks below of `kinds` on this process group's ranks (one ring over all of them), each
    with both block kernels (dropout: the matmul one, whatever the device); raises AssertionError
    on a mismatch, returns "rank <r>: ok"."""
    ring = Ring(dist.group.WORLD)
    seq_len = 8 * ring.size
    zigzag = zigzag_positions(seq_len, ring.size, ring.rank)
    checks = {"causal": check_ring_causal, "window": check_ring_window, "documents": check_ring_documents}
    for kernel in (None, MatmulBlocks):  # the fused CPU kernel, then the matmul one
        with kernel() if kernel else contextlib.nullcontext():
            for kind in kinds:
                if kind in checks:
                    checks[kind](ring, zigzag, seq_len)
    if "dropout" in kinds:
        check_ring_dropout(ring, zigzag, seq_len)
    return f"rank {ring.rank}: ok"


def check_ring_causal(ring, zigzag, seq_len):
    """Ring attention on zig-zag slices equals the rows of full causal SDPA, forward and
    dQ/dK/dV, MHA and GQA, fp32 and bf16; the checks fail for contiguous slices and against
    unmasked attention."""
    cp, rank = ring.size, ring.rank
    for n_heads, n_kv in ((4, 4), (4, 2)):  # MHA and GQA
        ref, ref_grads, out, grads, _ = full_and_ring(ring, n_heads, n_kv, seq_len, zigzag)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        for name, got, want in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")

    # Contiguous slices (no zig-zag) through the same ring: the mask and chunk bookkeeping assume
    # zig-zag, so the result must differ from full attention on those rows.
    contiguous = torch.arange(rank * seq_len // cp, (rank + 1) * seq_len // cp)
    ref, _, out, _, _ = full_and_ring(ring, 4, 2, seq_len, contiguous)
    wrong = torch.tensor([not torch.allclose(out, ref, atol=ATOL, rtol=0)])
    dist.all_reduce(wrong)
    assert wrong.item() >= 1, "contiguous slices matched full attention: the order check cannot fail"

    # Non-causal full attention differs from the ring's result (the mask is really applied).
    _, _, out, _, full = full_and_ring(ring, 4, 2, seq_len, zigzag)
    nomask = F.scaled_dot_product_attention(*full, is_causal=False, enable_gqa=True)[:, :, zigzag]
    assert not torch.allclose(out, nomask, atol=ATOL, rtol=0), "ring attention ignores the causal mask"

    # bf16 inputs (autocast's dtype) run in fp32 inside and come back in bf16.
    ref, _, out, grads, _ = full_and_ring(ring, 4, 2, seq_len, zigzag, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)


def check_ring_documents(ring, index, seq_len):
    """Packed documents in the ring (`doc_ids`, the whole sequences' ids): equals SDPA with kiln's
    document mask (forward, dQ/dK/dV; with and without a window), documents ending inside chunks
    and at their edges, one row a single document; the mask is applied (the result differs from
    plain causal attention)."""
    from kiln.model.transformer import document_mask

    size = seq_len // (2 * ring.size)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, seq_len, 16, generator=g)
    k, v = (torch.randn(2, 2, seq_len, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, 4, seq_len, 16, generator=g)
    starts = torch.zeros(2, seq_len, dtype=torch.long)
    starts[0, [3, size, 2 * size + 1, seq_len - 2]] = 1  # row 0: documents cut mid-chunk and at a chunk edge
    doc_ids = starts.cumsum(1)  # row 1: one document
    for window in (0, size + 1):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=document_mask(doc_ids, window), enable_gqa=True)
        ref.backward(dout)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, ring, window=window, doc_ids=doc_ids)
        out.backward(dout[:, :, index])
        torch.testing.assert_close(out, ref[:, :, index], atol=ATOL, rtol=0, msg=lambda m: f"documents, window {window}: {m}")
        for name, got, want in zip("qkv", [t.grad for t in local], [t.grad[:, :, index] for t in full]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0,
                                       msg=lambda m, n=name: f"documents, window {window} d{n}: {m}")
        plain = ring_attention(*[t.detach() for t in local], ring, window=window)
        assert not torch.allclose(out[0], plain[0], atol=ATOL, rtol=0), "the documents changed nothing"
        torch.testing.assert_close(out[1], plain[1], atol=ATOL, rtol=0)  # one document: plain attention


def dropout_reference(q, k, v, seed, dropout_p, cp, wrong_seed=False):
    """Full causal attention with attention dropout whose mask on every (query chunk, key chunk)
    block is `block_keep`'s for `seed` (the chunks of the whole sequence, 2*cp of them): what the
    ring must compute, by plain softmax over whole rows (no ring, no online merge)."""
    bsz, n_heads, seq_len, head_dim = q.shape
    n_kv, size = k.shape[1], seq_len // (2 * cp)
    q5 = q.reshape(bsz, n_kv, n_heads // n_kv, seq_len, head_dim)
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) / head_dim ** 0.5
    s = s.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    keep = torch.ones_like(s)
    for a in range(2 * cp):
        for b in range(a + 1):
            block = block_keep(seed + int(wrong_seed), (a, b), (*s.shape[:3], size, size), dropout_p, "cpu")
            keep[..., a * size:(a + 1) * size, b * size:(b + 1) * size] = block
    out = (torch.softmax(s, -1) * keep) @ v.unsqueeze(2)
    return out.reshape(q.shape)


def check_ring_dropout(ring, index, seq_len, dropout_p=0.3, seed=1234):
    """Attention dropout in the ring: forward and backward equal the reference with the same block
    masks; the masks are really applied, and a backward with another seed's masks is wrong."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, seq_len, 16, generator=g)
    k, v = (torch.randn(2, 2, seq_len, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, 4, seq_len, 16, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dropout_reference(*full, seed, dropout_p, ring.size)
    ref.backward(dout)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, ring, dropout_p, torch.tensor([seed]))
    out.backward(dout[:, :, index])
    torch.testing.assert_close(out, ref[:, :, index], atol=ATOL, rtol=0)
    for name, got, want in zip("qkv", [t.grad for t in local], [t.grad[:, :, index] for t in full]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"dropout d{n}: {m}")
    plain = ring_attention(*[t.detach() for t in local], ring)
    assert not torch.allclose(out, plain, atol=ATOL, rtol=0), "attention dropout changed nothing"
    other = dropout_reference(q, k, v, seed, dropout_p, ring.size, wrong_seed=True)[:, :, index]
    assert not torch.allclose(out, other, atol=ATOL, rtol=0), "the comparison cannot tell the masks apart"
    # the backward with another seed's masks (forward's output and lse kept) gives other gradients
    from kiln.parallel.ring_attention import _ring_attention_backward_op, _ring_attention_op

    args = [t.detach() for t in local]
    o, lse = _ring_attention_op(*args, ring.group_name, dropout_p, torch.tensor([seed]), 0)
    dq, _ = _ring_attention_backward_op(dout[:, :, index], *args, o, lse, ring.group_name, dropout_p,
                                        torch.tensor([seed + 1]), 0)
    assert not torch.allclose(dq, local[0].grad, atol=ATOL, rtol=0), "the backward ignores the masks"


class CountedSends:
    """Within `with`: the blocks this rank sends through torch.distributed.batch_isend_irecv
    (`sends`), the call itself unchanged."""

    def __enter__(self):
        self.sends, self.original = 0, dist.batch_isend_irecv

        def counted(ops):
            self.sends += sum(op.op is dist.isend for op in ops)
            return self.original(ops)

        dist.batch_isend_irecv = counted
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self.original
        return False


def check_ring_window(ring, index, seq_len):
    """Sliding-window attention in the ring equals SDPA with kiln's window mask (forward, dQ/dK/dV)
    for windows inside one chunk, across chunk edges, spanning several chunks and the whole
    sequence; blocks wholly outside the window are skipped, and rows a block masks whole (met before
    their diagonal) do not poison the online softmax. A window shorter than the sequence differs
    from plain causal attention (the mask is applied). Each rank sends the blocks
    ring_layout.ring_messages counts: none for a window inside a chunk, 6 per hop where the window
    reaches few ranks (K/V both ways, dK/dV home), 3 cp - 2 round the ring otherwise."""
    from kiln.model.transformer import window_mask
    from kiln.parallel.ring_layout import ring_messages, window_hops

    size = seq_len // (2 * ring.size)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, seq_len, 16, generator=g)
    k, v = (torch.randn(2, 2, seq_len, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, 4, seq_len, 16, generator=g)
    for window in (1, size - 1, size, size + 1, 2 * size + 1, seq_len):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        band = window_mask(torch.arange(seq_len), seq_len, window)
        ref = F.scaled_dot_product_attention(*full, attn_mask=band, enable_gqa=True)
        ref.backward(dout)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        with CountedSends() as counted:
            out = ring_attention(*local, ring, window=window)
            out.backward(dout[:, :, index])
        torch.testing.assert_close(out, ref[:, :, index], atol=ATOL, rtol=0, msg=lambda m: f"window {window}: {m}")
        for name, got, want in zip("qkv", [t.grad for t in local], [t.grad[:, :, index] for t in full]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"window {window} d{n}: {m}")
        expected_sends = ring_messages(ring.size, window_hops(ring.size, size, window))
        assert counted.sends == expected_sends, f"window {window}: {counted.sends} blocks sent, not {expected_sends}"
        if window < seq_len:
            causal = ring_attention(*[t.detach() for t in local], ring)
            assert not torch.allclose(out, causal, atol=ATOL, rtol=0), f"window {window} changed nothing"


def check_hybrid_attention(degree=2):
    """Ulysses over `degree` consecutive ranks with the ring across the groups (parallel.ulysses_degree,
    kiln/parallel/context_parallel.py hybrid_groups / hybrid_positions) equals whole causal attention
    on each rank's positions, forward and dQ/dK/dV, fp32 atol 1e-5: MHA, GQA, K/V repeated, a window
    across chunks, packed documents (the ring's ids) with a window; in 2 rounds
    (parallel.ulysses_rounds) with K/V repeated, and with documents and a window. The positions cover
    the sequence once. Returns "rank <r>: hybrid ok"."""
    from torch.distributed.device_mesh import DeviceMesh

    from kiln.model.transformer import document_mask, window_mask
    from kiln.parallel.context_parallel import hybrid_groups, hybrid_positions
    from kiln.parallel.ulysses import Ulysses

    cp, rank = dist.get_world_size(), dist.get_rank()
    heads_group, ring_group = hybrid_groups(DeviceMesh("cpu", list(range(cp)), mesh_dim_names=("cp",)), degree)
    hybrid = Ulysses(heads_group, degree, Ring(ring_group))
    seq_len = 8 * cp
    index = hybrid_positions(seq_len, cp, degree, rank)
    everyone = [torch.empty_like(index) for _ in range(cp)]
    dist.all_gather(everyone, index)
    assert sorted(torch.cat(everyone).tolist()) == list(range(seq_len))
    starts = torch.zeros(2, seq_len, dtype=torch.long)
    starts[0, [3, 8, 17, seq_len - 2]] = 1
    doc_ids = starts.cumsum(1)
    rounds = Ulysses(heads_group, degree, Ring(ring_group), rounds=2)  # parallel.ulysses_rounds
    for hybrid_, n_heads, n_kv, window, ids in ((hybrid, 4, 4, 0, None), (hybrid, 4, 2, 0, None),
                                                (hybrid, 4, 1, 0, None), (hybrid, 4, 2, 9, None),
                                                (hybrid, 4, 2, 9, doc_ids), (rounds, 4, 1, 0, None),
                                                (rounds, 8, 2, 9, doc_ids)):
        g = torch.Generator().manual_seed(n_heads * 10 + n_kv + window)
        q = torch.randn(2, n_heads, seq_len, 16, generator=g)
        k, v = (torch.randn(2, n_kv, seq_len, 16, generator=g) for _ in range(2))
        dout = torch.randn(2, n_heads, seq_len, 16, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = (document_mask(ids, window) if ids is not None
                else window_mask(torch.arange(seq_len), seq_len, window or seq_len))
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=n_heads != n_kv)
        ref.backward(dout)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        out = hybrid_.attention(*local, window=window, mask=ids)
        out.backward(dout[:, :, index])
        case = f"hybrid heads {n_heads}/{n_kv}, window {window}, documents {ids is not None}, rounds {hybrid_.rounds}"
        torch.testing.assert_close(out, ref[:, :, index], atol=ATOL, rtol=0, msg=lambda m: f"{case}: {m}")
        for name, got, want in zip("qkv", [t.grad for t in local], [t.grad[:, :, index] for t in full]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{case} d{n}: {m}")
    misordered = Ulysses(heads_group, degree, Ring(ring_group))
    misordered.slots = list(range(2 * degree))  # the pieces left in the ranks' order: not the ring's chunks
    out = misordered.attention(q[:, :, index], k[:, :, index], v[:, :, index], window=window, mask=ids)
    wrong = torch.tensor([not torch.allclose(out, ref[:, :, index], atol=ATOL, rtol=0)])
    dist.all_reduce(wrong)
    assert wrong.item() >= 1, "pieces out of order matched full attention: the check cannot fail"
    return f"rank {rank}: hybrid ok"


def check_ulysses_attention():
    """Ulysses (kiln/parallel/ulysses.py) on zig-zag slices over this process group equals whole
    causal attention, forward and dQ/dK/dV, fp32 atol 1e-5: MHA, GQA with cp dividing the K/V heads
    and with K/V heads fewer than cp (repeated), sliding windows (inside a chunk, across chunks) and
    packed documents (the whole sequences' document mask, with a window), each also in 2 rounds
    (parallel.ulysses_rounds) where cp x 2 divides the heads. Controls: contiguous
    slices, or a wrong chunk order inside, give other rows. Returns "rank <r>: ulysses ok"."""
    from kiln.model.transformer import document_mask, window_mask
    from kiln.parallel.ulysses import Ulysses

    cp, rank = dist.get_world_size(), dist.get_rank()
    ulysses = Ulysses(dist.group.WORLD, cp)
    seq_len = 8 * cp
    size = seq_len // (2 * cp)
    zigzag = zigzag_positions(seq_len, cp, rank)
    starts = torch.zeros(2, seq_len, dtype=torch.long)
    starts[0, [3, size, 2 * size + 1, seq_len - 2]] = 1  # documents cut mid-chunk and at a chunk edge
    doc_ids = starts.cumsum(1)
    cases = [(4, 4, 0, None), (4, 2, 0, None), (4, 1, 0, None), (8, 2, 0, None),  # MHA, GQA, K/V repeated
             (4, 2, size - 1, None), (4, 2, 2 * size + 1, None),  # windows in a chunk and across
             (4, 2, 0, doc_ids), (4, 1, size + 1, doc_ids), (8, 1, size + 1, doc_ids),  # documents, with a window
             (12, 6, 0, None)]  # in 2 rounds on 2 ranks: 3 query heads a round over 3 K/V heads
    # parallel.ulysses_rounds: the heads in 2 rounds (the K/V heads too where they split in 2, else
    # all in the first round)
    rounds = Ulysses(dist.group.WORLD, cp, rounds=2)
    cases = [(ulysses, *case) for case in cases] + [(rounds, *case) for case in cases if case[0] % (2 * cp) == 0]
    if cp == 2:  # 4 rounds of 1 query head over a rank's 2 K/V heads, sent in the first round
        cases.append((Ulysses(dist.group.WORLD, cp, rounds=4), 8, 4, size + 1, doc_ids))
    for ulysses_, n_heads, n_kv, window, ids in cases:
        g = torch.Generator().manual_seed(n_heads * 10 + n_kv + window)  # the same full tensors on every rank
        q = torch.randn(2, n_heads, seq_len, 16, generator=g)
        k, v = (torch.randn(2, n_kv, seq_len, 16, generator=g) for _ in range(2))
        dout = torch.randn(2, n_heads, seq_len, 16, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        if ids is not None:
            mask = document_mask(ids, window)
        else:
            mask = window_mask(torch.arange(seq_len), seq_len, window or seq_len)
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=n_heads != n_kv)
        ref.backward(dout)
        local = [t[:, :, zigzag].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_.attention(*local, window=window, mask=None if ids is None else mask)
        out.backward(dout[:, :, zigzag])
        case = f"ulysses heads {n_heads}/{n_kv}, window {window}, documents {ids is not None}, rounds {ulysses_.rounds}"
        torch.testing.assert_close(out, ref[:, :, zigzag], atol=ATOL, rtol=0, msg=lambda m: f"{case}: {m}")
        for name, got, want in zip("qkv", [t.grad for t in local], [t.grad[:, :, zigzag] for t in full]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{case} d{n}: {m}")

    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 4, seq_len, 16, generator=g), *(torch.randn(2, 2, seq_len, 16, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # attention dropout: each head group its own masks (every rank holds the same random state), the
    # same masks again after restoring that state (checkpointing's recompute)
    same = q[:, :1].expand(-1, 4, -1, -1)[:, :, zigzag]  # four copies of one head: only the masks differ
    torch.manual_seed(1234)  # as the trainer seeds every rank
    state = torch.get_rng_state()
    dropped = ulysses.attention(same, same, same, dropout_p=0.5)
    torch.set_rng_state(state)
    assert torch.equal(ulysses.attention(same, same, same, dropout_p=0.5), dropped)
    assert all(not torch.equal(dropped[:, 0], dropped[:, h]) for h in range(4 // cp, 4, 4 // cp)), \
        "head groups of different ranks dropped alike"
    # in rounds: every (rank, round) head group its own masks, again the same after restoring the state
    same = q[:, :1].expand(-1, 4 * cp, -1, -1)[:, :, zigzag]
    torch.set_rng_state(state)
    dropped = rounds.attention(same, same, same, dropout_p=0.5)
    torch.set_rng_state(state)
    assert torch.equal(rounds.attention(same, same, same, dropout_p=0.5), dropped)
    assert all(not torch.equal(dropped[:, 0], dropped[:, h]) for h in range(2, 4 * cp, 2)), \
        "head groups of different ranks or rounds dropped alike"
    # the model's expand_kv (GPUs whose fused kernel wants whole heads): K/V repeated after the exchange
    expanding = Ulysses(dist.group.WORLD, cp, expand_kv=True)
    out = expanding.attention(q[:, :, zigzag], k[:, :, zigzag], v[:, :, zigzag])
    torch.testing.assert_close(out, ref[:, :, zigzag], atol=ATOL, rtol=0, msg=lambda m: f"ulysses expand_kv: {m}")
    contiguous = torch.arange(rank * seq_len // cp, (rank + 1) * seq_len // cp)
    misordered = Ulysses(dist.group.WORLD, cp)
    misordered.slots = list(range(2 * cp))  # the chunks left in the ranks' order
    for name, attention, index in (("contiguous slices", ulysses.attention, contiguous),
                                   ("chunks out of order", misordered.attention, zigzag)):
        out = attention(q[:, :, index], k[:, :, index], v[:, :, index])
        wrong = torch.tensor([not torch.allclose(out, ref[:, :, index], atol=ATOL, rtol=0)])
        dist.all_reduce(wrong)
        assert wrong.item() >= 1, f"{name} matched full attention: the check cannot fail"
    return f"rank {rank}: ulysses ok"


def main():
    dist.init_process_group("gloo")
    result = check_ring_attention()
    dist.destroy_process_group()
    print(result)


if __name__ == "__main__":
    main()
