"""The run's tokenizer, wrapped so that ``AutoTokenizer.from_pretrained`` loads it.

A SentencePiece ``.model`` becomes transformers' generic fast tokenizer
(``TokenizersBackend``), built from the model's own normaliser and pieces, so it encodes
as ``SentencePieceProcessor.encode`` does (BPE and unigram); no BOS/EOS is added, as
Megatron's SentencePiece tokenizer adds none. The ``.model`` file is kept beside it as
``tokenizer.model``. A Hugging Face tokenizer folder is re-saved as it is.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from cqk_megatron.convert.errors import ConversionError

SENTENCEPIECE_FILE = "tokenizer.model"


def special_token_ids(tokenizer_path: Path) -> dict[str, int | None]:
    """``bos``/``eos``/``pad``/``unk`` ids of a SentencePiece model or a tokenizer folder."""
    if tokenizer_path.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        names = ("bos", "eos", "pad", "unk")
        return {name: getattr(tokenizer, f"{name}_token_id") for name in names}
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    ids = {
        "bos": processor.bos_id(),
        "eos": processor.eos_id(),
        "pad": processor.pad_id(),
        "unk": processor.unk_id(),
    }
    return {name: (i if i >= 0 else None) for name, i in ids.items()}


def tokenizer_vocab_size(tokenizer_path: Path) -> int:
    if tokenizer_path.is_dir():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(tokenizer_path)))
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path)).get_piece_size()


def check_tokenizer(tokenizer_path: Path, model_vocab: int) -> None:
    """The tokenizer must exist, load, and fit in the model's (unpadded) vocabulary."""
    if not tokenizer_path.exists():
        raise ConversionError(
            f"tokenizer '{tokenizer_path}' does not exist; pass the SentencePiece .model the "
            "run trained with (--tokenizer), or --no-tokenizer to export weights only"
        )
    try:
        size = tokenizer_vocab_size(tokenizer_path)
    except Exception as error:  # sentencepiece raises bare RuntimeError/OSError
        raise ConversionError(
            f"tokenizer '{tokenizer_path}' is not a SentencePiece model or tokenizer folder "
            f"({error})"
        ) from error
    if size > model_vocab:
        raise ConversionError(
            f"tokenizer '{tokenizer_path}' has {size} tokens but model.vocab_size is "
            f"{model_vocab}; this is not the tokenizer the model was trained with"
        )


def save_tokenizer(tokenizer_path: Path, out_dir: Path) -> None:
    """Write the Hugging Face tokenizer files (and ``tokenizer.model``) into ``out_dir``."""
    from transformers import AutoTokenizer, TokenizersBackend

    if tokenizer_path.is_dir():
        AutoTokenizer.from_pretrained(str(tokenizer_path)).save_pretrained(str(out_dir))
        return
    with tempfile.TemporaryDirectory() as staging:
        # transformers builds the fast tokenizer from a folder holding ``tokenizer.model``
        shutil.copyfile(tokenizer_path, Path(staging) / SENTENCEPIECE_FILE)
        tokenizer = TokenizersBackend.from_pretrained(staging)
    tokenizer.save_pretrained(str(out_dir))
    shutil.copyfile(tokenizer_path, out_dir / SENTENCEPIECE_FILE)
