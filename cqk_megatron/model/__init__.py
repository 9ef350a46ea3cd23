"""The model: this rank's Megatron ``GPTModel`` (``gpt``), the layer specs of every attention
variant (``specs``), the norms (``norm``), the one parameter count (``params``) and the
Megatron attention modules (``attention/``). The plain-PyTorch math of every variant lives
in ``cqk_megatron.variants.plain_math``."""
