"""The training text of the bundled models: docstrings of the Python standard library, and their tokenizers.

:mod:`devtools.make_default_model` trains each bundled model on what these functions make from
the stdlib's ``.py`` files (parsed with ``ast``, nothing imported): the docstrings, their
paragraphs, extractive summary pairs, and packed rows of tokens.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sysconfig

import torch
import transformers

__all__ = [
    "BERT_SPECIALS", "SPECIALS", "pack", "paragraphs", "stdlib_docstrings", "summary_pairs", "train_tokenizer",
]

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Tests, demos and vendored tools are code-heavy or duplicated; the rest of the stdlib is the corpus.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__",
              "ensurepip"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def stdlib_docstrings(limit: int | None = None) -> list[str]:
    """Every module, class and function docstring (> 40 characters) of the stdlib's ``.py`` files.

    Files are read in sorted path order and parsed with ``ast`` (nothing is imported), so the
    result depends only on the Python version.

    Args:
        limit: stop after this many files (for smoke tests).

    Returns:
        The docstrings, cleaned by ``ast.get_docstring`` (indentation removed).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    docs: list[str] = []
    for path in files[:limit]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are deliberately invalid (bad encodings, py2 syntax)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
    return docs


def summary_pairs(docs: list[str]) -> list[tuple[str, str, int, int]]:
    """Extractive summaries: ``("summarize: " + text, its first sentence, docstring index, sentence index)``.

    For each docstring, the text from every sentence that can be a summary on to the end is one
    pair (sentence index 0: the whole docstring, the summary task itself):
    many more pairs than docstrings, and the only way to predict them all is to copy from the
    input, not to remember docstrings. A summary sentence ends with a period, has 3 to 20 words,
    lies inside one paragraph and is followed by more text.
    """
    pairs = []
    for d, doc in enumerate(docs):
        sentences = [s for para in doc.split("\n\n") for s in _SENTENCE_END.split(" ".join(para.split())) if s]
        for k, first in enumerate(sentences[:-1]):
            if first.endswith(".") and 3 <= len(first.split()) <= 20:
                pairs.append(("summarize: " + " ".join(sentences[k:]), first, d, k))
    return pairs


def paragraphs(docs: list[str]) -> list[str]:
    """The docstrings' paragraphs (split at blank lines, whitespace joined) of more than 40 characters."""
    return [" ".join(p.split()) for doc in docs for p in doc.split("\n\n") if len(p.strip()) > 40]


def train_tokenizer(docs: list[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte encodable, so no unknown tokens) trained on ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    tk.train_from_iterator(docs, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=512, clean_up_tokenization_spaces=False,
    )


def pack(docs: list[str], tok, seq: int, sep: int | None = None) -> torch.Tensor:
    """Tokenize ``docs``, join them with ``sep`` (default EOS) and cut the stream into rows of ``seq``
    tokens. (N, seq)"""
    ids: list[int] = []
    sep = tok.eos_token_id if sep is None else sep
    # The backend tokenizer directly: documents longer than model_max_length are fine here.
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [sep]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq], dtype=torch.long).view(n, seq)  # (N, seq)
