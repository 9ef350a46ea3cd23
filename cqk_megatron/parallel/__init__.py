"""How ranks split a run: the layout (``layout``, torch-free), where a full tensor lives under
it (``sharding``), rank discovery and process groups (``process_groups``), this rank's device
(``device``), the rendezvous-port rule (``ports``, torch-free) and ``cqk torchrun``
(``torchrun``); Megatron's CUDA assumptions are redirected on CPU by
``compat.cpu_bridge``. Importing this package imports nothing: the launcher reads ``ports``
and ``layout`` without torch."""
