"""The step-time model: one training step of a run config on a cluster's GPUs, predicted
part by part, then tokens/s/GPU and MFU. Every assumption is in docs/performance.md.

    prediction = predict_step(training_config, load_hardware("configs/clusters/example_h100.yaml"))
    prediction.tokens_per_s_per_gpu, prediction.mfu, format_prediction(prediction)

Compute is the model's matmul FLOPs (``perf.flops``, with each variant's terms from the
registry), plus what recomputation repeats, at ``MATMUL_EFFICIENCY`` of the dense bf16
peak; the coupling's vector work is priced as HBM traffic. Every collective is listed by
kind with its bytes, dtype and link (NVLink inside a node, the network across nodes) and
timed as a ring: ``(n - 1) / n`` of the buffer for a reduce-scatter or all-gather, twice
that for an all-reduce, at ``LINK_EFFICIENCY`` of the link's one-way bandwidth, plus a
latency per call. Data-parallel collectives are the engine's (``perf.traffic``, which the
communication audit checks against the real engines): those issued inside the backward
hide behind its compute; the rest,
tensor and sequence parallel (Megatron issues them in line), pipeline sends and the tied
embeddings' sum are exposed. The pipeline bubble is ``(p - 1) / v`` micro-batch slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cqk_megatron.config import RunConfig
from cqk_megatron.model.params import (
    coupling_parameters,
    embedding_parameters,
    norm_parameters,
    scoring_parameters,
    stage_parameters,
)
from cqk_megatron.perf.flops import flops_breakdown, flops_per_token
from cqk_megatron.perf.memory import BYTES
from cqk_megatron.perf.traffic import Collective, dp_collectives, reduce_bucket_elements
from cqk_megatron.planner.hardware import ClusterHardware
from cqk_megatron.training.engines import engine_of

# The fraction of the dense bf16 peak that the model's matmuls reach, the norms, softmax
# and other unfused vector work between them included (docs/performance.md: what
# Megatron-LM's published runs imply for models of 1-2B parameters).
MATMUL_EFFICIENCY = 0.50
# NCCL's bus bandwidth on large messages over the link's one-way bandwidth.
LINK_EFFICIENCY = 0.80
# Start-up cost of one collective call, inside a node and across nodes.
LATENCY_S = {False: 10e-6, True: 30e-6}
# Bytes of HBM traffic per elementwise FLOP of the coupling (bf16 operands read, result
# written), and the backward's share: twice the forward's.
ELEMENTWISE_BYTES_PER_FLOP = 4.0
# Adam step on one fp32 master element: read gradient, master, two moments; write master,
# two moments and the bf16 parameter.
OPTIMIZER_BYTES_PER_ELEMENT = 30.0
RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "send": 1.0}


@dataclass(frozen=True)
class Transfer:
    """One kind of collective in one step of one rank."""

    part: str  # dp_gradients, dp_parameters, tp_sp, tp_embedding, tp_grad_sums, pp_p2p, ...
    kind: str  # all_reduce | reduce_scatter | all_gather | send
    elements: int  # the whole buffer of every call of the step, summed
    dtype: str
    calls: int  # per step
    group_size: int
    crosses_nodes: bool
    overlapped: bool
    seconds: float = 0.0  # all calls of the step
    exposed_s: float = 0.0

    @property
    def link(self) -> str:
        return "network" if self.crosses_nodes else "NVLink"

    @property
    def bytes_per_step(self) -> float:
        """Bytes each rank sends in the step (the ring's share)."""
        n = self.group_size
        share = 1.0 if self.kind == "send" else RING_FACTOR[self.kind] * (n - 1) / n
        return share * self.elements * BYTES[self.dtype]


@dataclass
class StepPrediction:
    config_name: str
    world_size: int
    tokens_per_step: int
    microbatches: int
    parts: dict[str, float] = field(default_factory=dict)  # seconds, they sum to step_s
    transfers: list[Transfer] = field(default_factory=list)
    model_flops_per_gpu: float = 0.0
    peak_flops: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / self.step_s / self.peak_flops

    def gpu_hours(self, steps: int) -> float:
        return self.step_s * steps * self.world_size / 3600.0


@dataclass(frozen=True)
class _Shape:
    """The parallel sizes and batch of one run, read once."""

    tp: int
    pp: int
    dp: int
    vp: int
    sp: bool
    micro_batch: int
    microbatches: int
    seq: int
    precision: str

    @classmethod
    def of(cls, config: RunConfig) -> _Shape:
        p, t = config.parallel, config.train
        tp, pp = p.tensor_parallel, p.pipeline_parallel
        dp = (p.world_size or tp * pp) // (tp * pp)
        micro = max(1, t.global_batch_size // (t.micro_batch_size * dp))
        return cls(
            tp,
            pp,
            dp,
            p.virtual_pipeline or 1,
            p.sequence_parallel and tp > 1,
            t.micro_batch_size,
            micro,
            config.model.seq_length,
            t.precision,
        )

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def _timed(transfer: Transfer, hardware: ClusterHardware) -> Transfer:
    bandwidth = hardware.link_bytes_per_s(transfer.crosses_nodes) * LINK_EFFICIENCY
    seconds = (
        transfer.bytes_per_step / bandwidth + transfer.calls * LATENCY_S[transfer.crosses_nodes]
    )
    return replace(transfer, seconds=seconds)


# ---------------------------------------------------------------------------------------
# compute
# ---------------------------------------------------------------------------------------


def hardware_flops_per_token(config: RunConfig) -> float:
    """Training matmul FLOPs per token, with what recomputation runs again: full recompute
    one more forward of the layers, selective the core attention's forward (scores and
    context), ``recompute_coupling`` the coupling's forward."""
    parts = flops_breakdown(config)
    total = flops_per_token(config, training=True)
    recompute = config.train.recompute
    if recompute == "full":
        total += parts["total"] - parts["logits"]
    elif recompute == "selective":
        total += parts["attention_scores"] + parts["attention_context"]
    if config.attention.recompute_coupling and recompute != "full":
        total += parts["coupling"]
    return total


def compute_seconds(config: RunConfig, shape: _Shape, hardware: ClusterHardware) -> float:
    """One rank's forward and backward of all its micro-batches, without waiting."""
    tokens_per_gpu = shape.micro_batch * shape.seq * shape.microbatches * shape.dp / shape.world
    matmul = hardware_flops_per_token(config) * tokens_per_gpu
    matmul_s = matmul / (hardware.peak_flops * MATMUL_EFFICIENCY)
    vector = 3.0 * flops_breakdown(config)["elementwise_not_counted"] * tokens_per_gpu
    vector_s = vector * ELEMENTWISE_BYTES_PER_FLOP / (hardware.hbm_tb_s * 1e12)
    return matmul_s + vector_s


# ---------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------


def _links(shape: _Shape, hardware: ClusterHardware) -> dict[str, bool]:
    """Whether each group crosses nodes, with Megatron's rank order (TP fastest, then DP,
    then PP): a TP group holds ``tp`` neighbouring ranks, a DP group spans ``tp x dp``."""
    node = hardware.gpus_per_node
    return {
        "tp": shape.tp > node,
        "dp": shape.tp * shape.dp > node,
        "pp": shape.world > node,
    }


def tensor_parallel_transfers(config: RunConfig, shape: _Shape, crosses: bool) -> list[Transfer]:
    """Per layer and micro-batch: 4 collectives over ``s b h`` activations in the forward
    and 4 in the backward (sequence parallel: 2 all-gathers and 2 reduce-scatters each
    way; without: 2 all-reduces each way, the same bytes), a forward again under full
    recompute; the vocabulary-parallel embedding and output layer; the sums of the
    parameters that every TP rank holds (norms, the coupling, differential's lambdas),
    once a step in fp32."""
    if shape.tp == 1:
        return []
    m = config.model
    activation = shape.micro_batch * shape.seq * m.hidden_size
    layers = m.num_layers // shape.pp
    passes = 3 if config.train.recompute == "full" else 2
    per_layer = 2 * passes
    kind = "all_gather" if shape.sp else "all_reduce"
    calls = layers * per_layer * shape.microbatches
    dtype = shape.precision
    other = "reduce_scatter" if shape.sp else "all_reduce"
    transfers = [
        Transfer("tp_sp", kind, activation * calls, dtype, calls, shape.tp, crosses, False),
        Transfer("tp_sp", other, activation * calls, dtype, calls, shape.tp, crosses, False),
    ]
    edge_calls = 3 * shape.microbatches  # embedding forward, output layer forward and backward
    edge = activation * edge_calls
    transfers.append(
        Transfer("tp_embedding", kind, edge, dtype, edge_calls, shape.tp, crosses, False)
    )
    replicated = layers * (2 * norm_parameters(config) + coupling_parameters(config))
    replicated += layers * scoring_parameters(config) + m.hidden_size
    transfers.append(
        Transfer("tp_grad_sums", "all_reduce", replicated, "fp32", 1, shape.tp, crosses, False)
    )
    return transfers


def pipeline_transfers(config: RunConfig, shape: _Shape, crosses: bool) -> list[Transfer]:
    """Activations forward and their gradients back, once per micro-batch and model chunk
    (sequence parallel sends the rank's part of the sequence); and, with tied embeddings,
    the embedding's gradient summed between the first and last stage once a step."""
    if shape.pp == 1:
        return []
    m = config.model
    elements = shape.micro_batch * shape.seq * m.hidden_size // (shape.tp if shape.sp else 1)
    calls = 2 * shape.vp * shape.microbatches
    transfers = [
        Transfer("pp_p2p", "send", elements * calls, shape.precision, calls, 2, crosses, False)
    ]
    if m.tie_embeddings:
        table = embedding_parameters(config, shape.tp)
        transfers.append(
            Transfer("tied_embeddings", "all_reduce", table, "fp32", 1, 2, crosses, False)
        )
    return transfers


def zero3_collectives(config: RunConfig, dp: int) -> list[Collective]:
    """DeepSpeed ZeRO-3, which ``perf.traffic`` leaves out: every micro-batch gathers the
    parameters for the forward and again for the backward (prefetched beside the compute)
    and reduce-scatters the fp32 gradients bucket by bucket from the backward's hooks."""
    t = config.train
    params = stage_parameters(config, config.parallel.tensor_parallel, 1, first=True, last=True)
    micro = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    buckets = -(-params // reduce_bucket_elements(params, dp))
    grad = "fp64" if t.precision == "fp64" else "fp32"
    gathers = Collective(
        "parameter gather", "all_gather", 2 * params * micro, t.precision, 2 * buckets * micro, True
    )
    reduction = Collective(
        "gradient reduction", "reduce_scatter", params * micro, grad, buckets * micro, True
    )
    return [gathers, reduction]


def engine_collectives(config: RunConfig, dp: int) -> list[Collective]:
    """The data-parallel collectives of ``config``'s engine in one step."""
    engine = engine_of(config)
    if engine.offloads(config):
        raise ValueError("the step-time model does not price train.offload_optimizer")
    if engine.partitions_parameters(config) and dp > 1:
        return zero3_collectives(config, dp)
    return dp_collectives(config, dp)


def data_parallel_transfers(
    collectives: list[Collective], shape: _Shape, crosses: bool
) -> list[Transfer]:
    part = {"gradient reduction": "dp_gradients", "parameter gather": "dp_parameters"}
    return [
        Transfer(
            part.get(c.what, "dp_" + c.what.replace(" ", "_")),
            c.kind,
            c.elements,
            c.dtype,
            c.calls,
            shape.dp,
            crosses,
            c.in_backward,
        )
        for c in collectives
    ]


def _expose(transfers: list[Transfer], hideable_s: float) -> list[Transfer]:
    """Overlapped transfers hide behind ``hideable_s`` of compute, in order; what does
    not fit, and every transfer issued after the backward, is exposed. The last bucket
    starts when the backward ends: where the engine's list has no part of a transfer
    after the backward (Megatron's), one call of it stays exposed."""
    after = {t.part for t in transfers if not t.overlapped}
    out = []
    for t in transfers:
        last_bucket = t.seconds / t.calls if t.part not in after else 0.0
        hidden = min(t.seconds - last_bucket, hideable_s) if t.overlapped else 0.0
        hideable_s -= hidden
        out.append(replace(t, exposed_s=t.seconds - hidden))
    return out


# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------


def optimizer_seconds(config: RunConfig, shape: _Shape, hardware: ClusterHardware) -> float:
    """Adam on the rank's shard of master weights, bound by HBM bandwidth."""
    params = stage_parameters(config, shape.tp, shape.pp, first=True, last=shape.pp == 1)
    sharded = engine_of(config).shards_optimizer(config)
    elements = params / (shape.dp if sharded else 1)
    return elements * OPTIMIZER_BYTES_PER_ELEMENT / (hardware.hbm_tb_s * 1e12)


def predict_step(
    config: RunConfig, hardware: ClusterHardware, collectives: list[Collective] | None = None
) -> StepPrediction:
    """One step of ``config`` (a training config: parallel sizes, engine, batch set) on
    ``hardware``. ``collectives``: the engine's data-parallel traffic (default:
    ``engine_collectives``)."""
    shape = _Shape.of(config)
    links = _links(shape, hardware)
    compute = compute_seconds(config, shape, hardware)
    per_microbatch = compute / shape.microbatches
    dp_list = engine_collectives(config, shape.dp) if collectives is None else collectives
    inline = [
        _timed(t, hardware)
        for t in tensor_parallel_transfers(config, shape, links["tp"])
        + pipeline_transfers(config, shape, links["pp"])
    ]
    dp = [_timed(t, hardware) for t in data_parallel_transfers(dp_list, shape, links["dp"])]
    # Megatron and ZeRO-1 issue the gradient buckets in the last micro-batch's backward;
    # ZeRO-2 in every one; ZeRO-3 also gathers beside the forwards.
    hideable = per_microbatch * 2.0 / 3.0
    engine = engine_of(config)
    if engine.shards_gradients(config):
        share = 1.0 if engine.partitions_parameters(config) else 2.0 / 3.0
        hideable = per_microbatch * share * shape.microbatches
    dp = _expose(dp, hideable)
    inline = _expose(inline, 0.0)
    in_line = {"tp_sp", "tp_embedding", "pp_p2p"}  # inside each micro-batch's slot
    slot_s = per_microbatch + sum(t.exposed_s for t in inline if t.part in in_line) / (
        shape.microbatches
    )
    parts = {
        "compute": compute,
        "tp_pp_in_line": sum(t.exposed_s for t in inline if t.part in in_line),
        "pipeline_bubble": (shape.pp - 1) / shape.vp * slot_s,
        "dp_exposed": sum(t.exposed_s for t in dp),
        "step_end_sums": sum(t.exposed_s for t in inline if t.part not in in_line),
        "optimizer": optimizer_seconds(config, shape, hardware),
    }
    tokens = config.train.global_batch_size * shape.seq
    return StepPrediction(
        config_name=config.name,
        world_size=shape.world,
        tokens_per_step=tokens,
        microbatches=shape.microbatches,
        parts=parts,
        transfers=inline + dp,
        model_flops_per_gpu=flops_per_token(config, training=True) * tokens / shape.world,
        peak_flops=hardware.peak_flops,
    )


def format_prediction(prediction: StepPrediction) -> str:
    """The whole breakdown (``cqk plan --explain``)."""
    p = prediction
    lines = [
        f"  step {p.step_s * 1e3:.1f} ms ({p.microbatches} micro-batches): "
        + ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in p.parts.items()),
        f"  {'collective':<15} {'kind':<15} {'dtype':>5} {'elements/step':>14} {'calls':>6} "
        f"{'link':>8} {'GB sent':>8} {'ms':>8} {'exposed':>8}",
    ]
    for t in p.transfers:
        lines.append(
            f"  {t.part:<15} {t.kind:<15} {t.dtype:>5} {t.elements:>14,} {t.calls:>6} "
            f"{t.link:>8} {t.bytes_per_step / 1e9:>8.3f} {t.seconds * 1e3:>8.1f} "
            f"{t.exposed_s * 1e3:>8.1f}"
        )
    return "\n".join(lines)
