"""Data tools: SentencePiece tokenizers, Megatron indexed datasets (``.bin/.idx``) and the
embedded demo corpus.

Commands (``cqk data <command>``; the old console scripts and ``python -m
data_tools.<module>`` still work):

- ``tokenizer``   (cqk data tokenizer): train a SentencePiece BPE/unigram model
- ``preprocess``  (cqk data preprocess): text/JSONL/Parquet/datasets -> ``.bin/.idx``
- ``stats``       (cqk data stats): documents, tokens, lengths, top-k tokens
- ``demo-corpus`` (cqk data demo-corpus): corpus + tokenizer + dataset from this Python's stdlib
- ``bench``       (cqk data bench): preprocessing throughput, against Megatron-LM's tool
"""
