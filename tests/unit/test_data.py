"""core.data: loading documents, the stable disjoint held-out split (cases E2, E3), token blocks."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from core.data import (
    SPLIT_METHOD,
    Document,
    docs_hash,
    heldout_score,
    load_documents,
    make_blocks,
    split_documents,
)
from core.errors import DataError
from tests.paths import REPO

ROOT = REPO  # the repository's top


# ---------------------------------------------------------------------------------------------------------- loading
def test_content_hash_is_sha256_of_utf8_text():
    doc = Document("a", "héllo")
    assert doc.content_hash == hashlib.sha256("héllo".encode()).hexdigest()


def test_embedded_documents_are_the_pydoc_topics_sorted_by_name():
    from pydoc_data.topics import topics

    docs = load_documents("embedded")
    assert [d.doc_id for d in docs] == sorted(topics)
    assert all(d.text == topics[d.doc_id] for d in docs)


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\nsecond line\n\n\n\nthird\n  \t\nfourth\n\n", encoding="utf-8")
    docs = load_documents(str(path))
    assert docs == [
        Document("notes.txt:0", "first line\nsecond line"),
        Document("notes.txt:1", "third"),
        Document("notes.txt:2", "fourth"),
    ]


def test_jsonl_ids_are_given_or_the_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "x", "text": "one"}\n\n{"text": "two"}\n{"id": 7, "text": "three"}\n', encoding="utf-8")
    assert load_documents(str(path)) == [Document("x", "one"), Document("d.jsonl:3", "two"), Document("7", "three")]


@pytest.mark.parametrize(
    "lines, line_number, hint",
    [
        (['{"text": "ok"}', '{"text": "ok2"}', "{not json"], 3, "JSON"),
        (['{"text": "ok"}', '{"body": "no text key"}'], 2, '"text"'),
        (['["a list"]'], 1, "object"),
        (['{"text": ""}'], 1, "non-empty"),
        (['{"id": "a", "text": "x"}', '{"id": "a", "text": "y"}'], 2, "line 1"),
    ],
)
def test_bad_jsonl_line_names_the_line_and_the_fix(tmp_path, lines, line_number, hint):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_documents(str(path))
    message = str(info.value)
    assert f"line {line_number}" in message
    assert hint in message


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("empty.txt", "\n\n  \n")])
def test_empty_file_is_a_data_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match="no documents"):
        load_documents(str(path))


def test_missing_file_and_wrong_suffix_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_documents(str(tmp_path / "absent.txt"))
    (tmp_path / "d.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"\.txt / \.jsonl"):
        load_documents(str(tmp_path / "d.csv"))


# ---------------------------------------------------------------------------------------------------------- split
_SPLIT_SCRIPT = (
    "import json; from core.data import load_documents, split_documents; "
    "s = split_documents(load_documents('embedded'), 0.2); "
    "print(json.dumps([s.heldout_hash, s.train_hash, [d.doc_id for d in s.heldout]]))"
)


def _split_in_subprocess(hash_seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _SPLIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def test_e2_split_is_identical_in_processes_with_different_hash_seeds():
    first = _split_in_subprocess("1")
    second = _split_in_subprocess("987654")
    assert first == second
    here = split_documents(load_documents("embedded"), 0.2)
    assert first[0] == here.heldout_hash and first[1] == here.train_hash


def test_e2_embedded_split_holds_out_about_the_fraction():
    docs = load_documents("embedded")
    split = split_documents(docs, 0.2)
    share = len(split.heldout) / len(docs)
    assert 0.08 <= share <= 0.35  # ~79 topics: binomial sd ~0.045 around 0.2
    assert len(split.train) + len(split.heldout) + split.dropped_duplicates == len(docs)


def test_split_fraction_is_close_on_many_documents_and_independent_of_order():
    docs = [Document(f"doc-{i}", f"text {i}") for i in range(4000)]
    split = split_documents(docs, 0.2)
    assert 0.18 <= len(split.heldout) / len(docs) <= 0.22  # sd ~0.0063
    reversed_split = split_documents(docs[::-1], 0.2)
    assert reversed_split.heldout_hash == split.heldout_hash
    assert reversed_split.train_hash == split.train_hash


def test_split_rule_is_the_documented_hash_of_the_id():
    digest = hashlib.sha256(b"heldout:for").hexdigest()
    assert heldout_score("for") == int(digest[:16], 16) / 2**64
    docs = load_documents("embedded")
    split = split_documents(docs, 0.2)
    assert {d.doc_id for d in split.heldout} == {d.doc_id for d in docs if heldout_score(d.doc_id) < 0.2}
    assert split.method == SPLIT_METHOD
    # raising the fraction only adds held-out documents
    bigger = split_documents(docs, 0.5)
    assert {d.doc_id for d in split.heldout} <= {d.doc_id for d in bigger.heldout}


def test_split_hashes_are_over_sorted_id_and_content_hash_pairs():
    docs = [Document(f"d{i}", f"t{i}") for i in range(30)]
    split = split_documents(docs, 0.3)
    pairs = sorted([d.doc_id, d.content_hash] for d in split.heldout)
    expected = hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()
    assert split.heldout_hash == expected == docs_hash(split.heldout[::-1])
    assert split.train_hash == docs_hash(split.train) != split.heldout_hash


def test_e3_copy_of_a_heldout_document_is_dropped_from_train():
    fraction = 0.5
    ids = [f"id-{i}" for i in range(40)]
    held_id = next(i for i in ids if heldout_score(i) < fraction)
    train_ids = [i for i in ids if heldout_score(i) >= fraction]
    copy_id = train_ids[0]
    docs = [Document(i, "the same text" if i in (held_id, copy_id) else f"text of {i}") for i in ids]

    split = split_documents(docs, fraction)

    assert held_id in {d.doc_id for d in split.heldout}
    assert copy_id not in {d.doc_id for d in split.train}
    assert split.dropped_duplicates == 1
    assert "1 train document" in split.disjoint_check and "sha256" in split.disjoint_check
    assert {d.content_hash for d in split.train}.isdisjoint({d.content_hash for d in split.heldout})
    assert len(split.train) == len(train_ids) - 1


def test_empty_side_is_a_data_error_naming_heldout_fraction():
    docs = [Document("a", "x"), Document("b", "y")]
    with pytest.raises(DataError, match="heldout_fraction"):
        split_documents(docs, 1e-12)  # nothing held out
    with pytest.raises(DataError, match="heldout_fraction"):
        split_documents(docs, 1 - 1e-12)  # nothing left to train on


# ---------------------------------------------------------------------------------------------------------- blocks
class WordTokenizer:
    """A tiny tokenizer: one id per whitespace word; adds a BOS id 1 unless add_special_tokens=False."""

    def __init__(self, pad_token_id: int | None = None):
        self.vocab = {"a": 10, "b": 11, "c": 12, "d": 13, "e": 14}
        self.eos_token_id = 2
        self.pad_token_id = pad_token_id

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [self.vocab[word] for word in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


DOCS = [Document("x", "a b c"), Document("y", "d e"), Document("z", "a")]


def test_make_blocks_concatenates_with_eos_and_pads_the_last_block():
    blocks = make_blocks(DOCS, WordTokenizer(pad_token_id=0), seq_len=4)
    # stream: a b c EOS d e EOS a  -> 10 11 12 2 | 13 14 2 10  ; seq_len 3 would leave a partial block
    assert blocks == [
        {"sample_id": 0, "input_ids": [10, 11, 12, 2], "attention_mask": [1, 1, 1, 1]},
        {"sample_id": 1, "input_ids": [13, 14, 2, 10], "attention_mask": [1, 1, 1, 1]},
    ]
    blocks = make_blocks(DOCS, WordTokenizer(pad_token_id=0), seq_len=3)
    assert blocks == [
        {"sample_id": 0, "input_ids": [10, 11, 12], "attention_mask": [1, 1, 1]},
        {"sample_id": 1, "input_ids": [2, 13, 14], "attention_mask": [1, 1, 1]},
        {"sample_id": 2, "input_ids": [2, 10, 0], "attention_mask": [1, 1, 0]},
    ]


def test_make_blocks_pads_with_eos_when_there_is_no_pad_token_and_keeps_first_blocks():
    blocks = make_blocks(DOCS, WordTokenizer(pad_token_id=None), seq_len=5)
    assert blocks == [
        {"sample_id": 0, "input_ids": [10, 11, 12, 2, 13], "attention_mask": [1, 1, 1, 1, 1]},
        {"sample_id": 1, "input_ids": [14, 2, 10, 2, 2], "attention_mask": [1, 1, 1, 0, 0]},
    ]
    assert make_blocks(DOCS, WordTokenizer(), seq_len=3, max_blocks=2) == make_blocks(DOCS, WordTokenizer(), 3)[:2]


def test_make_blocks_without_eos_is_a_data_error():
    tokenizer = WordTokenizer()
    tokenizer.eos_token_id = None
    with pytest.raises(DataError, match="eos"):
        make_blocks(DOCS, tokenizer, seq_len=4)


def test_check_inputs_names_a_missing_model_and_a_bad_data_file_together(tmp_path):
    """A missing model no longer hides the data file's error (issue 17): both come back, each with its field."""
    from core.prerun import check_inputs
    from core.spec import RunSpec

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"body": "two"}\n')
    checked = check_inputs(RunSpec.build(mode="lora", model=str(tmp_path / "no-model"), data=str(bad)))
    fields = dict(checked.problems)
    assert set(fields) == {"model", "data"}, checked.problems
    assert 'line 2: no "text" key' in fields["data"]
    assert checked.model is None and checked.documents is None and not checked.ok
    assert checked.data_summary() == ""
