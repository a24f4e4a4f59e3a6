"""Evaluation and training text: documents, a stable held-out split, and fixed-length token blocks.

Sources of text (``RunSpec.data``):

- ``"embedded"``: the standard library's ``pydoc_data.topics`` (the text behind ``help('TOPIC')``; 79 topics and about
  465k characters on Python 3.11, docs/architecture.md §6). One document per topic, ``doc_id`` = the topic name.
- a ``.txt`` file: documents separated by one or more blank lines; ``doc_id`` = ``"<file name>:<index>"`` (0-based).
- a ``.jsonl`` file: one JSON object a line with ``"text"`` (required, a non-empty string) and ``"id"`` (optional,
  a string or an integer; default ``"<file name>:<line number>"``). Blank lines are skipped.

The held-out split (cases E2 and E3 of ``shared/cases/eval.md``) is a pure function of each document's id, so the same
documents give the same split in every process and for every seed; no training document has the content of a held-out one.

This module needs neither torch nor transformers: a tokenizer is passed in by the caller.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.bounds import InputFileError, read_input_text, special_file_kind
from core.errors import DataError, SpecError

EMBEDDED = "embedded"

#: The longest document gpuaccept takes: a tokenizer holds a document's whole encoding at once (one 32 MB line made a
#: child process use 5.6 GB), so a longer one is refused before anything runs, naming it.
MAX_DOCUMENT_CHARS = 4_000_000

#: The largest data file gpuaccept reads (512 MiB): each process that trains or evaluates holds the whole text, and a
#: run trains for a few steps; a larger file is refused before it is read, naming the cap (a sample of it serves).
MAX_DATA_FILE = 512 * 2**20

#: How :func:`split_documents` decides, in words (written to the record).
SPLIT_METHOD = "held-out iff int(sha256('heldout:' + doc_id)[:16], 16) / 2**64 < heldout_fraction"

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(frozen=True)
class Document:
    """One document of text.

    Attributes:
        doc_id: a stable name: the topic name, ``"<file>:<index>"`` or the ``"id"`` of a JSON line.
        text: the document's text.
    """

    doc_id: str
    text: str

    @property
    def content_hash(self) -> str:
        """sha256 hex digest of the UTF-8 bytes of :attr:`text` (what disjointness is checked by)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------------------- loading
def load_documents(data: str) -> list[Document]:
    """Load the documents named by ``RunSpec.data``.

    Args:
        data: ``"embedded"`` or the path of a ``.txt`` / ``.jsonl`` file (format in the module docstring).

    Returns:
        The documents in a fixed order: by topic name for ``"embedded"``, file order otherwise.

    Raises:
        DataError: unreadable file, a path that is not a regular file (a directory, a FIFO, a device: named, never
            opened), a file larger than :data:`MAX_DATA_FILE` (never read), text that is not UTF-8, a bad JSON line (naming its line number and what to fix), duplicate ids, an unsupported suffix,
            or no documents at all.
    """
    if data == EMBEDDED:
        from pydoc_data.topics import topics

        docs = [Document(name, topics[name]) for name in sorted(topics)]
        source = "the embedded pydoc_data.topics"
    else:
        path = Path(data)
        kind = special_file_kind(path)  # os.stat only: a FIFO opened for reading would block until a writer came
        if kind is not None:
            raise DataError(f"{data} is {kind}, not a file; give 'embedded' or a .txt / .jsonl file")
        if path.suffix not in (".txt", ".jsonl"):
            raise DataError(f"{data}: give 'embedded' or a .txt / .jsonl file")
        try:
            content = read_input_text(path, "'embedded' or a .txt / .jsonl file of UTF-8 text", MAX_DATA_FILE)
        except FileNotFoundError:
            raise DataError(f"{path}: file not found; give 'embedded' or an existing .txt / .jsonl file") from None
        except InputFileError as exc:
            size = path.stat().st_size
            if size > MAX_DATA_FILE:
                raise DataError(f"{path} is {size:,} bytes, above {MAX_DATA_FILE:,}: gpuaccept's runs "
                                "train and evaluate for a few steps and read the whole file in each process; give a "
                                "sample of it (e.g. head -n 100000 of a .jsonl file)") from None
            raise DataError(str(exc)) from None
        except OSError as exc:
            raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        if "\x00" in content:
            raise DataError(f"{path}: holds NUL bytes: a binary file, not text; give UTF-8 text")
        docs = _parse_txt(path.name, content) if path.suffix == ".txt" else _parse_jsonl(path, content)
        source = str(path)
    if not docs:
        raise DataError(f"{source} holds no documents; give a file with at least two non-empty documents")
    return docs


