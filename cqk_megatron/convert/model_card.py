"""The ``README.md`` model card of an exported folder."""

from __future__ import annotations

from cqk_megatron.config import RunConfig
from cqk_megatron.convert.hf_config import GPT2, native_model_type


def _human(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(int(count))


def model_card(
    config: RunConfig,
    num_parameters: int,
    tokens_trained: int | None = None,
    validation_perplexity: float | None = None,
    iteration: int | None = None,
    has_tokenizer: bool = True,
) -> str:
    m, a = config.model, config.attention
    native_type = native_model_type(config)
    native = native_type is not None
    native_class = "GPT2LMHeadModel" if native_type == GPT2 else "LlamaForCausalLM"
    load = (
        "model = AutoModelForCausalLM.from_pretrained(path)"
        if native
        else "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)"
    )
    rows = [
        ("Variant", f"`{a.variant}` (coupling `{a.coupling}`, scoring `{a.scoring}`)"),
        (
            "Architecture",
            f"`{native_class}` (native)" if native else "`CQKForCausalLM` (remote code)",
        ),
        ("Parameters", f"{_human(num_parameters)} ({num_parameters:,})"),
        (
            "Shape",
            f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
            f"({m.kv_heads} key/value), FFN {m.ffn_size}, {m.normalization}, "
            f"{'SwiGLU' if m.swiglu else 'GELU'}, "
            + (
                f"RoPE base {m.rotary_base}"
                if m.position_embedding_type == "rope"
                else "learned absolute positions"
            )
            + (", biases" if m.add_bias_linear else ""),
        ),
        ("Context length", str(m.seq_length)),
        (
            "Vocabulary",
            f"{m.vocab_size}, padded to {m.padded_vocab_size} as in training (the model "
            f"returns {m.padded_vocab_size} logits)",
        ),
        ("Tokens trained", _human(tokens_trained) if tokens_trained is not None else "not given"),
        (
            "Validation perplexity",
            f"{validation_perplexity:.3f}" if validation_perplexity is not None else "not given",
        ),
    ]
    if iteration is not None:
        rows.append(("Iteration", str(iteration)))
    if a.coupling != "none":
        rows.append(("Coupling position", f"`{a.position}`"))
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    trust = "" if native else ", trust_remote_code=True"
    tokenizer_line = (
        f"tokenizer = AutoTokenizer.from_pretrained(path{trust})\n"
        if has_tokenizer
        else "# no tokenizer was exported with this model\n"
    )
    remote_note = (
        ""
        if native
        else (
            "\nThe modeling code (`modeling_cqk.py`, `configuration_cqk.py`) and the coupling "
            "math (`coupling.py`, copied verbatim from cqk-megatron) are in this folder; they "
            "import only torch and transformers.\n"
        )
    )
    return f"""---
library_name: transformers
tags:
- cqk-megatron
- {a.variant}
---

# {config.name}

A causal language model pretrained with cqk-megatron (Megatron-Core), a stack for
Coupled Query-Key Dynamics (arXiv:2604.01683) and Differential Attention, and converted
to Hugging Face format with `cqk-convert export`; its logits equal the Megatron model's.

| | |
|---|---|
{table}
{remote_note}
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "path/to/this/folder"
{tokenizer_line}{load}
```
"""
