"""One DiLoCo fragment: a set of parameters with its own anchor, outer Nesterov momentum and
exchange across the replicas (kiln/parallel/diloco.py runs one per fragment; plain DiLoCo is one
fragment holding every parameter, Streaming DiLoCo several, synced at staggered steps).

An outer sync of a fragment is two calls, so the exchange can overlap inner steps:
  `launch`: this rank's outer gradient, delta = anchor - params (its shards, fp32), cast to the
            exchange dtype and summed over the replicas by one all-reduce (async with a delay);
  `settle`: wait for it, average (fp32) and take the outer step on the anchor (the anchor and the
            momentum only: the parameters are untouched, so settling early, as a checkpoint does
            with an exchange in flight, changes nothing);
  `merge`:  params = mix * params + (1 - mix) * anchor (mix 0: every replica restarts from it).
The exchange dtype: float32 or bfloat16, summed on the wire by one all-reduce in that dtype (as
FSDP's bf16 reduce_dtype does); or float8_e4m3fn, each block of FP8_BLOCK elements scaled by its
absolute maximum to e4m3's range (one fp32 scale per block, the quantization torchft's
quantized all-reduce and Streaming DiLoCo's low-precision outer gradients use), all-gathered
(every replica's bytes to every rank: (R - 1) x a quarter of fp32's payload, less than a ring
all-reduce of fp32 for R < 8) and summed in fp32 on each rank in replica order, so every replica
gets the same mean. The division and the outer step are fp32.

Where several ranks of a replica hold the very same parameters (`inside`: DDP / ZeRO-1 over its
dp_shard x cp ranks) each keeps, exchanges and steps 1/S of the fragment's flat anchor (padded to S
equal slices) and they all-gather the new anchor inside the replica at the merge. In that flat
vector each parameter takes its largest tp shard's size (zero-padded where its shard is smaller),
so every tp coordinate slices alike and a checkpoint's boxes of a tensor replicated over tp
coincide (zero1_shards.largest_local_numel).

torch APIs: `torch.optim.SGD(nesterov=True)` (the outer step), `all_reduce(async_op=True)`,
`all_gather_into_tensor`, `DTensor.to_local` / `from_local`; the bookkeeping is kiln's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln import torch_compat
from kiln.parallel import zero1_shards
from kiln.parallel.zero1_shards import is_sharded, largest_local_numel, param_boxes


FP8_BLOCK = 256  # elements per fp32 scale of a float8 exchange (1/64 more bytes)


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` (fp32, 1-D) as one uint8 buffer: its float8_e4m3fn bytes, zero-padded to whole blocks of
    FP8_BLOCK, then the blocks' fp32 scales (absolute maximum / e4m3's largest value)."""
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % FP8_BLOCK)).view(-1, FP8_BLOCK)
    scale = blocks.abs().amax(dim=1).div_(torch.finfo(torch.float8_e4m3fn).max)
    scale.clamp_(min=torch.finfo(torch.float32).tiny)  # an all-zero block: 0 / tiny = 0
    q = (blocks / scale[:, None]).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])


