"""The ``README.md`` model card of an exported folder: the Hub's metadata block (library,
license, datasets, base model, tags: the run config's ``card`` section), a table of facts
and how to load the model."""

from __future__ import annotations

import yaml

from cqk_megatron.config import ModelConfig, RunConfig
from cqk_megatron.convert.hf_config import GPT2, native_model_type

INTRO = """A causal language model pretrained with cqk-megatron (Megatron-Core), a stack for
Coupled Query-Key Dynamics (arXiv:2604.01683) and Differential Attention, and converted
to Hugging Face format with `cqk convert export`; its logits equal the Megatron model's."""

REMOTE_CODE_NOTE = """
The modeling code (`modeling_cqk.py`, `configuration_cqk.py`) and the variants' math
(`coupling.py`, a verbatim copy of cqk-megatron's `variants/plain_math.py`) are in this
folder; they import only torch and transformers.
"""


def _human(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(int(count))


def metadata(config: RunConfig) -> str:
    """The card's YAML metadata block (what the Hub reads), without the ``---`` lines."""
    card = config.card
    fields = {"library_name": "transformers", "license": card.license}
    fields |= {"datasets": list(card.datasets) or None, "base_model": card.base_model}
    fields["tags"] = ["cqk-megatron", config.attention.variant]
    return yaml.safe_dump({k: v for k, v in fields.items() if v}, sort_keys=False)


def _shape(m: ModelConfig) -> str:
    positions = (
        f"RoPE base {m.rotary_base}"
        if m.position_embedding_type == "rope"
        else "learned absolute positions"
    )
    return (
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.kv_heads} key/value), FFN {m.ffn_size}, {m.normalization}, "
        f"{'SwiGLU' if m.swiglu else 'GELU'}, {positions}"
        + (", biases" if m.add_bias_linear else "")
    )


def _rows(config: RunConfig, num_parameters: int, facts: dict) -> list[tuple[str, str]]:
    m, a = config.model, config.attention
    native_type = native_model_type(config)
    architecture = "`GPT2LMHeadModel`" if native_type == GPT2 else "`LlamaForCausalLM`"
    tokens, perplexity = facts.get("tokens_trained"), facts.get("validation_perplexity")
    rows = [
        ("Variant", f"`{a.variant}` (coupling `{a.coupling}`, scoring `{a.scoring}`)"),
        (
            "Architecture",
            f"{architecture} (native)" if native_type else "`CQKForCausalLM` (remote code)",
        ),
        ("Parameters", f"{_human(num_parameters)} ({num_parameters:,})"),
        ("Shape", _shape(m)),
        ("Context length", str(m.seq_length)),
        (
            "Vocabulary",
            f"{m.vocab_size}, padded to {m.padded_vocab_size} as in training (the model "
            f"returns {m.padded_vocab_size} logits)",
        ),
        ("Tokens trained", _human(tokens) if tokens is not None else "not given"),
        ("Validation perplexity", f"{perplexity:.3f}" if perplexity is not None else "not given"),
    ]
    if facts.get("iteration") is not None:
        rows.append(("Iteration", str(facts["iteration"])))
    if a.coupling != "none":
        rows.append(("Coupling position", f"`{a.position}`"))
    return rows


def _usage(native: bool, has_tokenizer: bool) -> str:
    trust = "" if native else ", trust_remote_code=True"
    tokenizer = (
        f"tokenizer = AutoTokenizer.from_pretrained(path{trust})"
        if has_tokenizer
        else "# no tokenizer was exported with this model"
    )
    return (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'path = "path/to/this/folder"\n{tokenizer}\n'
        f"model = AutoModelForCausalLM.from_pretrained(path{trust})\n```\n"
    )


def model_card(
    config: RunConfig,
    num_parameters: int,
    tokens_trained: int | None = None,
    validation_perplexity: float | None = None,
    iteration: int | None = None,
    has_tokenizer: bool = True,
) -> str:
    facts = {
        "tokens_trained": tokens_trained,
        "validation_perplexity": validation_perplexity,
        "iteration": iteration,
    }
    native = native_model_type(config) is not None
    table = "\n".join(f"| {key} | {value} |" for key, value in _rows(config, num_parameters, facts))
    return (
        f"---\n{metadata(config)}---\n\n# {config.name}\n\n{INTRO}\n\n| | |\n|---|---|\n"
        f"{table}\n{'' if native else REMOTE_CODE_NOTE}\n## Use\n\n" + _usage(native, has_tokenizer)
    )
