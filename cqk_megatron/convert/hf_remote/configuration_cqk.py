"""Configuration of the CQK causal language model (exported from cqk-megatron).

A Llama-shaped decoder (pre-norm, RoPE, no biases; or GPT-2-shaped: learned absolute
positions, LayerNorm, GELU, biases in every projection) whose attention may couple each
token's (q, k) before scoring (``coupling``: a cqk-megatron coupling's name, e.g.
hamiltonian; its module class ``coupling_class``, built with ``coupling_options``) and may
score with a rule of its own (``scoring``, e.g. differential; its class ``scoring_class``,
built with ``scoring_options``). The classes are those that ``cqk_variant.py`` beside this
file names, from ``coupling.py`` (a verbatim copy of cqk-megatron's
``variants/plain_math.py``), or shipped in it.
Imports only transformers.
"""

from transformers import PretrainedConfig

COUPLING_POSITIONS = ("pre_rope", "post_rope")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
MLP_ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


class CQKConfig(PretrainedConfig):
    model_type = "cqk"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1408,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rotary_base: float = 10000.0,
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        mlp_activation: str = "swiglu",
        position_embedding_type: str = "rope",
        linear_bias: bool = False,
        initializer_range: float = 0.02,
        coupling: str = "none",
        coupling_options: dict | None = None,
        coupling_position: str = "pre_rope",
        scoring: str = "standard",
        coupling_class: str | None = None,
        coupling_source: str | None = None,
        scoring_class: str | None = None,
        scoring_options: dict | None = None,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rotary_base = rotary_base
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.mlp_activation = mlp_activation
        self.position_embedding_type = position_embedding_type
        self.linear_bias = linear_bias
        self.initializer_range = initializer_range
        self.coupling = coupling
        self.coupling_options = dict(coupling_options or {})
        self.coupling_position = coupling_position
        self.scoring = scoring
        self.coupling_class = coupling_class
        self.coupling_source = coupling_source
        self.scoring_class = scoring_class
        self.scoring_options = dict(scoring_options or {})
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        self._check()
        super().__init__(**kwargs)

    def _check(self) -> None:
        choices = {
            "coupling_position": (self.coupling_position, COUPLING_POSITIONS),
            "normalization": (self.normalization, NORMALIZATIONS),
            "mlp_activation": (self.mlp_activation, MLP_ACTIVATIONS),
            "position_embedding_type": (self.position_embedding_type, POSITION_EMBEDDINGS),
        }
        for key, (value, options) in choices.items():
            if value not in options:
                raise ValueError(f"config.json: {key}={value!r} is unknown; one of {options}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.scoring == "differential" and (
            self.num_attention_heads % 2 or self.num_key_value_heads % 2
        ):
            raise ValueError(
                "config.json: differential scoring pairs heads; num_attention_heads and "
                "num_key_value_heads must be even"
            )
