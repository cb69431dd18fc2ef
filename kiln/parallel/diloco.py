"""DiLoCo / local SGD for weakly connected clusters (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", algorithm 1), and its streaming form (Douillard et
al. 2025, "Streaming DiLoCo with overlapping communication").

The replicas are the `dp_replicate` ranks of the mesh. Each replica trains alone with its own inner
optimizer (kiln's configured one, AdamW in the paper) on its own slice of the data; inside a
replica the model may be split any way kiln splits one: FSDP2 over `dp_shard` (dp_mode
fsdp/zero2) or DDP / ZeRO-1 over them (ddp/zero1), tensor parallelism over `tp`, pipeline stages over `pp`, context parallelism over
`cp` and expert parallelism carved out of the replica's own ranks (dims.py `diloco_layout`).
Gradients are reduced inside a replica only (`ParallelDims.grad_mesh_names` leaves dp_replicate
out: never HSDP; the expert mesh keeps the replicas apart as well). Every H =
`parallel.diloco_inner_steps` steps the replicas meet once:

    delta   = mean over replicas(anchor - params)        # the outer "pseudo-gradient"
    anchor  = outer Nesterov SGD step on anchor with gradient delta   (lr 0.7, momentum 0.9)
    params  = anchor                                      # every replica restarts from it

where `anchor` holds the parameters of the last sync. Streaming DiLoCo (`parallel.diloco_fragments`
P > 1, `diloco_sync_delay` tau, `diloco_mix` alpha, `diloco_comm_dtype`): the blocks are dealt
into P fragments (strided: block i to fragment i % P), each synced as above every H steps but at
staggered steps, one fragment every H / P steps, so a sync sends 1/P of the parameters (the peak
bandwidth a slow link must carry falls by P); a fragment's exchange starts tau inner steps before
its merge and runs under them, and the merge keeps alpha of the replica's own parameters,
params = alpha params + (1 - alpha) anchor; the outer gradient crosses the link in bfloat16 (half
the bytes, summed on the wire in bf16) or block-scaled float8 (a quarter, all-gathered and summed
in fp32) if asked; the mean and the outer step are fp32. One
fragment's sync is diloco_fragment.py's `Fragment`; this module deals the fragments and runs their
schedule. Every rank works on its own shards only (the
DTensor local tensors): it averages them with the ranks holding the same shard in the other
replicas (the dp_replicate group) and steps its shard of the anchor, so the anchor and the outer
momentum are sharded like the parameters, and nothing crosses replicas between outer steps (the
torchft `DiLoCo` layout: one replica per island, FSDP/TP inside). Where several ranks of a
replica hold the very same parameters (DDP / ZeRO-1 over its dp_shard x cp ranks, `inside`),
each keeps only its 1/S slice of the anchor and outer momentum (8/S bytes per parameter, not 8),
averages that slice across the replicas and steps it, and they all-gather the new anchor. Under pp a rank holds its
stages' parameters only, and averages those with the same stage's ranks in the other replicas;
a tied head copy (pipeline_tied.py) is averaged like the embedding it copies, from equal values in
every replica, so the two stay equal. Parameters replicated inside a replica (over cp, or dense
ones over ep) are equal on those ranks before the outer step and get the same average, so they
stay equal after it. `after_step` returns, per sync started, the bytes this rank sends into the
all-reduce (its payload; a ring moves about 2 (N-1)/N of that per link).

torch APIs: `torch.optim.SGD(nesterov=True)` is the outer optimizer, `torch.distributed.all_reduce`
(one flat buffer per sync) the averaging, `DTensor.to_local` / `DTensor.from_local` the shards; the
bookkeeping is kiln's. The inner optimizer state stays per replica, as in the paper.

Checkpoints. Between outer syncs every replica has its own parameters and inner optimizer state
(AdamW moments), so each replica saves its own: replica 0 under the usual `app` key (what eval,
generate and export read, and what a non-DiLoCo run continues from), replica r > 0 under
`diloco_rank<r>` (`replica_states`). The ranks of one replica save their shards under that key
(DCP writes each shard once), so this is one DCP checkpoint with one manifest, loaded through the
same safe reader. The anchor and the outer momentum (`diloco`) are equal across replicas, DTensors
sharded like the parameters (split `inside` a replica: each rank saves its slice's boxes of each
parameter, kiln/parallel/zero1_shards.py, nothing gathered), stored once and keyed by parameter
name as one process names them (a pp head copy that the checkpoint lacks loads the embedding's:
`match_checkpoint`). A `diloco_layout_<R>x<S>x<T>[_pp<P>][_cp<C>][_ep<E>][_etp1][_ddp][_frag<P>]
[_overlap]` entry records the replica count and the split inside each (dp_shard x tp, and pp, cp,
ep where > 1, etp1 where ep borrows tp, and the fragments and whether syncs overlap). A DiLoCo run
continues a checkpoint of the same replicas, fragments and sync delay (`check_resume`, one line
otherwise: a replica without its own state would train on another's moments), split inside each
replica as it likes: every piece of state is DCP's, so it reshards into the new split as a run
without DiLoCo does (the replica's model and inner optimizer under its own key, the anchor and
momentum by name). A sync in flight when a
checkpoint is taken is settled first (its exchange waited for and its outer step taken, which
touches no parameter); the checkpoint records its fragment and merge step (`pending`), so a resumed
run merges it where the uninterrupted one does.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.parallel.diloco_fragment import Fragment

APP_KEY = "app"  # the model + optimizer entry of kiln's checkpoint (kiln/train/trainer.py)
REPLICA_PREFIX = "diloco_rank"  # replica r > 0's own model + inner optimizer: diloco_rank<r>
LAYOUT_PREFIX = "diloco_layout_"  # diloco_layout_<replicas>x<dp_shard>x<tp>[_pp<P>][_cp<C>][_ep<E>][_etp1]
SPLITS = ("pp", "cp", "ep")  # the dimensions inside a replica beyond dp_shard x tp, in the key when > 1


def replica_key(replica: int) -> str:
    return APP_KEY if replica == 0 else f"{REPLICA_PREFIX}{replica}"


def layout_key(replicas: int, shards: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1,
               ep_borrows_tp: bool = False, replicated: bool = False, fragments: int = 1,
               overlapped: bool = False) -> str:
    """A layout without pp, cp and ep keeps the key kiln wrote before those ran under DiLoCo.
    `replicated`: the `shards` ranks of a replica run DDP or ZeRO-1 (whole parameters) rather than
    FSDP (`_ddp`). Streaming DiLoCo: `_frag<P>` with P > 1 fragments (each rank's slices of the
    outer state follow them), `_overlap` with a sync delay (the checkpoint holds the sync awaiting
    its merge)."""
    extra = "".join(f"_{name}{size}" for name, size in zip(SPLITS, (pp, cp, ep)) if size > 1)
    return (f"{LAYOUT_PREFIX}{replicas}x{shards}x{tp}{extra}{'_etp1' if ep_borrows_tp else ''}"
            f"{'_ddp' if replicated else ''}{f'_frag{fragments}' if fragments > 1 else ''}"
            f"{'_overlap' if overlapped else ''}")


def describe_layout(key: str) -> str:
    """'dp_shard=S x tp=T[ x pp=P ...]' of a layout key (the key itself when it is not kiln's)."""
    body = key[len(LAYOUT_PREFIX):].split("_")
    split = body[0].split("x")
    if len(split) != 3:
        return key
    parts = [f"dp_shard={split[1]}", f"tp={split[2]}"]
    for extra in body[1:]:
        if extra == "ddp":
            parts[0] += " (ddp/zero1)"
            continue
        if extra == "overlap":
            parts.append("diloco_sync_delay > 0")
            continue
        name = next((n for n in (*SPLITS, "etp", "frag") if extra.startswith(n) and extra[len(n):].isdigit()), None)
        if name is None:
            return key
        label = "diloco_fragments" if name == "frag" else name  # the [parallel] key it stands for
        parts.append(f"{label}={extra[len(name):]}")
    return " x ".join(parts)


def replica_states(states: dict, replica: int) -> dict:
    """`states` (the trainer's Stateful dict) with this replica's model + inner optimizer under its
    own key, so every replica saves and loads its own (replica 0 keeps `app`)."""
    return {replica_key(replica) if name == APP_KEY else name: value for name, value in states.items()}


def _streaming_of(key: str) -> tuple[int, bool]:
    """(fragments, overlapped) of a layout key."""
    parts = key[len(LAYOUT_PREFIX):].split("_")[1:]
    frag = next((int(p[4:]) for p in parts if p.startswith("frag") and p[4:].isdigit()), 1)
    return frag, "overlap" in parts


def check_resume(saved_names: set[str], replicas: int, where: str, shards: int = 1, tp: int = 1,
                 **split) -> str | None:
    """One line unless the checkpoint (its top-level state names) holds DiLoCo state for exactly
    `replicas` replicas with this run's fragments and sync delay (or none). Each replica may be
    split otherwise than when saved (dp_shard=`shards` x tp=`tp` x `split`: layout_key's pp, cp,
    ep, ep_borrows_tp, replicated, fragments, overlapped; a checkpoint without a layout entry was
    saved by whole replicas): its model, inner optimizer, anchor and momentum are DCP's, keyed by
    name, and reshard. Returns the saved layout's key where it differs from this run's (the
    trainer says so; `Layout.match_checkpoint` leaves the entry unloaded), else None."""
    if "diloco" not in saved_names:
        raise KilnError(f"{where} was saved without DiLoCo; a DiLoCo run (parallel.diloco_inner_steps > 0) "
                        f"continues only a DiLoCo checkpoint: set parallel.diloco_inner_steps=0 or start a "
                        f"new --run-dir")
    others = {int(n[len(REPLICA_PREFIX):]) for n in saved_names
              if n.startswith(REPLICA_PREFIX) and n[len(REPLICA_PREFIX):].isdigit()}
    saved = 1 + max(others, default=0)
    if saved != replicas or others != set(range(1, replicas)):
        raise KilnError(f"{where} holds {saved} DiLoCo replicas' state, this run has {replicas}; each replica "
                        f"resumes its own model and inner optimizer, so DiLoCo continues with {saved} "
                        f"replicas (or continue without DiLoCo from replica 0's state: "
                        f"parallel.diloco_inner_steps=0)")
    layouts = sorted(n for n in saved_names if n.startswith(LAYOUT_PREFIX))
    saved_layout = layouts[0] if layouts else layout_key(saved, 1, 1)
    mine = layout_key(replicas, shards, tp, **split)
    if layouts[1:] or _streaming_of(saved_layout) != _streaming_of(mine):
        raise KilnError(f"{where} holds DiLoCo replicas split {describe_layout(saved_layout)}, this run's are "
                        f"{describe_layout(mine)}; the fragments (each with its own outer state) and the sync "
                        f"in flight follow diloco_fragments and diloco_sync_delay: set them as saved (or continue "
                        f"without DiLoCo from replica 0's state: parallel.diloco_inner_steps=0)")
    return saved_layout if saved_layout != mine else None


class Layout:
    """Stateful: the replica layout, saved under its `layout_key` so `check_resume` reads it from
    the checkpoint's names before anything loads (the tensor double-checks it at load)."""

    def __init__(self, replicas: int, shards: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1,
                 ep_borrows_tp: bool = False, replicated: bool = False, fragments: int = 1,
                 overlapped: bool = False):
        self.value = torch.tensor([replicas, shards, tp])
        # Only where a replica has more in it: the checkpoints of kiln before pp/cp/ep keep loading.
        more = [pp, cp, ep, int(ep_borrows_tp)]
        self.split = torch.tensor(more) if more != [1, 1, 1, 0] else None
        self.replicated = torch.tensor([1]) if replicated else None  # DDP / ZeRO-1 over the shards
        streaming = [fragments, int(overlapped)]
        self.streaming = torch.tensor(streaming) if streaming != [1, 0] else None

    def state_dict(self) -> dict:
        state = {"replicas_shards_tp": self.value}
        if self.split is not None:
            state["pp_cp_ep_etp1"] = self.split
        if self.replicated is not None:
            state["ddp_inside"] = self.replicated
        if self.streaming is not None:
            state["fragments_overlapped"] = self.streaming
        return state

    def match_checkpoint(self, saved: set[str], where: str) -> bool:
        """Loaded only from a checkpoint of this very layout (CheckpointManager.load calls this):
        one of another split inside the same replicas (`check_resume`) holds another entry."""
        return bool(saved)

    def load_state_dict(self, state: dict) -> None:
        for name, mine in self.state_dict().items():
            if not torch.equal(state[name], mine):
                raise KilnError(f"checkpoint DiLoCo layout ({name.replace('_', ', ')}) = {state[name].tolist()} "
                                f"differs from this run's {mine.tolist()}")


def replicated_group(dims):
    """The ranks inside one replica that hold the very same parameters (DDP or ZeRO-1 over its
    dp_shard x cp ranks, without ep, whose experts differ between them), which split the outer
    average between them (`DiLoCo`'s `inside`); None where each rank of a replica holds its own."""
    if dims.dp_mode not in ("ddp", "zero1") or dims.grad_ranks == 1 or dims.ep > 1:
        return None
    from kiln.parallel.data_parallel import grad_mesh

    return grad_mesh(dims).get_group()



LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragment_of(named: list[tuple[str, torch.Tensor]], fragments: int, n_layers: int, pattern: str = "strided",
                tied: tuple[torch.Tensor, ...] = ()) -> list[int]:
    """The fragment of each named parameter. A block's parameters go by its layer index i (global,
    also on a pipeline stage): strided i % P (Douillard et al. 2025's choice: each fragment spans
    the depth) or sequential i * P // n_layers (contiguous runs of blocks, torchft's); what comes
    before the first block (the embeddings) and a tied head copy (pipeline_tied.py) go with block 0,
    what follows the blocks (final norm, head) with the last block."""
    def of_layer(i: int) -> int:
        return i % fragments if pattern == "strided" else i * fragments // n_layers

    tied_ids = {id(t) for t in tied}
    out, seen_block = [], False
    for name, p in named:
        match = LAYER_INDEX.search(name)
        if match:
            seen_block = True
            out.append(of_layer(int(match.group(1))))
        elif id(p) in tied_ids or not seen_block:
            out.append(of_layer(0))
        else:
            out.append(of_layer(n_layers - 1))
    return out


class DiLoCo:
    """DiLoCo over `model`'s trainable parameters in `fragments` fragments (diloco_fragment.py;
    1 = plain DiLoCo). Fragment f's outer sync merges after the inner steps s with
    s % H == (f + 1) * H / P (mod H): one fragment every H / P steps, each every H steps; its
    exchange starts `sync_delay` steps earlier and runs under those inner steps (Streaming DiLoCo's
    overlap, tau < H / P so one fragment at a time is in flight); the merge mixes `mix` of the
    replica's own parameters into the new anchor (alpha; 0 = reset to it). `group`, `inside`: as
    Fragment's. `n_layers`: the whole model's block count (the fragments' pattern). `pipeline`: the
    model is this rank's pipeline stages (pp > 1). The checkpoint
    keys the anchor and momentum by parameter name, as one process names them, so any layout of the
    same replicas loads them (`match_checkpoint`)."""

    def __init__(self, model: nn.Module, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group=None, inside=None, fragments: int = 1, pattern: str = "strided",
                 n_layers: int = 1, sync_delay: int = 0, mix: float = 0.0, comm_dtype: str = "float32",
                 pipeline: bool = False):
        if inner_steps < 1 or fragments < 1 or inner_steps % fragments or not 0 <= sync_delay < inner_steps // fragments:
            raise ValueError(f"DiLoCo needs inner_steps >= 1 divisible by fragments >= 1 and 0 <= sync_delay < "
                             f"inner_steps / fragments, got {inner_steps}, {fragments}, {sync_delay}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # The names a checkpoint of the model uses: without the wrappers that activation
        # checkpointing and per-block compile put around blocks (as DCP's get_state_dict drops them).
        self.names = [n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") for n, _ in named]
        tied = tuple(model.tied_embedding_copies()) if hasattr(model, "tied_embedding_copies") else ()
        tied_ids = {id(t) for t in tied}
        self.tied_copies = {i for i, (_, p) in enumerate(named) if id(p) in tied_ids}  # pp's head copies
        which = fragment_of(named, fragments, n_layers, pattern, tied)
        self.inner_steps, self.sync_delay, self.mix, self.pipeline = inner_steps, sync_delay, mix, pipeline
        self.params = [p for _, p in named]
        self.parts: dict[int, Fragment] = {}  # only the fragments this rank holds parameters of
        self.members: dict[int, list[int]] = {}  # each part's parameters, as indices into `named`
        for f in range(fragments):
            mine = [i for i, w in enumerate(which) if w == f]
            if mine:
                self.members[f] = mine
                self.parts[f] = Fragment([named[i][1] for i in mine], [self.names[i] for i in mine], outer_lr,
                                         outer_momentum, group, inside, getattr(torch, comm_dtype))
        self.outer_steps = [0] * fragments  # outer syncs started, per fragment
        self.pending: tuple[int, int] | None = None  # (fragment, merge step) of a started, unmerged sync

    def anchors(self) -> list[torch.Tensor]:
        """This rank's anchor tensors, fragment by fragment (with `inside` one flat slice each)."""
        return [a for part in self.parts.values() for a in part.anchor]

    def momenta(self) -> list[torch.Tensor]:
        """The outer Nesterov momentum buffers, in `anchors`' order."""
        return [part.outer.state[a]["momentum_buffer"] for part in self.parts.values() for a in part.anchor]

    def _merge_step_offset(self, fragment: int) -> int:
        return (fragment + 1) * self.inner_steps // len(self.outer_steps) % self.inner_steps

    def after_step(self, step: int) -> list[dict]:
        """What follows inner step `step` (1-based): the merge of the sync in flight due now, and
        the start (and without a delay the merge) of the fragment due. Returns a row per sync
        started: its fragment, its count and the bytes this rank put into the exchange."""
        if self.pending is not None and self.pending[1] == step:
            fragment, _ = self.pending
            if fragment in self.parts:
                self.parts[fragment].merge(self.mix)
            self.pending = None
        started = []
        for f in range(len(self.outer_steps)):
            if step % self.inner_steps != (self._merge_step_offset(f) - self.sync_delay) % self.inner_steps:
                continue
            part = self.parts.get(f)
            sent = part.launch(wait=not self.sync_delay) if part is not None else 0
            self.outer_steps[f] += 1
            started.append({"fragment": f, "outer_step": self.outer_steps[f], "bytes_sent": sent})
            if not self.sync_delay:
                if part is not None:
                    part.merge(self.mix)
            else:
                self.pending = (f, step + self.sync_delay)
        return started

    @torch.no_grad()
    def outer_step(self) -> int:
        """Every fragment's outer sync now, blocking (benchmarks and tests: DiLoCo's sync as one
        call); returns the bytes this rank put into the exchanges."""
        if self.pending is not None:  # the sync in flight merges first
            self.after_step(self.pending[1])
        sent = 0
        for part in self.parts.values():
            sent += part.launch(wait=True)
            part.merge(self.mix)
        self.outer_steps = [n + 1 for n in self.outer_steps]
        return sent

    def settle(self) -> None:
        """Wait for the exchange in flight and take its outer step (not the merge): changes no
        parameter, so a checkpoint taken now equals the run that did not take one."""
        for part in self.parts.values():
            part.settle()

    # Stateful, for the checkpoint: every fragment's anchor and momentum by parameter key, the
    # syncs started (a count, or one per fragment), and with a delay the sync awaiting its merge.
    def state_dict(self) -> dict:
        self.settle()
        state = {}
        for part in self.parts.values():
            state.update(part.state_dict())
        counts = torch.tensor(self.outer_steps)
        state["outer_steps"] = counts[0] if len(self.outer_steps) == 1 else counts
        if self.sync_delay:
            state["pending"] = torch.tensor(self.pending if self.pending is not None else (-1, -1))
        return state

    def match_checkpoint(self, saved: set[str], where: str) -> bool:
        """Called by CheckpointManager.load before it loads a checkpoint (each one it tries): the
        keys this rank's anchor and momentum load from, given those the checkpoint holds under
        `diloco` (`anchor.<key>`, `momentum.<key>`). kiln before 30 Nov 2026 keyed them by position
        without pp: every layout without pp lists the parameters in the same order, so such a
        checkpoint loads by position there (not under pp: `pipeline` at construction). A tied
        model's head copy under pp (pipeline_tied.py) that the checkpoint lacks (saved without pp)
        loads the embedding's anchor and momentum, which it equals; where this rank holds the
        embedding too (ZBV's first and last stage) both load from the one entry. Saves after the
        load use the names again (`load_state_dict`)."""
        from kiln.parallel.pipeline_tied import EMBEDDING

        positional = any(re.fullmatch(r"(anchor|momentum)\.\d+", k) for k in saved)
        if positional and self.pipeline:
            raise KilnError(f"{where} holds DiLoCo's outer state keyed by position (kiln before 30 Nov 2026, saved "
                            f"without pp), which a pipeline stage cannot match: resume it once with parallel.pp=1 "
                            f"(the checkpoints it writes are keyed by name)")
        keys = [str(i) if positional else
                EMBEDDING if i in self.tied_copies and f"anchor.{name}" not in saved else name
                for i, name in enumerate(self.names)]
        if any(part.inside is not None for part in self.parts.values()) and len(set(keys)) < len(keys):
            raise KilnError(f"{where} was saved without pp: under a schedule that puts the first and last stage on "
                            f"one rank (zbv_zero_bubble, dualpipev) with dp_mode ddp/zero1 the tied embedding and "
                            f"its head copy cannot both load DiLoCo's state from it; resume it once with another "
                            f"pp_schedule or dp_mode")
        for f, part in self.parts.items():
            part.keys = [keys[i] for i in self.members[f]]
        return True

    def load_state_dict(self, state: dict) -> None:
        self.settle()  # an exchange in flight (a restore mid-run) completes on every rank, then is overwritten
        for f, part in self.parts.items():
            part.load_state_dict(state)
            part.keys = [self.names[i] for i in self.members[f]]  # saves key by name (match_checkpoint)
        self.outer_steps = [int(n) for n in state["outer_steps"].reshape(-1)]
        if self.sync_delay:
            fragment, merge_step = (int(v) for v in state["pending"])
            if not (fragment == -1 or (0 <= fragment < len(self.outer_steps) and merge_step >= 1)):
                raise KilnError(f"checkpoint DiLoCo pending sync (fragment, merge step) = ({fragment}, {merge_step}): "
                                f"expected (-1, -1) or a fragment in 0..{len(self.outer_steps) - 1} and a step >= 1")
            self.pending = (fragment, merge_step) if fragment >= 0 else None