def _parse_txt(name: str, content: str) -> list[Document]:
    """Documents of a text file: paragraphs separated by one or more blank (or whitespace-only) lines."""
    content = content.replace("\r\n", "\n")
    parts = (part.strip("\n") for part in _BLANK_LINES.split(content))
    texts = [part for part in parts if part.strip()]
    return [Document(f"{name}:{index}", text) for index, text in enumerate(texts)]


def _parse_jsonl(path: Path, content: str) -> list[Document]:
    """Documents of a JSON-lines file; every error names the 1-based line number."""
    docs: list[Document] = []
    first_line_of: dict[str, int] = {}
    # lines end at "\n" only: str.splitlines() would also break at U+2028, U+0085 or a form feed, which JSON
    # writers leave unescaped inside strings (json.dumps with ensure_ascii=False)
    for number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg}); write one JSON object per line") from None
        except RecursionError:  # json's decoder recurses once per level of [ and {
            raise DataError(f"{where}: nested too deep to read; a line is one flat object such as "
                            '{"text": "...", "id": 1}') from None
        except ValueError:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
            raise DataError(f"{where}: an integer of more than {sys.get_int_max_str_digits():,} digits; an \"id\" "
                            "is a string or a short integer") from None
        if not isinstance(obj, dict):
            raise DataError(f'{where}: expected a JSON object such as {{"text": "..."}}, got {type(obj).__name__}')
        if "text" not in obj:
            raise DataError(f'{where}: no "text" key; add "text": "<the document>"')
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f'{where}: "text" must be a non-empty string (got {text!r:.40})')
        raw_id: Any = obj.get("id", f"{path.name}:{number}")
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise DataError(f'{where}: "id" must be a string or an integer (got {raw_id!r:.40}); fix or remove it')
        doc_id = str(raw_id)
        if doc_id in first_line_of:
            raise DataError(f"{where}: id {doc_id!r} already used on line {first_line_of[doc_id]}; give each line its own id")
        first_line_of[doc_id] = number
        docs.append(Document(doc_id, text))
    return docs


def check_data(data: str, heldout_fraction: float) -> Split:
    """Read and check the spec's data before any run folder exists: the file's encoding and format, the documents,
    the longest one (:data:`MAX_DOCUMENT_CHARS`), and the held-out split (both sides non-empty). Pure Python, no
    tokenizer: a bad file is named in seconds, not inside a child process after the model loaded.

    Returns:
        the split (:func:`split_documents`).

    Raises:
        DataError: what is wrong with the data, naming the file, the line or the document.
    """
    docs = load_documents(data)
    longest = max(docs, key=lambda d: len(d.text))
    if len(longest.text) > MAX_DOCUMENT_CHARS:
        raise DataError(f"document {longest.doc_id!r} has {len(longest.text):,} characters, above "
                        f"{MAX_DOCUMENT_CHARS:,}: a tokenizer holds a document's whole encoding at once; split it into "
                        "documents of at most that size")
    return split_documents(docs, heldout_fraction)


# ---------------------------------------------------------------------------------------------------------- split
@dataclass(frozen=True)
class Split:
    """A held-out split and the evidence for the record.

    Attributes:
        train: training documents (input order), duplicates of held-out content removed.
        heldout: held-out documents (input order).
        method: how a document is assigned (:data:`SPLIT_METHOD`).
        disjoint_check: how disjointness was checked, in words, with the number of dropped documents.
        dropped_duplicates: training documents dropped because their content hash equals a held-out document's.
        train_hash: :func:`docs_hash` of :attr:`train`.
        heldout_hash: :func:`docs_hash` of :attr:`heldout`.
    """

    train: tuple[Document, ...]
    heldout: tuple[Document, ...]
    method: str
    disjoint_check: str
    dropped_duplicates: int
    train_hash: str
    heldout_hash: str


def heldout_score(doc_id: str) -> float:
    """A number in [0, 1) fixed by ``doc_id`` alone: the first 64 bits of sha256(``"heldout:" + doc_id``) over 2**64.

    Unlike Python's ``hash()`` (salted per process, case E2), this is the same in every process and on every machine.
    """
    digest = hashlib.sha256(("heldout:" + doc_id).encode("utf-8")).hexdigest()
    return int(digest[:16], 16) / 2**64


