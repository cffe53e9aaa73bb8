"""Process groups: torch.distributed + Megatron parallel state, on CPU (gloo) or GPU (nccl).

A single process needs no launcher: ``init_distributed()`` creates a world of size 1
on a free local port. Under torchrun / srun the usual environment variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are used.
"""

from autocompress_nemo.distributed.state import (
    free_port,
    init_distributed,
    is_initialized,
    rank,
    teardown,
    world_size,
)

__all__ = ["free_port", "init_distributed", "is_initialized", "rank", "teardown", "world_size"]