def dequantize_fp8(buffer: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 vector of `numel` elements `quantize_fp8` packed into `buffer`."""
    blocks = -(-numel // FP8_BLOCK)
    q = buffer[:blocks * FP8_BLOCK].view(torch.float8_e4m3fn).float().view(blocks, FP8_BLOCK)
    scale = buffer[blocks * FP8_BLOCK:].view(torch.float32)
    return (q * scale[:, None]).reshape(-1)[:numel]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself when it is not one)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Fragment:
    """`params` with their checkpoint `keys`; `group`: the ranks holding the same shards in the other
    replicas (None: the default group when one is initialized); `inside` as the module docstring."""

    def __init__(self, params: list[torch.Tensor], keys: list[str], outer_lr: float, outer_momentum: float,
                 group=None, inside=None, comm_dtype: torch.dtype = torch.float32):
        self.params, self.keys, self.group, self.comm_dtype = params, keys, group, comm_dtype
        self.inside = inside if inside is not None and dist.get_world_size(inside) > 1 else None
        self.replicas = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        sizes = [largest_local_numel(p) if self.inside is not None else local(p).numel() for p in params]
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        with torch.no_grad():  # fp32 whatever the parameters' dtype: the outer step adds small deltas
            if self.inside is None:
                self.anchor = [local(p).detach().clone().float() for p in params]
            else:
                zero1_shards.require("DiLoCo with parallel.dp_mode='ddp' or 'zero1' inside a replica")
                split, me = dist.get_world_size(self.inside), dist.get_rank(self.inside)
                self.slice = -(-self.numel // split)
                self.anchor = [self._flat().view(split, -1)[me].clone()]
                # per parameter: the runs of its local elements each rank's slice holds, and their boxes
                self._runs = [[(max(a, r * self.slice) - a, min(a + local(p).numel(), (r + 1) * self.slice) - a, r)
                               for r in range(split)
                               if max(a, r * self.slice) < min(a + local(p).numel(), (r + 1) * self.slice)]
                              for p, a in zip(params, self.starts)]
                self._boxes = [param_boxes(p, runs, self.inside) for p, runs in zip(params, self._runs)]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        # A zero momentum buffer steps exactly like torch's lazily created one (buf = g at the first
        # step) and exists before the first sync, so a checkpoint can load into it.
        for a in self.anchor:
            self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        self._sum = self._work = None  # the exchange in flight: its buffer and torch's Work (or None)

    def _flat(self) -> torch.Tensor:
        """This rank's parameter shards as one fp32 vector, zero-padded to S equal slices with `inside`."""
        if self.inside is None:
            return torch.cat([local(p).detach().float().reshape(-1) for p in self.params])
        padded = torch.zeros(self.slice * dist.get_world_size(self.inside), device=self.params[0].device)
        for p, start in zip(self.params, self.starts):
            values = local(p).detach().reshape(-1)
            padded[start:start + values.numel()] = values
        return padded

    @torch.no_grad()
    def launch(self, wait: bool) -> int:
        """Start the exchange of this rank's outer gradient (all of it, or with `inside` its slice);
        `wait`: block until it is summed. Returns the bytes this rank puts into the all-reduce across
        the replicas (0 with one replica)."""
        flat = self._flat()
        if self.inside is not None:
            flat = flat.view(dist.get_world_size(self.inside), -1)[dist.get_rank(self.inside)]
        delta = torch.cat([a.reshape(-1) for a in self.anchor]) - flat
        if self.comm_dtype == torch.float8_e4m3fn:  # every replica's bytes to every rank, summed there
            payload = quantize_fp8(delta)
            self._sum = payload.new_empty(self.replicas * payload.numel())
            if self.replicas > 1:
                self._work = torch_compat.all_gather_single(self._sum, payload, group=self.group, async_op=not wait)
            else:
                self._sum.copy_(payload)
            self._numel = delta.numel()
            return payload.numel() if self.replicas > 1 else 0
        self._sum = delta.to(self.comm_dtype)
        if self.replicas > 1:  # gloo has no AVG: sum, then divide (fp32, in settle)
            self._work = dist.all_reduce(self._sum, group=self.group, async_op=not wait)
            return self._sum.numel() * self._sum.element_size()
        return 0

    @property
    def in_flight(self) -> bool:
        return self._sum is not None

    @torch.no_grad()
    def settle(self) -> None:
        """Wait for the exchange in flight (if any) and take the outer step on the anchor."""
        if self._sum is None:
            return
        if self._work is not None:
            self._work.wait()
        if self.comm_dtype == torch.float8_e4m3fn:  # fp32 sum in replica order: the same on every rank
            mean = sum(dequantize_fp8(part, self._numel) for part in self._sum.chunk(self.replicas))
            mean = mean.div_(self.replicas)
        else:
            mean = self._sum.float().div_(self.replicas)
        self._sum = self._work = None
        offset = 0
        for anchor in self.anchor:  # with `inside` one slice, its padding 0 on both sides
            n = anchor.numel()
            anchor.grad = mean[offset:offset + n].view_as(anchor)
            offset += n
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def merge(self, mix: float) -> None:
        """params = mix * params + (1 - mix) * anchor (settling first where the exchange is in flight)."""
        self.settle()
        for anchor, p in zip(self._full(self.anchor), self.params):
            if mix:
                local(p).lerp_(anchor.to(p.dtype), 1.0 - mix)
            else:
                local(p).copy_(anchor)

    def _full(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter tensors (this rank's shards) of the anchor `tensors`: themselves, or with
        `inside` views of the slices all-gathered inside the replica."""
        if self.inside is None:
            return tensors
        whole = tensors[0].new_empty(self.slice * dist.get_world_size(self.inside))
        torch_compat.all_gather_single(whole, tensors[0].contiguous(), group=self.inside)
        return [whole[start:start + local(p).numel()].view_as(local(p)) for p, start in zip(self.params, self.starts)]

    def _own_runs(self, i: int, flat_slice: torch.Tensor) -> list[torch.Tensor]:
        """Views of parameter i's runs in this rank's slice `flat_slice` (of the anchor or momentum)."""
        base = dist.get_rank(self.inside) * self.slice - self.starts[i]
        return [flat_slice[a - base:b - base] for a, b, r in self._runs[i] if r == dist.get_rank(self.inside)]

    def _like_param(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` (this rank's shard) as a DTensor sharded like parameter `p`, sharing its storage, so
        DCP saves each shard once and loads into it in place."""
        if not isinstance(p, DTensor):
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    # Stateful parts, for the checkpoint: the anchor and the outer momentum (equal across replicas,
    # sharded like the parameters), as a flat dict of tensors that DCP saves and loads in place.
    # With `inside` each rank gives its slice's boxes of each parameter (zero1_shards.py, views:
    # nothing gathered), only for the parameters its slice holds elements of.
    def state_dict(self) -> dict:
        momentum = [self.outer.state[a]["momentum_buffer"] for a in self.anchor]
        if self.inside is None:
            state = {f"anchor.{k}": self._like_param(a, p) for k, a, p in zip(self.keys, self.anchor, self.params)}
            state.update({f"momentum.{k}": self._like_param(m, p) for k, m, p in zip(self.keys, momentum, self.params)})
            return state
        state = {}
        for i, k in enumerate(self.keys):
            for name, flat_slice in (("anchor", self.anchor[0]), ("momentum", momentum[0])):
                runs = self._own_runs(i, flat_slice)
                if runs:
                    state[f"{name}.{k}"] = self._boxes[i].sharded(runs)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, mine in (("anchor", self.anchor), ("momentum", [self.outer.state[a]["momentum_buffer"]
                                                                  for a in self.anchor])):
            if self.inside is None:
                for dst, k in zip(mine, self.keys):
                    dst.copy_(local(state[f"{name}.{k}"]))
                continue
            for i, k in enumerate(self.keys):  # this slice's runs: from the boxes DCP filled, or a whole tensor
                value = state.get(f"{name}.{k}")
                if value is None:
                    continue  # no element of it in this rank's slice
                own = [(a, b) for a, b, r in self._runs[i] if r == dist.get_rank(self.inside)]
                runs = (self._boxes[i].runs_of(value, f"{name}.{k}") if is_sharded(value)
                        else [local(value).reshape(-1)[a:b] for a, b in own])
                for dst, src in zip(self._own_runs(i, mine[0]), runs):
                    dst.copy_(src)
