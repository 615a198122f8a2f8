"""How a run spreads over several processes (PARALLEL=ddp or fsdp, through torchrun): the model wrapped
before it is compiled, as torchtitan's parallelize.py applies compile and FSDP to each block.

ddp   DistributedDataParallel: every rank holds the whole model; gradients are averaged over the ranks in
      buckets during backward (gradient_as_bucket_view: the gradients are the buckets, no copy).
fsdp  FSDP2's fully_shard on each block, then on the whole model: parameters, gradients and optimizer
      states are split over the ranks and gathered a block at a time.
Which additions cannot run under which mode is Utils.ladder.registry.PARALLEL_EXCLUDES.
"""
import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


def wrap(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """The module the step calls under `parallel`: DDP around `model`, or `model` itself sharded in place."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)   # the embeddings, the final norm and the tied output layer
        return model
    raise ValueError(f"parallel must be ddp or fsdp, not {parallel!r}")


@contextlib.contextmanager
def gradient_sync(module: nn.Module, parallel: str, sync: bool) -> Iterator[None]:
    """A micro-batch's backward with (sync) or without the reduction of the gradients over the ranks: a step
    of several micro-batches reduces them once, in its last backward, as nanoGPT's gradient accumulation does."""
    if parallel == "ddp" and not sync:
        with module.no_sync():
            yield
        return
    if parallel == "fsdp":
        module.set_requires_gradient_sync(sync)
    yield
