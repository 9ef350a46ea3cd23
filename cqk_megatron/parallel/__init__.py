"""How ranks split a run: the layout (``layout``, torch-free), where a full tensor lives under
it (``sharding``), rank discovery and process groups (``process_groups``), this rank's device
(``device``), the rendezvous-port rule (``ports``, torch-free), Megatron's CUDA assumptions
redirected on CPU (``cpu_bridge``) and ``cqk torchrun`` (``torchrun``). Importing this
package imports nothing: the launcher reads ``ports`` and ``layout`` without torch."""
