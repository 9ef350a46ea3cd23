"""The embedded demo corpus: the running interpreter's standard library, as documentation
(docstrings rendered like reference pages) and as source, with no download.

Builds, in ``--out`` (default ``data/demo``):

- ``corpus.jsonl``: one document per line (``text``, ``source``, ``kind``), modules in a
  fixed pseudo-random order (SHA-1 of their path), stopping at ``--max-mb``;
- ``tokenizer.model`` (+ ``.vocab``, ``.recipe.json``): SentencePiece trained on it;
- ``demo_text_document.bin/.idx`` (+ ``.meta.json``): the indexed dataset;
- ``manifest.json``: written last, with settings, sizes and SHA-256 of every file.

Re-running with the same settings finds the manifest, checks the files against it and
does nothing; a missing or half-written output (no manifest, or a file that does not
match it) is rebuilt from scratch.

    cqk data demo-corpus --out data/demo
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cqk_megatron.cli.args import add_force, add_out, new_parser
from cqk_megatron.data.errors import DataError
from cqk_megatron.data.metadata import write_json
from cqk_megatron.run.file_hash import file_sha256
from data_tools.cli import friendly_errors
from data_tools.outputs import commit_file, partial_paths
from data_tools.preprocess import preprocess
from data_tools.sources import default_workers
from data_tools.tokenizer import TokenizerRecipe, train_tokenizer

DATASET_NAME = "demo_text_document"
TOKENIZER_NAME = "tokenizer"
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# codec tables: megabytes of hex literals, not language
_EXCLUDED_TOP = {"encodings"}


@dataclass
class DemoSettings:
    max_bytes: int = 4_000_000
    vocab_size: int = 8192
    model_type: str = "bpe"
    seed: int = 1234
    stdlib: str = field(default_factory=lambda: sysconfig.get_paths()["stdlib"])
    python: str = field(default_factory=lambda: sys.version.split()[0])


@dataclass
class DemoOutputs:
    folder: Path
    skipped: bool  # everything was already there
    documents: int
    corpus_bytes: int
    tokens: int
    seconds: float

    @property
    def prefix(self) -> Path:
        return self.folder / DATASET_NAME

    @property
    def tokenizer(self) -> Path:
        return self.folder / f"{TOKENIZER_NAME}.model"


# --------------------------------------------------------------------------------------
# the corpus
# --------------------------------------------------------------------------------------


def stdlib_modules(root: Path) -> list[Path]:
    """The standard library's own ``.py`` files (no tests, no site-packages, no codec
    tables), in a fixed order that mixes packages (SHA-1 of the relative path)."""
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if set(parts[:-1]) & _EXCLUDED_DIRS or parts[0] in _EXCLUDED_TOP:
            continue
        files.append(path)
    return sorted(
        files, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()
    )


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line.strip() else "" for line in text.strip().split("\n"))


def documentation(source: str, name: str) -> str | None:
    """A reference page from the module's docstrings: the module's, then each public class
    and function (methods included) with its signature. None without docstrings."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some modules
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    sections: list[str] = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        sections.append(module_doc.strip())

    def visit(body: list[ast.stmt], qualifier: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                doc = ast.get_docstring(node)
                qualname = f"{qualifier}{node.name}"
                if isinstance(node, ast.ClassDef):
                    bases = ", ".join(ast.unparse(b) for b in node.bases)
                    header = f"class {qualname}" + (f"({bases})" if bases else "")
                else:
                    header = f"def {qualname}({ast.unparse(node.args)})"
                if doc:
                    sections.append(f"{header}\n{_indent(doc)}")
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{qualname}.")

    visit(tree.body, f"{name}.")
    if not sections:
        return None
    return f"Help on module {name}:\n\n" + "\n\n".join(sections) + "\n"


def corpus_documents(root: Path, max_bytes: int) -> Iterator[dict[str, str]]:
    """Documents in order until the next one would pass ``max_bytes`` (0: no limit)."""
    total = 0
    for path in stdlib_modules(root):
        source = path.read_text(encoding="utf-8", errors="replace")
        name = module_name(path, root)
        relative = path.relative_to(root).as_posix()
        pages = [("docs", documentation(source, name)), ("source", source)]
        for kind, text in pages:
            if not text or not text.strip():
                continue
            size = len(text.encode("utf-8"))
            if max_bytes and total + size > max_bytes:
                return
            total += size
            yield {"text": text, "source": relative, "kind": kind}


def write_corpus(path: Path, settings: DemoSettings) -> tuple[int, int]:
    root = Path(settings.stdlib)
    if not root.is_dir():
        raise DataError(f"this interpreter's standard library '{root}' is not a folder")
    documents = nbytes = 0
    with partial_paths(path) as (partial,):
        with open(partial, "w", encoding="utf-8") as out:
            for doc in corpus_documents(root, settings.max_bytes):
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                documents += 1
                nbytes += len(doc["text"].encode("utf-8"))
        if documents == 0:
            raise DataError(f"--max-mb {settings.max_bytes / 1e6} admits no module; raise it")
        commit_file(partial, path)
    return documents, nbytes


# --------------------------------------------------------------------------------------
# completeness
# --------------------------------------------------------------------------------------


MANIFEST_NAME = "manifest.json"  # what the demo built, and that it built it


def output_files(folder: Path) -> list[Path]:
    names = [
        "corpus.jsonl",
        f"{TOKENIZER_NAME}.model",
        f"{TOKENIZER_NAME}.vocab",
        f"{TOKENIZER_NAME}.recipe.json",
        f"{DATASET_NAME}.bin",
        f"{DATASET_NAME}.idx",
        f"{DATASET_NAME}.meta.json",
    ]
    return [folder / name for name in names]


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The demo's own record in ``folder`` (its settings and files), or None if there is
    none: no file of that name, or one that the demo did not write."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ours = isinstance(manifest, dict) and {"settings", "files"} <= manifest.keys()
    return manifest if ours else None


def refuse_foreign_files(folder: Path) -> None:
    """The demo replaces only what it wrote there before (its manifest says so, finished
    or still building): a corpus.jsonl, tokenizer or dataset of the user's, at an --out
    that names their data folder, stays, even with --force."""
    present = [p for p in [*output_files(folder), folder / MANIFEST_NAME] if p.exists()]
    if present and read_manifest(folder) is None:
        raise DataError(
            f"'{folder}' holds {', '.join(p.name for p in present)}, which cqk data "
            f"demo-corpus did not write (no {MANIFEST_NAME} of its own); nothing was "
            "replaced: choose another --out, or remove them yourself if they really are to go"
        )


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    manifest_file = folder / MANIFEST_NAME
    with partial_paths(manifest_file) as (partial,):
        write_json(partial, manifest)
        commit_file(partial, manifest_file)


def is_complete(folder: Path, settings: DemoSettings) -> dict[str, Any] | None:
    """The manifest if it matches ``settings`` and every file still matches it."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    if manifest.get("settings") != asdict(settings):
        return None
    recorded = manifest.get("files", {})
    for path in output_files(folder):
        entry = recorded.get(path.name)
        if entry is None or not path.is_file() or path.stat().st_size != entry["bytes"]:
            return None
        if file_sha256(path) != entry["sha256"]:
            return None
    return manifest


# --------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------


def build_demo(
    folder: str | Path,
    settings: DemoSettings | None = None,
    workers: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> DemoOutputs:
    settings = settings or DemoSettings()
    folder = Path(folder).expanduser()
    start = time.perf_counter()
    if not force:
        manifest = is_complete(folder, settings)
        if manifest is not None:
            return DemoOutputs(
                folder,
                True,
                manifest["documents"],
                manifest["corpus_bytes"],
                manifest["tokens"],
                0.0,
            )
    refuse_foreign_files(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # a manifest listing no file while rebuilding: an interrupted rebuild is never taken
    # for complete, and its files are still known to be the demo's
    _write_manifest(folder, {"settings": asdict(settings), "files": {}})
    log = (lambda message: print(message, file=sys.stderr)) if progress else (lambda m: None)
    workers = workers or default_workers()

    corpus = folder / "corpus.jsonl"
    documents, corpus_bytes = write_corpus(corpus, settings)
    log(f"demo corpus: {documents} documents, {corpus_bytes / 1e6:.2f} MB from {settings.stdlib}")

    recipe = TokenizerRecipe(
        model_type=settings.model_type,
        vocab_size=settings.vocab_size,
        seed=settings.seed,
        sample_documents=max(documents, 1),
        threads=workers,
    )
    train_tokenizer([str(corpus)], folder / TOKENIZER_NAME, recipe, overwrite=True)
    log(f"demo tokenizer: {folder / TOKENIZER_NAME}.model ({settings.vocab_size} pieces)")

    result = preprocess(
        [str(corpus)],
        folder / DATASET_NAME,
        folder / f"{TOKENIZER_NAME}.model",
        workers=workers,
        overwrite=True,
        progress=progress,
    )
    seconds = time.perf_counter() - start
    manifest = {
        "settings": asdict(settings),
        "documents": documents,
        "corpus_bytes": corpus_bytes,
        "tokens": result.tokens,
        "seconds": round(seconds, 2),
        "files": {
            p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in output_files(folder)
        },
    }
    _write_manifest(folder, manifest)
    return DemoOutputs(folder, False, documents, corpus_bytes, result.tokens, seconds)


def config_snippet(outputs: DemoOutputs, vocab_size: int) -> str:
    return (
        "data:\n"
        f"  prefixes: [{outputs.prefix}]\n"
        f"  tokenizer: {outputs.tokenizer}\n"
        "model:\n"
        f"  vocab_size: {vocab_size}\n"
    )


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    parser = new_parser("cqk data demo-corpus", __doc__.split("\n\n")[0])
    add_out(parser, "folder for all outputs", old=("--output",), default="data/demo")
    parser.add_argument("--max-mb", type=float, default=4.0, help="corpus size limit (0: all)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer pieces")
    parser.add_argument(
        "--model-type", default="bpe", choices=["bpe", "unigram"], help="tokenizer algorithm"
    )
    parser.add_argument("--seed", type=int, default=1234, help="tokenizer's sampling seed")
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="tokenizing processes"
    )
    add_force(parser, "rebuild even if complete", old=())
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if args.max_mb < 0:
        raise DataError("--max-mb must be >= 0 (0: the whole standard library)")
    settings = DemoSettings(
        max_bytes=int(args.max_mb * 1e6),
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        seed=args.seed,
    )
    outputs = build_demo(args.out, settings, args.workers, args.force, not args.quiet)
    if outputs.skipped:
        print(f"{outputs.folder}: complete (manifest matches), nothing to do")
    else:
        size = f"{outputs.corpus_bytes / 1e6:.2f} MB"
        print(
            f"{outputs.folder}: {outputs.documents} documents, {size}, "
            f"{outputs.tokens:,} tokens in {outputs.seconds:.1f} s"
        )
    print("use it with:\n" + config_snippet(outputs, settings.vocab_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
