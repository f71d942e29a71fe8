"""Training and corpus sampling on several processes, with PyTorch's own engine (``torch.distributed``).

Launched by ``torchrun`` (``python -m torch.distributed.run --nproc_per_node W ...``), each process reads its
rank and the world size from the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and joins
one process group (``gloo`` on CPU, ``nccl`` for a model on CUDA).  A process started without torchrun is a
world of one: no process group, and every function here is then a no-op.

How a step is shared (data parallelism, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB; the recipes in :mod:`.train` and :mod:`.head`): every rank draws the *global* batch
from the same seeded generator, so the generator's state (the data position a checkpoint records) does not
depend on the world size; rank ``r`` then trains on its contiguous share :func:`Dist.share` of the rows.  Each rank's loss is its share of the global
batch's mean (its sums divided by the global batch's counts), so the shares add up to the one-process loss;
:func:`speculant.training.run.optimize` scales it by ``W`` because DistributedDataParallel and FSDP average
the gradients over the ranks.  Checkpoints are written by rank 0 and hold unwrapped (full) states, so a run
saved with ``W`` processes resumes with any other number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..errors import SpeculantError

TIMEOUT = timedelta(hours=12)
"""How long a collective waits for the other ranks: rank 0 alone caches the features (hours for a large corpus on
a CPU) while the others wait at a barrier, and make-data's ranks finish their prompts at different times."""


@dataclass(frozen=True)
class Dist:
    """This process' place in the job: ``rank`` in ``0..world-1``, ``local_rank`` on its machine, and the
    process group's ``backend`` (``None``: a world of one, no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes checkpoints, artefacts and logs."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world > 1

    def share(self, n: int) -> slice:
        """This rank's contiguous rows of a global batch of ``n`` rows (ranks differ by at most one row)."""
        return slice(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def barrier(self) -> None:
        """Wait for every rank (no-op for a world of one)."""
        if self.active:
            torch.distributed.barrier()

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (a detached copy; ``x`` itself for a world of one)."""
        if not self.active:
            return x.detach()
        y = x.detach().clone()
        torch.distributed.all_reduce(y)
        return y

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = Dist()
"""A world of one."""


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise SpeculantError(f"{name}={text!r} is invalid; allowed: an integer (as torchrun sets it)") from None


def from_env(device: str | torch.device = "cpu") -> Dist:
    """This process' :class:`Dist` from torchrun's environment, joining (once) the process group.

    Args:
        device: where the model trains: ``nccl`` for CUDA, else ``gloo``.
    Raises:
        SpeculantError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` not integers or the rank outside ``0..W-1``.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return SINGLE
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise SpeculantError(f"RANK={rank} is out of range; allowed: 0..{world - 1} (WORLD_SIZE={world})")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local)
        torch.distributed.init_process_group(backend, timeout=TIMEOUT)
    return Dist(rank, world, local, torch.distributed.get_backend())


def close(d: Dist) -> None:
    """Leave the process group (after a last barrier, so no rank exits while another still writes)."""
    if d.active and torch.distributed.is_initialized():
        d.barrier()
        torch.distributed.destroy_process_group()


def main_first(d: Dist, fn):
    """``fn()`` on rank 0, then on the others (which then find what rank 0 cached, e.g. the feature cache)."""
    if not d.main:
        d.barrier()
    out = fn()
    if d.main:
        d.barrier()
    return out


def wrap_ddp(module: torch.nn.Module, d: Dist, find_unused: bool = False) -> torch.nn.Module:
    """``module`` in :class:`~torch.nn.parallel.DistributedDataParallel` (rank 0's weights broadcast to all), or
    ``module`` itself for a world of one.  ``find_unused``: some parameters may get no gradient in a step."""
    if not d.active:
        return module
    from torch.nn.parallel import DistributedDataParallel
    ids = [d.local_rank] if d.backend == "nccl" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)


def wrap_fsdp(module: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """``module`` sharded by FSDP2 (:func:`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, "PyTorch FSDP",
    VLDB; one group: the parameters, their gradients and the optimizer's state are split over the ranks and
    gathered for each forward and backward; it runs on gloo, checked by tests/test_distributed_training.py), or
    ``module`` itself for a world of one.  Every rank must run the module's forward each step and every
    parameter must get a gradient on all ranks or on none (the gradients' reduce-scatter pairs them up)."""
    if not d.active:
        return module
    from torch.distributed.fsdp import fully_shard
    return fully_shard(module)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it in the same order), a plain tensor detached."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor().detach().cpu() if isinstance(t, DTensor) else t.detach().clone().cpu()


def _like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as parameter ``p``: sharded as ``p`` under FSDP (a collective), else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(p, DTensor) and full.dim():
        return distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements)
    return full.to(p.device)


def full_states(named: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (unsharded, unwrapped) values of the trainable parameters ``named`` (the optimizer's, in its order)
    and of their optimizer state, on CPU, keyed by parameter name; under FSDP every rank must call it.  A parameter
    that has had no gradient yet has no optimizer state (as in one process)."""
    state = opt.state_dict()["state"]
    model_state = {name: _full(p) for name, p in named}
    opt_state = {name: {k: _full(v) for k, v in state[i].items()} for i, (name, _) in enumerate(named) if i in state}
    return model_state, opt_state


def load_full_states(named: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer, model_state: dict,
                     opt_state: dict) -> None:
    """Load :func:`full_states`'s output (written with any world size) into the parameters ``named`` (plain, under
    DDP or sharded by FSDP) and ``opt`` (built on them, in that order).

    Raises:
        SpeculantError: a trainable parameter the checkpoint does not hold (another model or LoRA setting).
    """
    missing = [name for name, _ in named if name not in model_state]
    if missing:
        raise SpeculantError(f"checkpoint lacks trainable parameter {missing[0]!r}; allowed: a checkpoint of the "
                             "same model and LoRA setting")
    with torch.no_grad():
        for name, p in named:
            p.copy_(_like(model_state[name], p))
    state = {i: {k: _like(v, p) for k, v in opt_state[name].items()}
             for i, (name, p) in enumerate(named) if name in opt_state}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def unshard(module: torch.nn.Module) -> None:
    """Make an FSDP-sharded ``module`` plain again on this rank: each (DTensor) parameter replaced by a frozen
    plain one holding its whole value (a collective: every rank calls it); tied parameters stay tied."""
    from torch.distributed.tensor import DTensor
    done: dict[int, torch.nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not isinstance(p, DTensor):
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(p.full_tensor().detach(), requires_grad=False)
            mod._parameters[name] = done[id(p)]


def save_on_main(d: Dist, state_fn, path) -> None:
    """``torch.save(state_fn(), path)`` on rank 0 (atomically: a temporary file renamed), then a barrier so no
    rank reads an older file."""
    from pathlib import Path
    if d.main:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(state_fn(), tmp)
        tmp.replace(path)
    d.barrier()


def check_batch(name: str, value: int, d: Dist) -> None:
    """Raise :class:`SpeculantError` unless the global batch ``value`` (flag ``--name``) gives each rank a row.

    Raises:
        SpeculantError: ``value`` below the world size.
    """
    if value < d.world:
        raise SpeculantError(f"{name}={value} is smaller than the {d.world} processes; allowed: >= {d.world} "
                             "(each process trains on a share of the global batch)")
