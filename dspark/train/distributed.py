"""`torchrun` set-up: this process's rank, world size and device, and the reductions the trainer needs.

A single process is a world of one, so the trainer runs the same code with or without `torchrun`.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dspark.errors import DsparkError
from dspark.train.config import TrainConfig


@dataclass
class Dist:
    """This process's rank and device in the training world."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we initialised the process group, so we tear it down

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (on the compute device: NCCL reduces CUDA tensors only)."""
        if self.world == 1:
            return values
        reduced = values.to(self.device, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(values.device)

    def sum_fields(self, fields: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
        """Sum named scalars over ranks in one all-reduce, as float64 0-dim tensors; the names travel with
        the values, so adding a metric cannot shift the others. Nothing waits for the device until a value
        is read."""
        device = next((v.device for v in fields.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach()
                              for v in fields.values()])
        return dict(zip(fields, self.sum(values).unbind(), strict=True))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Tear down the process group if this process created it (not when a caller already had one)."""
        if self.owns_group:
            dist.destroy_process_group()


def init_distributed(config: TrainConfig) -> Dist:
    """This process's place from torchrun's environment (a world of one without it); joins the group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if config.batch_size % world:
        raise DsparkError(f"batch_size {config.batch_size} is not a multiple of the {world} processes")
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, device, owns_group)
