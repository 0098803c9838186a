"""Data-parallel training under ``torchrun``: SFT, AWR / RECAP and QAM's learner on N processes.

``torchrun --nproc-per-node N -m vla_rl.cli train NAME ...`` (or ``vla-rl train NAME ... --nproc N``, which
launches it) starts N copies of the trainer; :func:`distributed` reads torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and joins the process group:
NCCL when the trainer runs on CUDA (each process on ``cuda:LOCAL_RANK``), gloo on CPU. A single process
(no ``WORLD_SIZE``, or 1) creates no process group and runs exactly the single-process code path.

How one step is split, so that N processes end with the weights one process would (up to the order of
floating-point reductions):

* **data** — every rank draws the *global* batch's indices from the step's generator
  (``np.random.default_rng([seed, step])``, as one process does) and keeps its contiguous slice of
  ``batch_size / N`` rows (:meth:`Shard.take`);
* **noise** — likewise every rank draws the global batch's flow noise and times from the reseeded torch
  generator (:meth:`Shard.randn`, :meth:`Shard.take`) and keeps its rows, so the rows a rank trains on
  see the very noise they see in a one-process run. (Draws the trainers leave to the model, image
  augmentation shifts and dropout, are drawn per rank for its own rows: with cameras and
  ``image_augment_pad`` a multi-process run is as good, not bit-comparable.);
* **gradients** — after ``backward`` the ranks average them with one bucketed ``all_reduce``
  (:func:`all_reduce_grads`). Why not ``DistributedDataParallel``: the trainers call loss methods
  (``flow_matching_loss``, ``QAMLearner.losses``), not ``forward``, and QAM trains a different set of
  modules from step to step (critic-only updates, the actor every ``actor_every``, the prior with
  ``train_base``), which DDP only supports with ``find_unused_parameters`` and a wrapper module. The
  explicit reduce is correct for all three trainers and leaves the single-process path untouched; what
  it gives up is DDP's overlap of communication with the backward pass, which matters for large models
  on many GPUs, not for these. Since every rank applies the same averaged gradient (clipped after the
  reduce, so on the global norm), weights, optimiser state and EMA stay identical on all ranks;
* **side effects** — checkpoints, the train state, TensorBoard, ``curve.json``, progress bars, log lines,
  evaluations and Hub pushes happen on rank 0 only (:attr:`Dist.is_main`). Resume is unchanged: every
  rank loads the same ``train_state.pt`` and replays the same global batches.

The global batch stays ``batch_size``; it must divide by N (:meth:`Dist.check_batch`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from policies.loading import pick_device

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(hours=1)
"""How long a collective waits for the slowest rank before the job fails."""
BUCKET_BYTES = 32 * 1024 * 1024
"""Gradients are averaged in flat buckets of at most this many bytes (one ``all_reduce`` each)."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank, world size, local rank and the communication device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where collective tensors live: the trainer's CUDA device under NCCL, the CPU under gloo."""

    @property
    def enabled(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes checkpoints, logs, progress bars and pushes."""
        return self.rank == 0

    def check_batch(self, batch_size: int, name: str = "batch_size") -> int:
        """Each rank's share of the global ``batch_size``; a ValueError naming the field if it does not
        divide by the world size."""
        if batch_size % self.world:
            raise ValueError(
                f"{name}: expected a multiple of the {self.world} processes (each takes {name} / "
                f"{self.world} rows of the global batch), got {batch_size}"
            )
        return batch_size // self.world

    def threads(self, requested: int) -> int:
        """Torch CPU threads for this process: ``requested``, or (0) all cores but one shared by the ranks."""
        return requested or max(1, ((os.cpu_count() or 2) - 1) // self.world)


SINGLE = Dist()


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside it."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE/RANK/LOCAL_RANK: expected integers (torchrun sets them): {e}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK/WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE, got {rank} and {world}")
    return rank, world, local


def train_device(device: str, local_rank: int, world: int) -> torch.device:
    """The trainer's device: ``pick_device(device)``, and under torchrun on CUDA ``cuda:LOCAL_RANK``."""
    dev = pick_device(device)
    if world > 1 and dev.type == "cuda":
        if dev.index is not None:
            raise ValueError(
                f"device: under torchrun each process takes cuda:LOCAL_RANK; give auto or cuda, got {device!r}"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def distributed(device: str = "auto") -> Iterator[tuple[Dist, torch.device]]:
    """``(dist, device)`` for a trainer: joins torchrun's process group for the duration when the job has
    more than one process (NCCL on CUDA, gloo on CPU), otherwise yields the single-process :data:`SINGLE`
    and ``pick_device(device)`` and touches nothing. Ranks other than 0 log warnings and errors only."""
    rank, world, local = env_world()
    dev = train_device(device, local, world)
    if world == 1:
        yield SINGLE, dev
        return
    created = not tdist.is_initialized()
    if created:
        # The other ranks wait in the next collective while rank 0 evaluates or writes a checkpoint:
        # allow that an hour (NCCL's default is 10 minutes).
        backend = "nccl" if dev.type == "cuda" else "gloo"
        tdist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    root = logging.getLogger()
    level = root.level
    if rank != 0:
        root.setLevel(max(level, logging.WARNING))
    dist = Dist(
        rank=rank, world=world, local_rank=local, device=dev if dev.type == "cuda" else torch.device("cpu")
    )
    try:
        yield dist, dev
        barrier(dist)  # rank 0's last checkpoint is on disk when any rank returns
    finally:
        root.setLevel(level)
        if created:
            tdist.destroy_process_group()


# ---------------------------------------------------------------------------- the batch split
@dataclass(frozen=True)
class Shard:
    """This rank's rows ``[lo, hi)`` of a global batch of ``global_batch`` rows.

    Everything random is drawn for the global batch (the same on every rank, the same as one process
    draws) and then sliced, so the split never changes what a row sees. With one process the slices are
    the whole tensors: the draws are exactly the single-process ones.
    """

    dist: Dist
    global_batch: int

    @property
    def size(self) -> int:
        return self.global_batch // self.dist.world

    @property
    def lo(self) -> int:
        return self.dist.rank * self.size

    @property
    def hi(self) -> int:
        return self.lo + self.size

    def take(self, x: Any) -> Any:
        """This rank's rows of a global-batch array or tensor (dimension 0)."""
        if not self.dist.enabled:
            return x
        if len(x) != self.global_batch:
            raise ValueError(f"expected {self.global_batch} rows of the global batch, got {len(x)}")
        return x[self.lo : self.hi]

    def randn(self, *tail: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``torch.randn(global_batch, *tail)`` from the global generator, this rank's rows."""
        return self.take(torch.randn(self.global_batch, *tail, device=device))

    def rand(self, *tail: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``torch.rand(global_batch, *tail)`` from the global generator, this rank's rows."""
        return self.take(torch.rand(self.global_batch, *tail, device=device))


# ---------------------------------------------------------------------------- collectives
def all_reduce_grads(params: Iterable[torch.nn.Parameter], dist: Dist) -> None:
    """Average the gradients of ``params`` over the ranks, in place (parameters without a gradient are
    skipped: every rank trains the same set of modules each step). A no-op for one process."""
    if not dist.enabled:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (size + g.numel() * g.element_size() > BUCKET_BYTES or g.dtype != bucket[0].dtype):
            _reduce_bucket(bucket, dist)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        _reduce_bucket(bucket, dist)


def _reduce_bucket(grads: list[torch.Tensor], dist: Dist) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    home = flat.device
    flat = flat.to(dist.device)  # gloo reduces CPU tensors (a no-op on CPU and under NCCL)
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    flat = flat.div_(dist.world).to(home)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_module(module: torch.nn.Module, dist: Dist) -> None:
    """Copy rank 0's parameters and buffers to every rank (start and resume begin identical)."""
    if not dist.enabled:
        return
    with torch.no_grad():
        for t in module.state_dict().values():
            broadcast_tensor(t, dist)


def mean_scalars(values: Mapping[str, float], dist: Dist) -> dict[str, float]:
    """The mean over ranks of each of ``values`` (same keys on every rank), one ``all_reduce``."""
    if not dist.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=dist.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    t /= dist.world
    out = dict(zip(keys, t.tolist(), strict=True))
    return {k: out[k] for k in values}


def broadcast_object(obj: Any, dist: Dist) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; for small control data: decisions, new episodes)."""
    if not dist.enabled:
        return obj
    if dist.device.type == "cpu":
        box = [obj if dist.is_main else None]
        tdist.broadcast_object_list(box, src=0)
        return box[0]
    payload = pickle.dumps(obj) if dist.is_main else b""  # NCCL: sizes first, then the bytes
    n = torch.tensor([len(payload)], dtype=torch.int64, device=dist.device)
    tdist.broadcast(n, src=0)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dist.device)
    if dist.is_main:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    tdist.broadcast(buf, src=0)
    return obj if dist.is_main else pickle.loads(buf.cpu().numpy().tobytes())  # rank 0's own pickle


def broadcast_tensor(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    """Rank 0's ``t`` (same shape and dtype on every rank), in place; returns it."""
    if dist.enabled:
        moved = t.to(dist.device)
        tdist.broadcast(moved, src=0)
        if moved is not t:
            t.copy_(moved)
    return t


def agree(flag: bool, dist: Dist) -> bool:
    """Rank 0's ``flag`` on every rank: decisions that depend on the clock (a wall-time budget) must be
    taken once, or the ranks would leave a loop at different steps and wait on each other forever."""
    if not dist.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dist.device)
    tdist.broadcast(t, src=0)
    return bool(t.item())


def barrier(dist: Dist) -> None:
    if dist.enabled:
        if dist.device.type == "cuda":
            tdist.barrier(device_ids=[dist.device.index or 0])
        else:
            tdist.barrier()


class NullWriter:
    """A TensorBoard ``SummaryWriter`` stand-in for ranks other than 0 (writes nothing)."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_text(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def summary_writer(dist: Dist, logdir: str, **kwargs: Any) -> Any:
    """TensorBoard's ``SummaryWriter(logdir)`` on rank 0, a :class:`NullWriter` elsewhere."""
    if not dist.is_main:
        return NullWriter()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(logdir, **kwargs)
