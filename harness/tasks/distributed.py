"""This process's place in a data-parallel training: one process, or one rank under torchrun."""

from __future__ import annotations

import datetime as dt
import os

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: Collective operations wait this long (a rank may evaluate for a while before the others go on).
COLLECTIVE_TIMEOUT = dt.timedelta(hours=2)


class Distributed:
    """This process's place in a data-parallel run: from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), or a single process
    when ``WORLD_SIZE`` is unset or 1. NCCL on CUDA devices, gloo on the CPU."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.is_main = rank == 0

    @classmethod
    def from_env(cls, device=None) -> Distributed:
        """Join the process group torchrun describes (a no-op for one process). ``device``
        defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if world_size > 1 and not torch_dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            torch_dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world_size, device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` in DistributedDataParallel (gradients averaged over ranks), or as is.
        Parameters that a batch does not reach (an adaptive softmax's tail clusters when no
        target falls in them) are allowed: their gradient is zero on that rank."""
        if self.world_size == 1:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)

    def _all_reduce(self, value: float, op) -> float:
        if self.world_size == 1:
            return float(value)
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(tensor, op=op)
        return tensor.item()

    def all_reduce_mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        return self._all_reduce(value, torch_dist.ReduceOp.SUM) / self.world_size

    def all_reduce_sum(self, value: float) -> float:
        """The sum of ``value`` over the ranks."""
        return self._all_reduce(value, torch_dist.ReduceOp.SUM)

    def all_gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        torch_dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch_dist.barrier()

    def close(self) -> None:
        """Leave the process group (if this process joined one)."""
        if self.world_size > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
