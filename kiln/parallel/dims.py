"""ParallelDims: `[parallel]` degrees validated against the world size, and the named DeviceMesh.

Everything that needs a rank, a group or a degree asks this object, never `os.environ`. On one
device every degree is 1 and no process group is created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln import torch_compat
from kiln.config import JobConfig, ParallelConfig
from kiln.errors import rank_label  # noqa: F401  (re-exported)
from kiln.errors import ConfigError
from kiln.model.transformer import ffn_hidden_size
from kiln.parallel.context_parallel import check_cp_seq_len
from kiln.parallel.pipeline_layout import check_pipeline_config

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    rank: int = 0
    local_rank: int = 0
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh when world_size > 1
    # Resolved parallel.dp_mode: ddp | zero1 | zero2 | fsdp (fsdp over dp_replicate x dp_shard is HSDP).
    dp_mode: str = "fsdp"
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)
    # Under parallel.ep > 1: ("pp", "edp", "ep", "tp") over the world, see _build_expert_mesh.
    expert_mesh: object = None
    # Expert tensor parallel degree (parallel.etp resolved): tp, or 1 where ep borrows tp too.
    etp: int | None = None
    # parallel.ep_node_ranks: the ep ranks per node of a two-level dispatch (0 or 1: one level), and
    # after build_mesh its (inter-node, intra-node) process groups for this rank, else None.
    ep_node_ranks: int = 0
    expert_node_groups: tuple | None = None
    # DiLoCo (parallel.diloco_inner_steps > 0): the dp_replicate ranks are replicas that never
    # reduce gradients with each other (kiln/parallel/diloco.py); every group below stays inside one.
    diloco: bool = False
    # parallel.reduce_dtype: what data parallelism sends gradients in (FSDP2's reduce-scatter, DDP's
    # and kiln's replicas' all-reduce, the replicated experts'); sums land in the fp32 gradients.
    reduce_dtype: str = "fp32"
    # parallel.cp_mode: ring attention or Ulysses' all-to-alls across the cp ranks (context_parallel.py)
    cp_mode: str = "ring"
    ulysses_degree: int = 0  # cp_mode ulysses: the ranks its all-to-alls span (0: all of cp)
    ulysses_rounds: int = 1  # cp_mode ulysses: the rounds its heads go in (ulysses.py)

    def __post_init__(self):
        if self.etp is None:
            self.etp = self.tp

    @property
    def grad_wire_dtype(self) -> torch.dtype | None:
        """The dtype data-parallel gradient reductions send (parallel.reduce_dtype), None for fp32."""
        return torch.bfloat16 if self.reduce_dtype == "bf16" else None

    @property
    def ep_borrows_tp(self) -> bool:
        """parallel.etp=1 under ep > 1 and tp > 1: the ep group spans tp, each tp rank routes its own
        sequence shard to whole experts (kiln/parallel/expert_parallel.py, "ep borrowing tp")."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int | None = None, rank: int | None = None,
                    local_rank: int | None = None, local_world_size: int | None = None,
                    seq_len: int | None = None) -> "ParallelDims":
        # torchrun's environment is read here, once, and nowhere else.
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1 if world_size == 1 else world_size))
        cfg.validate()
        if seq_len is not None:  # context parallel's zig-zag split of each sequence
            check_cp_seq_len(cfg.cp, seq_len)
        others = cfg.cp * cfg.tp * cfg.pp
        if world_size % others:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.cp*tp*pp={others}; "
                              f"change those degrees or the number of processes")
        dp_replicate, dp_shard, mode = cfg.dp_replicate, cfg.dp_shard, cfg.dp_mode
        if mode in ("ddp", "zero1") and cfg.diloco_inner_steps and dp_replicate > 1:
            # DiLoCo's dp_replicate replicas, DDP / ZeRO-1 over dp_shard (-1: the rest) inside each
            if dp_shard == -1 and world_size % (dp_replicate * others):
                raise ConfigError(f"world size {world_size} is not divisible by parallel.dp_replicate*cp*tp*pp="
                                  f"{dp_replicate * others} (DiLoCo's replicas); change parallel.dp_replicate "
                                  f"or the number of processes")
            dp_shard = world_size // (dp_replicate * others) if dp_shard == -1 else dp_shard
        elif mode in ("ddp", "zero1"):
            # Replication only: every data-parallel rank is a replica (dp_replicate=1 means "all of them").
            dp_shard = 1
            if dp_replicate == 1:
                dp_replicate = world_size // others
        elif dp_shard == -1:
            if world_size % (dp_replicate * others):
                raise ConfigError(f"world size {world_size} is not divisible by "
                                  f"parallel.dp_replicate*cp*tp*pp={dp_replicate * others}; change "
                                  f"parallel.dp_replicate or the number of processes")
            dp_shard = world_size // (dp_replicate * others)
        total = dp_replicate * dp_shard * others
        if total != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x "
                f"tp={cfg.tp} x pp={cfg.pp} = {total}, but the world size is {world_size}; change "
                f"parallel.dp_shard (-1 takes what is left) or the number of processes")
        if cfg.diloco_inner_steps:
            dp_replicate, dp_shard, mode = diloco_layout(cfg, mode, dp_replicate, dp_shard, world_size)
        if mode == "auto":  # what a user means by "replicate 2" alone is plain data parallelism
            mode = "ddp" if dp_replicate > 1 and dp_shard == 1 else "fsdp"
        if cfg.fsdp_reshard_to:
            check_fsdp_reshard_to(cfg, mode, dp_shard * cfg.cp)
        etp = cfg.tp if cfg.etp == -1 else cfg.etp
        if cfg.ep > 1 and cfg.tp > 1 and etp == 1:
            check_ep_borrowing_tp_layout(cfg, mode, dp_shard, seq_len)
        elif cfg.ep > 1:
            check_ep_layout(cfg.ep, mode, dp_replicate, dp_shard, cfg.cp, cfg.tp)
        return cls(dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size, rank, local_rank,
                   dp_mode=mode, local_world_size=local_world_size, etp=etp, diloco=bool(cfg.diloco_inner_steps),
                   ep_node_ranks=cfg.ep_node_ranks, reduce_dtype=cfg.reduce_dtype,
                   cp_mode=cfg.cp_mode, ulysses_degree=cfg.ulysses_degree, ulysses_rounds=cfg.ulysses_rounds)

    @classmethod
    def for_job(cls, cfg: JobConfig, **world) -> tuple["ParallelDims", str | None]:
        """The layout `kiln train` runs `cfg` with, and every check it makes of it before any work:
        `from_config` (`world`: its keywords; by default torchrun's environment), the grad_accum
        `train.global_batch_size` gives this layout (set in `cfg`, which is saved so), the model's
        and the pipeline's checks. Returns the dims and, where grad_accum changed, the line that
        says so; a refusal is a ConfigError. The trainer, `kiln plan` and scripts/layout_fuzz.py
        all check a layout here."""
        dims = cls.from_config(cfg.parallel, seq_len=cfg.data.seq_len, **world)
        accum, note = cfg.train.accumulation(dims.dp_size), None
        if accum != cfg.train.grad_accum:
            note = (f"train.grad_accum={accum} (the config had {cfg.train.grad_accum}): train.global_batch_size="
                    f"{cfg.train.global_batch_size} = train.batch_size={cfg.train.batch_size} x {dims.dp_size} "
                    f"data-parallel rank(s) x {accum}")
            cfg.train.grad_accum = accum
        dims.check_model(cfg)
        check_pipeline_config(cfg)
        return dims, note

    def check_model(self, cfg: JobConfig) -> None:
        """The layout against the model, before any work. Ring attention (cp) enters compiled
        blocks as an opaque op (kiln/parallel/ring_attention.py). Tensor parallelism splits
        attention heads, KV heads and FFN hidden units over the tp ranks, the sequence between blocks
        (sequence parallel), and computes the loss on vocab-sharded logits (train.loss='chunked': in
        chunks of tokens, kiln/parallel/functional.py parallel_chunked_lm_loss)."""
        if cfg.model.moe_experts and cfg.train.compile and not torch_compat.dynamo_traces_data_dependent_splits():
            raise ConfigError(f"train.compile=true with model.moe_experts={cfg.model.moe_experts} needs a torch "
                              f"whose dynamo compiles the per-expert loop (>= 2.10; this is {torch.__version__}); "
                              f"set train.compile=false")
        if self.ep > 1 and cfg.train.compile and not torch_compat.dynamo_traces_intermediate_hooks():
            raise ConfigError(f"train.compile=true with parallel.ep={self.ep} needs a torch whose dynamo compiles a "
                              f"gradient hook on an intermediate tensor (the experts' local weights; 2.13 does, "
                              f"this is {torch.__version__}); set train.compile=false or parallel.ep=1")
        if (cfg.model.moe_experts and cfg.train.compile and cfg.train.activation_checkpointing != "none"
                and not torch_compat.dynamo_skips_checkpoint_side_effects()):
            # a MoE block stores its aux/z losses in forward, which a compiled checkpoint refuses there
            raise ConfigError(f"train.activation_checkpointing={cfg.train.activation_checkpointing!r} with "
                              f"train.compile=true and model.moe_experts={cfg.model.moe_experts} needs a torch "
                              f"whose dynamo can skip forward side effects under checkpoint (this is "
                              f"{torch.__version__}); set train.activation_checkpointing='none' or train.compile=false")
        if self.cp > 1 and self.cp_mode == "ulysses":
            heads = cfg.model.n_heads // self.tp  # this tp rank's (divisibility by tp is checked below)
            degree = self.ulysses_degree or self.cp
            if cfg.model.n_heads % self.tp == 0 and heads % degree:
                where = f"model.n_heads={cfg.model.n_heads}" + (f" / parallel.tp={self.tp} = {heads}" if self.tp > 1 else "")
                over = f"parallel.ulysses_degree={degree}" if self.ulysses_degree else f"parallel.cp={self.cp}"
                raise ConfigError(f"parallel.cp_mode='ulysses' splits each rank's attention heads over "
                                  f"{over}, which must divide {where}; change {over.split('=')[0]} or "
                                  f"set parallel.cp_mode='ring'")
            rounds = self.ulysses_rounds
            if cfg.model.n_heads % self.tp == 0 and heads % degree == 0 and (heads // degree) % rounds:
                where = f"model.n_heads={cfg.model.n_heads}" + (f" / parallel.tp={self.tp}" if self.tp > 1 else "")
                raise ConfigError(f"parallel.ulysses_rounds={rounds} must divide the heads each rank attends "
                                  f"under Ulysses, {where} / {degree} = {heads // degree}; change "
                                  f"parallel.ulysses_rounds")
            if cfg.model.dropout > 0 and cfg.train.compile and degree == self.cp:
                # its dropout stream per head group reseeds torch's generator (ulysses._dropout_stream),
                # which a compiled block cannot trace
                raise ConfigError(f"model.dropout={cfg.model.dropout} with parallel.cp_mode='ulysses' and "
                                  f"train.compile=true is not supported; set train.compile=false, "
                                  f"model.dropout=0 or parallel.cp_mode='ring'")
        ring = self.cp > 1 and (self.cp_mode == "ring" or 0 < self.ulysses_degree < self.cp)
        if self.cp > 1 and cfg.train.compile and not torch_compat.dynamo_traces_ring_objects():
            raise ConfigError(f"train.compile=true with parallel.cp={self.cp} needs a torch whose dynamo "
                              f"compiles context-parallel attention (>= 2.9; this is {torch.__version__}); set "
                              f"train.compile=false")
        if ring and cfg.train.cuda_graphs and torch_compat.cudagraph_unsafe_tag() is None:
            # ring attention's ops must stay outside the CUDA graph (ring_attention._OP_TAGS)
            raise ConfigError(f"train.cuda_graphs=true with parallel.cp={self.cp} needs a torch with the "
                              f"cudagraph_unsafe op tag (this is {torch.__version__}); set train.cuda_graphs=false")
        if cfg.parallel.diloco_fragments > cfg.model.n_layers:
            raise ConfigError(f"parallel.diloco_fragments={cfg.parallel.diloco_fragments} deals the model's "
                              f"model.n_layers={cfg.model.n_layers} blocks into fragments, so it can be at most "
                              f"{cfg.model.n_layers}; lower it")
        tp = self.tp
        if tp == 1:
            return
        m = cfg.model
        sizes = [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads or m.n_heads),
                 ("model.ffn_hidden (the FFN hidden size)", ffn_hidden_size(m)), ("data.seq_len", cfg.data.seq_len)]
        if m.moe_experts and m.moe_hidden and self.etp > 1:  # the experts' hidden units split over tp
            sizes.append(("model.moe_hidden (the experts' hidden size)", m.moe_hidden))
        if m.moe_experts and m.moe_shared_experts:  # a dense MLP under tp
            sizes.append(("model.moe_shared_experts x the expert width (the shared experts' hidden size)",
                          m.moe_shared_experts * (m.moe_hidden or ffn_hidden_size(m))))
        for key, value in sizes:
            if value % tp:
                raise ConfigError(f"parallel.tp={tp} must divide {key}={value}; change parallel.tp or {key.split()[0]}")
        # after the sizes: a layout that cannot divide is refused for that on every release
        if (self.ep > 1 and not self.ep_borrows_tp and self.dp_mode in ("fsdp", "zero2")
                and not torch_compat.fsdp_shards_2d_dtensors()):
            raise ConfigError(f"parallel.ep={self.ep} with parallel.tp={tp} under parallel.dp_mode={self.dp_mode!r} "
                              f"shards each expert over ep and tp, which this torch's FSDP2 cannot shard again "
                              f"({torch.__version__}; 2.10 can); set parallel.etp=1 (whole experts, ep borrowing the "
                              f"tp ranks) or dp_mode='ddp'")
        if cfg.train.float8 and not torch_compat.dtensor_takes_float8_scales():
            raise ConfigError(f"train.float8=true with parallel.tp={tp} needs torch >= 2.7 (this torch's DTensor "
                              f"cannot take float8 scales of a sharded tensor: {torch.__version__}); set "
                              f"parallel.tp=1 or train.float8=false")
        # train.float8 (both recipes) runs under tp: tensor_parallel._styles picks the TP styles.
        # train.compile_scope='model' runs under tp (one graph over the blocks and the vocab-sharded head;
        # the TP embedding and the loss stay eager; tests/parallel/test_tensor_parallel_compile.py).

    def node_crossings(self, n_heads: int) -> list[str]:
        """One line for each latency-bound exchange this layout sends between nodes (the ranks of
        a node: LOCAL_WORLD_SIZE consecutive ranks, as torchrun numbers them; tp is the innermost
        mesh dimension, then cp): tensor parallelism's per-layer collectives, and Ulysses'
        all-to-alls (a degree that fits a node suggested where it divides cp and a tp rank's
        `n_heads`). Advice, not a refusal: the layout runs."""
        node, lines = self.local_world_size, []
        if node < 1 or node >= self.world_size:
            return lines
        if self.tp > node or node % self.tp:
            lines.append(f"parallel.tp={self.tp} spans nodes of {node} ranks (LOCAL_WORLD_SIZE): its "
                         f"collectives, two a layer forward and two backward, cross the link between nodes; "
                         f"a tp dividing {node} keeps them inside one")
        if self.cp > 1 and self.cp_mode == "ulysses":
            degree = self.ulysses_degree or self.cp
            span = degree * self.tp
            if span > node or node % span:
                inside = [u for u in range(2, degree) if self.cp % u == 0 and (n_heads // self.tp) % u == 0
                          and u * self.tp <= node and node % (u * self.tp) == 0]
                fix = (f"parallel.ulysses_degree={max(inside)} keeps them inside a node (the ring across)"
                       if inside else "parallel.cp_mode='ring' passes K/V between neighbours instead")
                lines.append(f"parallel.cp_mode='ulysses' over {degree} cp ranks x parallel.tp={self.tp} spans "
                             f"nodes of {node} ranks (LOCAL_WORLD_SIZE): its all-to-alls, four a layer, cross the "
                             f"link between nodes; {fix}")
        return lines

    @property
    def dp_mesh_names(self) -> tuple[str, ...]:
        """The mesh dimensions data parallelism runs over (replicate first), as built."""
        if self.mesh is None:
            return ()
        return tuple(n for n in ("dp_replicate", "dp_shard") if n in self.mesh.mesh_dim_names)

    @property
    def grad_mesh_names(self) -> tuple[str, ...]:
        """The mesh dimensions gradients are averaged over: data parallel and context parallel
        (cp ranks hold the same parameters and each has the gradient of its slice's loss). Under
        DiLoCo not dp_replicate: the replicas meet only in the outer step."""
        if self.mesh is None:
            return ()
        names = self.dp_mesh_names + (("cp",) if "cp" in self.mesh.mesh_dim_names else ())
        return tuple(n for n in names if n != "dp_replicate") if self.diloco else names

    @property
    def grad_ranks(self) -> int:
        """How many ranks share each gradient average (the size of grad_mesh_names' mesh; 1: none)."""
        return (self.dp_shard if self.diloco else self.dp_size) * self.cp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        names = self.dp_mesh_names
        if not names:  # no data-parallel dimension (tp, cp or pp alone): every rank sees the same batch
            return 0
        return self.mesh[names]._flatten().get_local_rank() if len(names) > 1 \
            else self.mesh[names[0]].get_local_rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def build_mesh(self, device_type: str, init_timeout_s: float | None = None) -> None:
        """Join the process group (unless joined) and build the mesh. init_timeout_s bounds the
        world group's collectives and its store (kiln/parallel/timeouts.py sets every other group);
        None: torch's default."""
        if self.world_size == 1:
            return
        import datetime

        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            timeout = {} if init_timeout_s is None else {"timeout": datetime.timedelta(seconds=init_timeout_s)}
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if restart is None:
                dist.init_process_group(backend=backend, **timeout)
            else:
                # torchrun's agent hands every attempt the same TCPStore (static and c10d rendezvous
                # both share theirs with the workers) with no per-attempt prefix, so restarted workers
                # would read the killed attempt's process-group keys (gloo: its listening addresses,
                # "connection refused"; nccl: its unique id) and fail or hang. Each attempt gets its
                # own key space; the store itself comes from torch's env:// rendezvous.
                store, rank, world = next(dist.rendezvous("env://"))
                dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                        store=dist.PrefixStore(f"kiln/attempt-{restart}", store), **timeout)
        dims = [(n, getattr(self, n)) for n in MESH_ORDER if getattr(self, n) > 1]
        if not dims:
            dims = [("dp_shard", 1)]
        self.mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))
        if device_type == "cpu":  # every rank here, before any FSDP asks gloo to average (torch_compat)
            torch_compat.gloo_reduce_scatter_averages()
        if self.ep > 1:
            self.expert_mesh = self._build_expert_mesh(device_type)

    def _build_expert_mesh(self, device_type: str):
        """Expert parallelism (kiln/parallel/expert_parallel.py) borrows ep from the data-parallel
        ranks and all of cp, torchtitan's layout: within each pipeline stage and tp coordinate the
        ranks are laid out (dp_replicate, dp_shard, cp) (ddp: (replicas, cp)), and consecutive
        groups of `ep` of them split the experts ("ep" = torchtitan's dp_shard_in_ep x cp; never
        across an HSDP replica, as ep divides dp_shard * cp). The dp_size * cp / ep ranks at the
        same place in every group hold the same experts ("edp" = dp_replicate x dp_shard_mod_ep).
        The mesh is ("pp", "edp", "ep", "tp"), pp and tp only where > 1, so every pipeline stage's
        MoE layers exchange tokens among that stage's own ranks, and each tp coordinate among its
        own (under tp each expert's hidden units are sharded over "tp": expert tensor parallel)."""
        if self.ep_borrows_tp:
            return self._build_expert_mesh_borrowing_tp(device_type)
        shape = [("pp", self.pp), *self._expert_replicas(self.dp_size * self.cp // self.ep), ("ep", self.ep),
                 ("tp", self.tp)]
        return self._expert_mesh_of(shape, device_type)

    def _expert_mesh_of(self, shape: list[tuple[str, int]], device_type: str):
        """The expert mesh of these (name, degree) dimensions ("edp" and "ep" kept at 1), and for a
        two-level dispatch (1 < ep_node_ranks < ep) `expert_node_groups`: the same ranks with "ep"
        split into ("ep_node", "ep_local") = (nodes, ep ranks per node), built on every rank alike."""
        from torch.distributed.device_mesh import DeviceMesh

        shape = [(n, d) for n, d in shape if d > 1 or n in ("edp", "ep")]
        ranks = torch.arange(self.world_size).view(*(d for _, d in shape))
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(n for n, _ in shape))
        local = self.ep_node_ranks
        if 1 < local < self.ep:
            split = [x for n, d in shape for x in ([("ep_node", d // local), ("ep_local", local)] if n == "ep"
                                                   else [(n, d)])]
            nodes = DeviceMesh(device_type, ranks.view(*(d for _, d in split)),
                               mesh_dim_names=tuple(n for n, _ in split))
            self.expert_node_groups = (nodes["ep_node"].get_group(), nodes["ep_local"].get_group())
        return mesh

    def _expert_replicas(self, edp: int) -> list[tuple[str, int]]:
        """The "edp" dimension of the expert mesh; under DiLoCo split as ("dp_replicate", "edp"), the
        replicas outermost, so the experts' FSDP and gradient sums ("edp") stay inside a replica
        (diloco_layout checks that ep does) and the outer step pairs equal expert shards."""
        if not self.diloco:
            return [("edp", edp)]
        return [("dp_replicate", self.dp_replicate), ("edp", edp // self.dp_replicate)]

    def _build_expert_mesh_borrowing_tp(self, device_type: str):
        """parallel.etp=1 (torchtitan's etp = 1): ep borrows cp and tp as well. cp and tp are the
        innermost mesh dimensions, so within each pipeline stage the ranks are laid out
        (dp_replicate, dp_shard, cp, tp), and consecutive groups of `ep` of them (dp_shard_in_ep x cp
        x tp; ep is a multiple of cp * tp and divides dp_shard * cp * tp, so a group never crosses an
        HSDP replica) split the experts. The ranks at the same place in every group hold the same
        experts: "edp" = dp_replicate x dp_shard * cp * tp / ep. The mesh is ("pp", "edp", "ep"), pp
        only where > 1; there is no "tp" dimension: the experts are whole."""
        shape = [("pp", self.pp), *self._expert_replicas(self.dp_size * self.cp * self.tp // self.ep), ("ep", self.ep)]
        return self._expert_mesh_of(shape, device_type)


def diloco_layout(cfg: ParallelConfig, mode: str, dp_replicate: int, dp_shard: int,
                  world_size: int) -> tuple[int, int, str]:
    """DiLoCo's replicas are the dp_replicate ranks (kiln/parallel/diloco.py); a replica is any
    kiln layout of the rest (pp, cp, tp, ep). dp_mode auto, or ddp/zero1 with dp_replicate 1: every
    data-parallel rank is a replica (dp_replicate = all of them; cp ranks inside one replicate the
    model, DDP over cp). ddp/zero1 with dp_replicate R > 1: R replicas, DDP or ZeRO-1 over the
    other data-parallel ranks inside each (here dp_shard: ranks that replicate the model and split
    the batch, ZeRO-1 its optimizer state). fsdp/zero2: dp_replicate replicas, FSDP2 over dp_shard
    (x cp) inside each. Expert parallelism is carved out of a replica's own ranks (dp_shard x cp,
    and tp with etp=1), never across two."""
    if mode == "auto" or (mode in ("ddp", "zero1") and dp_shard == 1):
        dp_replicate, dp_shard, mode = dp_replicate * dp_shard, 1, "ddp" if mode == "auto" else mode
    elif world_size > 1 and dp_replicate == 1:
        raise ConfigError(f"parallel.diloco_inner_steps={cfg.diloco_inner_steps} with parallel.dp_mode="
                          f"{mode!r} takes its replicas from parallel.dp_replicate, which is 1 here (one "
                          f"replica); set parallel.dp_replicate to the number of replicas")
    borrows_tp = cfg.tp > 1 and cfg.etp == 1
    inside, names = dp_shard * cfg.cp * (cfg.tp if borrows_tp else 1), "dp_shard x cp" + (" x tp" if borrows_tp else "")
    if cfg.ep > 1 and inside % cfg.ep:
        raise ConfigError(f"parallel.ep={cfg.ep} with parallel.diloco_inner_steps={cfg.diloco_inner_steps} must "
                          f"divide a replica's {names} = {inside} (dp_mode={mode!r}): expert parallelism runs "
                          f"inside a replica, never across replicas; use dp_mode='fsdp' with dp_shard a multiple "
                          f"of ep, or change parallel.ep")
    return dp_replicate, dp_shard, mode


def check_fsdp_reshard_to(cfg: ParallelConfig, mode: str, shard_ranks: int) -> None:
    """parallel.fsdp_reshard_to = k (FSDP2's reshard_after_forward=k): fsdp only, k a divisor of the
    ranks FSDP shards over (dp_shard x cp), at least 2, not under the zero-bubble schedules (which
    keep every stage's parameters gathered until backward anyway), and only where FSDP's mesh is
    every rank (not with tp, pp or DiLoCo replicas: see below)."""
    from kiln.parallel.pipeline_layout import ZERO_BUBBLE

    k = cfg.fsdp_reshard_to
    if mode != "fsdp":
        raise ConfigError(f"parallel.fsdp_reshard_to={k} reshards FSDP's parameters after forward, which "
                          f"parallel.dp_mode={mode!r} does not; set parallel.dp_mode='fsdp' or "
                          f"parallel.fsdp_reshard_to=0")
    if k < 2 or shard_ranks % k:
        raise ConfigError(f"parallel.fsdp_reshard_to={k} must divide dp_shard x cp = {shard_ranks} (the ranks "
                          f"FSDP shards over) and be at least 2 (parameters whole until backward: "
                          f"parallel.dp_mode='zero2'); change parallel.fsdp_reshard_to")
    if cfg.pp > 1 and cfg.pp_schedule in ZERO_BUBBLE:
        raise ConfigError(f"parallel.fsdp_reshard_to={k} has no effect with parallel.pp_schedule="
                          f"{cfg.pp_schedule!r} (it keeps each stage's parameters gathered until backward); "
                          f"set parallel.fsdp_reshard_to=0")
    # FSDP2 creates the groups it reshards over with new_group over its own mesh's ranks only, and
    # new_group needs every rank to create the same groups in the same order: where FSDP's mesh is
    # not every rank (one per tp coordinate, pp stage or DiLoCo replica) the ranks hang there
    # (seen on 8 gloo ranks, dp 4 x tp 2, torch 2.13).
    split = [f"parallel.{name}={value}" for name, value in (("tp", cfg.tp), ("pp", cfg.pp)) if value > 1]
    if cfg.diloco_inner_steps and cfg.dp_replicate > 1:
        split.append(f"parallel.diloco_inner_steps={cfg.diloco_inner_steps} with dp_replicate={cfg.dp_replicate}")
    if split:
        raise ConfigError(f"parallel.fsdp_reshard_to={k} with {' and '.join(split)} is not supported: torch's FSDP2 "
                          f"creates its resharding groups among the ranks of one FSDP mesh, which is then not "
                          f"every rank (creating a group needs every rank: it would hang); set "
                          f"parallel.fsdp_reshard_to=0")


def check_ep_borrowing_tp_layout(cfg: ParallelConfig, mode: str, dp_shard: int, seq_len: int | None = None) -> None:
    """parallel.etp=1 with ep > 1 and tp > 1: the ep group spans dp_shard_in_ep x cp x tp
    (torchtitan's rule: cp * tp divides ep, ep divides dp_shard * cp * tp), the experts are whole and
    FSDP-sharded over the rest (fsdp/zero2, HSDP included; not ddp/zero1). With cp > 1 each rank routes the tp slice of its zig-zag half of every
    sequence (kiln/model/moe.py `_cp_sp_positions`); routing counts equal slices, so every rank's
    share of a sequence (seq_len / (cp * tp) tokens) must be whole."""
    ep, tp, cp = cfg.ep, cfg.tp, cfg.cp
    if mode not in ("fsdp", "zero2"):
        raise ConfigError(f"parallel.etp=1 with parallel.ep={ep} and parallel.tp={tp} needs parallel.dp_mode="
                          f"'fsdp' or 'zero2', not {mode!r}; change parallel.dp_mode")
    borrowed = f"parallel.tp={tp}" if cp == 1 else f"parallel.cp x tp = {cp} x {tp}"
    if ep % (cp * tp):
        raise ConfigError(f"parallel.ep={ep} must be a multiple of {borrowed} with parallel.etp=1 (ep "
                          f"borrows all of {'tp' if cp == 1 else 'cp and tp'}, as in torchtitan); change "
                          f"parallel.ep or set parallel.etp={tp}")
    if dp_shard * cp * tp % ep:
        where = f"dp_shard x tp = {dp_shard} x {tp}" if cp == 1 else f"dp_shard x cp x tp = {dp_shard} x {cp} x {tp}"
        raise ConfigError(f"parallel.ep={ep} must divide {where} with parallel.etp=1 (ep is carved out of "
                          f"dp_shard{' and tp' if cp == 1 else ', cp and tp'}); change parallel.ep or the "
                          f"number of processes")
    if seq_len is not None and seq_len % (cp * tp):
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by parallel.cp x tp = {cp} x {tp} (with "
                          f"parallel.etp=1 each rank routes an equal slice of every sequence); change data.seq_len")


def check_ep_layout(ep: int, mode: str, dp_replicate: int, dp_shard: int, cp: int, tp: int) -> None:
    """What `kiln train` runs expert parallelism with (kiln/parallel/expert_parallel.py): ep carved
    out of the data-parallel ranks of each pipeline stage and all of cp (torchtitan's rule: cp
    divides ep, ep divides dp_shard * cp), dp_shard under fsdp/zero2 (dense parameters stay FSDP
    over dp_shard x cp, the experts FSDP over the rest) or the replicas under ddp/zero1 (experts
    replicated; zero1 shards the dense parameters' optimizer state only, data_parallel.py
    `Zero1Optimizer`). With tp > 1 each expert is also sharded on its hidden units
    over tp (expert tensor parallel, etp = tp: ep never borrows tp), under any dp_mode: under
    ddp/zero1 the dense tp shards are kiln's replicas' (data_parallel.OverlappedReplicas), the
    experts' gradients summed over "edp" by expert_parallel.py as without tp. Under DiLoCo
    ep comes from inside a replica (diloco_layout), the expert mesh keeps the replicas apart."""
    if ep % cp:
        raise ConfigError(f"parallel.ep={ep} must be a multiple of parallel.cp={cp} (expert parallelism borrows "
                          f"all of cp, as in torchtitan); change parallel.ep or parallel.cp")
    # ddp/zero1: the replicas (dp_shard 1), or under DiLoCo with DDP inside a replica its dp_shard ranks
    name, size = ("dp_replicate", dp_replicate) if mode in ("ddp", "zero1") and dp_shard == 1 else ("dp_shard", dp_shard)
    if size * cp % ep:
        where = f"{name}={size}" if cp == 1 else f"{name} x cp = {size} x {cp}"
        other = []  # layouts of the same ranks where ep fits
        if mode in ("fsdp", "zero2") and dp_replicate * cp % ep == 0 and dp_shard == 1:
            other.append("parallel.dp_mode='ddp' (ep from the replicas)")
        if mode in ("fsdp", "zero2") and tp > 1 and ep % (cp * tp) == 0 and dp_shard * cp * tp % ep == 0:
            other.append("parallel.etp=1 (ep borrows tp)")
        raise ConfigError(f"parallel.ep={ep} must divide {where} (ep is carved out of {name}"
                          f"{' and cp' if cp > 1 else ''} under dp_mode={mode!r}); change parallel.ep or the "
                          f"number of processes{''.join(f', or set {o}' for o in other)}")


def pick_device(name: str, dims: ParallelDims, device_count: int | None = None) -> torch.device:
    """The device of this rank. `cuda` / `auto` give local rank i the GPU `cuda:i`; more processes
    on a node than GPUs is a configuration error, not a CUDA crash (train.device=cpu runs them all
    on CPU with gloo). `device_count` is for tests; by default torch's count of visible GPUs."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if device_count is None else device_count
        if count == 0:
            raise ConfigError(f"train.device={name!r} but no CUDA device is available")
        if name == "cuda":
            if dims.local_world_size > count or dims.local_rank >= count:
                raise ConfigError(
                    f"{dims.local_world_size} processes on this node but {count} visible GPU(s): launch "
                    f"at most {count} per node (torchrun --nproc-per-node={count}) or set train.device=cpu")
            name = f"cuda:{dims.local_rank}"
        elif dims.world_size > 1:
            raise ConfigError(f"train.device={name!r} names one GPU for all {dims.world_size} processes; "
                              f"use train.device=cuda (one GPU per local rank) or auto")
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is not None and device.index >= count:
            raise ConfigError(f"train.device={name!r} but only {count} GPU(s) are visible")
        torch.cuda.set_device(device)
    return device
