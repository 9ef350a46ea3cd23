"""Data tools: SentencePiece tokenizers, Megatron indexed datasets (``.bin/.idx``) and the
embedded demo corpus.

Commands (``python -m data_tools.<module>`` or the console scripts):

- ``tokenizer``   (cqk-train-tokenizer): train a SentencePiece BPE/unigram model
- ``preprocess``  (cqk-preprocess): text/JSONL/Parquet/datasets -> ``.bin/.idx``
- ``stats``       (cqk-data-stats): documents, tokens, lengths, top-k tokens
- ``demo_corpus`` (cqk-demo-corpus): corpus + tokenizer + dataset from this Python's stdlib
- ``bench``       (cqk-data-bench): preprocessing throughput, against Megatron-LM's tool
"""
