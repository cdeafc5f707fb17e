"""Packing: documents of different lengths laid into fixed windows with segment ids and per-document positions, so
that a batch carries real tokens instead of padding (levanter and MaxText do the same).

    packed = pack_documents([doc_a, doc_b, ...], seq_len=128)     # token id arrays, one per document
    packed.arrays  # x, y, segment_ids, positions, loss_mask: (windows, 128) each
    packed.efficiency  # real (input, target) pairs / window positions

A document of n tokens gives n - 1 (input, next-token target) pairs; one longer than a window is cut into pieces
of `seq_len` pairs (each piece repeats the previous one's last token as its first input, so every target is
predicted exactly once). Pieces go into windows by first-fit decreasing. Within a window each piece has its own
segment id (1, 2, ...; 0 marks padding) and positions from 0; `MultiHeadAttention` lets a token see only earlier
tokens of its own segment, `PositionEmbedding` and rotary attention read the positions, and `lm_loss` counts the
pairs `loss_mask` marks, so no loss crosses a boundary or reads padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxnn.data.datasets import DataError, TextCorpus

KEYS = ("x", "y", "segment_ids", "positions", "loss_mask")


class Packed(NamedTuple):
    arrays: dict[str, np.ndarray]  # KEYS, each (windows, seq_len)
    efficiency: float  # real pairs / (windows * seq_len)
    documents: int


def _pieces(documents: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None, seq_len: int) -> list:
    """(tokens of a piece: pairs + 1, the weights of its targets) for every document, cut to at most seq_len
    pairs."""
    pieces = []
    for i, doc in enumerate(documents):
        doc = np.asarray(doc)
        if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
            raise DataError(
                f"pack_documents: document {i} must be a 1-D array of token ids, got {doc.dtype} {doc.shape}"
            )
        w = np.ones(max(len(doc) - 1, 0), np.float32) if weights is None else np.asarray(weights[i], np.float32)
        if weights is not None and w.shape != (max(len(doc) - 1, 0),):
            raise DataError(
                f"pack_documents: weights {i} must have one entry per target ({len(doc) - 1}), got {w.shape}"
            )
        for start in range(0, len(doc) - 1, seq_len):
            pieces.append((doc[start : start + seq_len + 1], w[start : start + seq_len]))
    return pieces


def pack_documents(
    documents: Sequence[np.ndarray], seq_len: int, *, weights: Sequence[np.ndarray] | None = None
) -> Packed:
    """Packs token-id documents into windows of `seq_len` positions (see the module docstring). `weights`, one
    array per document with an entry per target (e.g. 0 for a prompt, 1 for its completion), become `loss_mask`.
    Documents of fewer than 2 tokens have no pair and are left out."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"pack_documents: seq_len must be a positive integer, got {seq_len!r}")
    pieces = sorted(_pieces(documents, weights, seq_len), key=lambda p: -len(p[1]))
    if not pieces:
        raise DataError("pack_documents: no document has two tokens (an input and its target)")
    placed = _best_fit([len(w) for _, w in pieces], seq_len)
    return Packed(_fill(pieces, placed, seq_len), _efficiency(pieces, len(placed), seq_len), len(documents))


def _best_fit(sizes: list[int], seq_len: int) -> list[list[int]]:
    """Piece indices per window, best fit in the given (decreasing) order: each piece goes to the window with the
    least room that still holds it. Windows are kept by their free room (at most seq_len + 1 buckets), so each
    piece costs at most seq_len bucket lookups, not one per window."""
    by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]  # window indices by free positions
    placed: list[list[int]] = []
    for i, n in enumerate(sizes):
        room = next((r for r in range(n, seq_len + 1) if by_room[r]), None)
        if room is None:
            placed.append([])
            window, room = len(placed) - 1, seq_len
        else:
            window = by_room[room].pop()
        placed[window].append(i)
        by_room[room - n].append(window)
    return placed


def _fill(pieces: list, placed: list[list[int]], seq_len: int) -> dict[str, np.ndarray]:
    shape = (len(placed), seq_len)
    out = {k: np.zeros(shape, np.float32 if k == "loss_mask" else np.int32) for k in KEYS}
    for row, members in enumerate(placed):
        at = 0
        for segment, i in enumerate(members, start=1):
            tokens, w = pieces[i]
            n = len(w)
            out["x"][row, at : at + n] = tokens[:-1]
            out["y"][row, at : at + n] = tokens[1:]
            out["segment_ids"][row, at : at + n] = segment
            out["positions"][row, at : at + n] = np.arange(n)
            out["loss_mask"][row, at : at + n] = w
            at += n
    return out


def _efficiency(pieces: list, windows: int, seq_len: int) -> float:
    return sum(len(w) for _, w in pieces) / (windows * seq_len)


def padding_efficiency(documents: Sequence[np.ndarray], seq_len: int) -> float:
    """Real pairs / window positions when every document (piece) gets a window of its own, as without packing."""
    pieces = _pieces(documents, None, seq_len)
    return _efficiency(pieces, len(pieces), seq_len) if pieces else 0.0


def documents_of(tokens: np.ndarray, starts: np.ndarray | None, targets: np.ndarray | None) -> tuple[list, list]:
    """A corpus stream cut at its documents' starts: (token arrays, weights of their targets)."""
    if starts is None:
        raise DataError(
            "packing needs the documents' boundaries: JSON Lines records (one document each, "
            "jaxnn.data.records), not a plain text stream"
        )
    ends = [*starts[1:], len(tokens)]
    docs = [np.asarray(tokens[s:e], np.int32) for s, e in zip(starts, ends)]
    weights = [
        np.ones(max(e - s - 1, 0), np.float32) if targets is None else targets[s + 1 : e] for s, e in zip(starts, ends)
    ]
    return docs, weights


def pack_corpus(corpus: TextCorpus, seq_len: int) -> tuple[Packed, Packed]:
    """A TextCorpus of records packed: (train, test), each split's documents into windows of `seq_len`."""
    train = documents_of(corpus.train, corpus.train_starts, corpus.train_targets)
    test = documents_of(corpus.test, corpus.test_starts, corpus.test_targets)
    return pack_documents(train[0], seq_len, weights=train[1]), pack_documents(test[0], seq_len, weights=test[1])


__all__ = ["KEYS", "Packed", "documents_of", "pack_corpus", "pack_documents", "padding_efficiency"]
