"""The loss of one step, as both engines compute it: the model's forward on a
micro-batch, the token-mean loss under the loss mask, Megatron's schedule over the
micro-batches (no pipelining, 1F1B or interleaved 1F1B), and the mean over the
data-parallel ranks that every rank logs."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from cqk_megatron.config import RunConfig
from cqk_megatron.parallel.device import device
from cqk_megatron.training import collectives
from cqk_megatron.training.engines.protocol import Batch


def lm_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp_min(1)


def forward(model, batch: Batch) -> torch.Tensor:
    """Per-token loss on the last pipeline stage, hidden states elsewhere. ``model``: a
    ``GPTModel``, or a wrapper that passes its arguments on (Megatron's DDP, DeepSpeed's
    engine). ``batch`` comes from ``sampler.fetch``, already on the model's device."""
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def schedule_loss_sum(
    chunks: list[torch.nn.Module], micro_batches: list[Batch], config: RunConfig, forward_only: bool
) -> torch.Tensor:
    """Megatron's schedule (no pipelining, 1F1B or interleaved 1F1B, as parallel_state
    says) over the micro-batches; the sum of their losses (0 off the last pipeline stage).
    Both engines drive their steps through it."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = forward(model, batch)

        def loss_func(per_token_loss):
            loss = lm_loss(per_token_loss, batch["loss_mask"])
            return loss, {"loss": loss.detach().clone()}  # the schedule divides in place

        return output, loss_func

    # Interleaved 1F1B pulls each micro-batch once per chunk: one iterator per chunk.
    iterators = [iter(micro_batches) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=config.model.seq_length,
        micro_batch_size=config.train.micro_batch_size,
        forward_only=forward_only,
    )
    # on the device, where the losses are and the all-reduce needs it (0 off the last stage)
    zero = torch.zeros((), dtype=torch.float64, device=device())
    return sum((o["loss"].double() for o in outputs), zero)


def global_mean_loss(loss_sum: torch.Tensor, num_micro_batches: int) -> float:
    """Mean micro-batch loss over the data-parallel ranks (and from the last stage)."""
    total = loss_sum.reshape(1).clone()
    # Non-last pipeline stages hold 0; summing over the whole world counts each
    # data-parallel replica's last stage once per tensor-parallel rank.
    collectives.all_reduce(total)
    tp = ps.get_tensor_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    return total.item() / (num_micro_batches * dp * tp)