def docs_hash(docs: Iterable[Document]) -> str:
    """sha256 hex of the canonical JSON of the sorted ``[doc_id, content_hash]`` pairs (independent of order)."""
    pairs = sorted([doc.doc_id, doc.content_hash] for doc in docs)
    blob = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def split_documents(docs: Sequence[Document], heldout_fraction: float) -> Split:
    """Split documents into training and held-out sets by a hash of each document id.

    A document is held out iff :func:`heldout_score` of its id is below ``heldout_fraction``, so the split does not
    depend on the seed, the process (case E2) or the order of ``docs``, and raising the fraction only adds held-out
    documents. Then every training document whose content hash equals a held-out document's is dropped (case E3).

    Args:
        docs: the documents (ids should be unique).
        heldout_fraction: expected fraction of documents held out, in (0, 1).

    Raises:
        SpecError: ``heldout_fraction`` outside (0, 1).
        DataError: either side is empty.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise SpecError("heldout_fraction", f"must be between 0 and 1, exclusive (got {heldout_fraction})")
    heldout = tuple(doc for doc in docs if heldout_score(doc.doc_id) < heldout_fraction)
    candidates = [doc for doc in docs if heldout_score(doc.doc_id) >= heldout_fraction]
    heldout_contents = {doc.content_hash for doc in heldout}
    train = tuple(doc for doc in candidates if doc.content_hash not in heldout_contents)
    dropped = len(candidates) - len(train)
    if not heldout:
        raise DataError(
            f"no document of {len(docs)} was held out at heldout_fraction {heldout_fraction}; "
            "raise heldout_fraction or give more documents"
        )
    if not train:
        extra = f" ({dropped} dropped as copies of held-out documents)" if dropped else ""
        raise DataError(
            f"no training document is left of {len(docs)}{extra} at heldout_fraction {heldout_fraction}; "
            "lower heldout_fraction or give more (distinct) documents"
        )
    return Split(
        train=train,
        heldout=heldout,
        method=SPLIT_METHOD,
        disjoint_check=(
            f"by sha256 of content: {dropped} train document(s) equal to a held-out one were dropped; "
            "no train content hash is in the held-out split"
        ),
        dropped_duplicates=dropped,
        train_hash=docs_hash(train),
        heldout_hash=docs_hash(heldout),
    )


# ---------------------------------------------------------------------------------------------------------- blocks
def make_blocks(docs: Sequence[Document], tokenizer: Any, seq_len: int, max_blocks: int | None = None) -> list[dict]:
    """Cut documents into blocks of ``seq_len`` tokens for a causal LM.

    Each document is tokenized without special tokens (``tokenizer(text, add_special_tokens=False)["input_ids"]``); the
    documents are concatenated in order with ``tokenizer.eos_token_id`` between consecutive documents and the stream is
    cut into blocks of ``seq_len`` tokens. The last, partial block is padded on the right with ``tokenizer.pad_token_id``
    (the eos id when the tokenizer has none) and ``attention_mask`` 0 on the padding, so padding is told apart by position,
    never by token id (case E4).

    Args:
        docs: documents, in the order they are concatenated.
        tokenizer: a Hugging Face tokenizer or anything with the same call and ``eos_token_id`` / ``pad_token_id``.
        seq_len: tokens per block (at least 2: one input and one target).
        max_blocks: keep only the first ``max_blocks`` blocks; ``None`` keeps all.

    Returns:
        ``[{"sample_id": index, "input_ids": [...], "attention_mask": [...]}, ...]``, each list ``seq_len`` long.

    Raises:
        DataError: the tokenizer has no eos token, or the documents give no tokens.
    """
    if seq_len < 2:
        raise SpecError("seq_len", f"must be at least 2 tokens (got {seq_len})")
    if max_blocks is not None and max_blocks < 1:
        raise SpecError("eval_max_blocks", f"must be at least 1 (got {max_blocks})")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos_token_id, which separates documents; use a tokenizer that defines one")
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = eos if pad is None else pad
    limit = None if max_blocks is None else max_blocks * seq_len  # tokens needed; stop tokenizing after that

    stream: list[int] = []
    for index, doc in enumerate(docs):
        if limit is not None and len(stream) >= limit:
            break
        if index:
            stream.append(int(eos))
        stream.extend(int(t) for t in tokenizer(doc.text, add_special_tokens=False)["input_ids"])
    if not stream:
        raise DataError("the documents give no tokens; give non-empty text")
    if limit is not None:
        stream = stream[:limit]

    blocks = []
    for sample_id, start in enumerate(range(0, len(stream), seq_len)):
        ids = stream[start : start + seq_len]
        real = len(ids)
        blocks.append(
            {
                "sample_id": sample_id,
                "input_ids": ids + [int(pad)] * (seq_len - real),
                "attention_mask": [1] * real + [0] * (seq_len - real),
            }
        )
    return blocks
