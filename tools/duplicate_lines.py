"""Repeated code in Python sources, found with the standard library alone (`tokenize`), so that a test can hold a
limit where no outside duplicate finder is installed.

Each file becomes its logical lines (a statement spread over several physical lines is one line) with comments,
docstrings, blank lines and declarations (imports, class headers, annotated names: field lists) left out. A line is
compared exactly (its tokens joined with single spaces) unless `shape=True`, where names, strings and numbers
become placeholders (keywords and punctuation stay); `physical=True` compares physical lines instead, a line of
punctuation alone left out. A run of `min_lines` or more consecutive lines that stands in two places, in one file
or two, is a pair of places; runs between the same two places that overlap or touch are merged into one pair. A
window of lines that stands in more than `too_common` places is passed over, as common idiom rather than
repetition worth a helper.

    python tools/duplicate_lines.py [folder] [--exact] [--physical]    # the pairs in jaxnn/ (or the folder), by shape
"""

from __future__ import annotations

import io
import keyword
import pathlib
import sys
import tokenize
from collections import defaultdict
from typing import NamedTuple

SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
# Python 3.12 splits an f-string into pieces; 3.11 gives one STRING token.
FSTRING_START = getattr(tokenize, "FSTRING_START", -1)
FSTRING_END = getattr(tokenize, "FSTRING_END", -1)


class Place(NamedTuple):
    """Physical lines `first`..`last` (1-based) of the file `name`."""

    name: str
    first: int
    last: int


class Line(NamedTuple):
    """One logical line: its normalised text and the physical lines it spans."""

    text: str
    first: int
    last: int


def logical_lines(source: str, shape: bool = False, physical: bool = False) -> list[Line]:
    """The logical lines of `source` that count: not comments, blank lines, docstrings (a statement that is only
    a string) or imports; with `shape`, names, strings and numbers are placeholders. With `physical`, each kept
    statement is cut back into its physical lines, and a line of punctuation alone is left out."""
    lines: list[Line] = []
    words: list[tuple[int, int, str]] = []  # (row, token kind, normalised text) of the statement so far
    in_fstring = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in SKIPPED:
            continue
        if tok.type == tokenize.NEWLINE:
            if words and not _passed_over(words):
                lines += _cut(words, physical)
            words = []
            continue
        if tok.type == FSTRING_START:
            in_fstring += 1
        if in_fstring:
            in_fstring -= tok.type == FSTRING_END
            if not shape or not in_fstring:  # with shape, a whole f-string is one S
                words.append((tok.start[0], tokenize.STRING, "S" if shape else tok.string))
            continue
        words.append((tok.start[0], tok.type, placeholder(tok) if shape else tok.string))
    return lines


def _passed_over(words: list[tuple[int, int, str]]) -> bool:
    """Declarations, where a run of alike lines is no logic repeated: a docstring (a statement of strings alone),
    an import, a class header (a list of exception classes) or an annotated name (`name: type` or
    `name: type = default`, a dataclass's fields)."""
    texts = [w for _, _, w in words]
    if all(k == tokenize.STRING for _, k, _ in words) or texts[0] in ("import", "from", "class"):
        return True
    is_name = words[0][1] == tokenize.NAME and not keyword.iskeyword(words[0][2])
    return is_name and len(texts) > 1 and texts[1] == ":"


def _cut(words: list[tuple[int, int, str]], physical: bool) -> list[Line]:
    if not physical:
        return [Line(" ".join(w for _, _, w in words), words[0][0], words[-1][0])]
    rows: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for row, kind, word in words:
        rows[row].append((kind, word))
    return [
        Line(" ".join(w for _, w in row_words), row, row)
        for row, row_words in rows.items()
        if any(kind != tokenize.OP for kind, _ in row_words)
    ]


def placeholder(tok: tokenize.TokenInfo) -> str:
    """A token's shape: N for a name, S for a string, 0 for a number, else the token itself."""
    if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
        return "N"
    return {tokenize.STRING: "S", tokenize.NUMBER: "0"}.get(tok.type, tok.string)


def find_pairs(
    sources: dict[str, str], min_lines: int = 6, shape: bool = False, physical: bool = False, too_common: int = 8
) -> list[tuple[Place, Place]]:
    """Pairs of places (name -> source text in) that share a run of `min_lines` or more logical lines."""
    files = {name: logical_lines(text, shape, physical) for name, text in sorted(sources.items())}
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        for i in range(len(lines) - min_lines + 1):
            windows[tuple(line.text for line in lines[i : i + min_lines])].append((name, i))
    # (file a, file b, start in a - start in b) -> the starts in a of matching windows: a diagonal of matches
    diagonals: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for places in windows.values():
        if len(places) > too_common:
            continue
        for k, (name_a, i) in enumerate(places):
            for name_b, j in places[k + 1 :]:
                if name_a == name_b and j - i < min_lines:
                    continue  # a line repeated in a row overlaps itself
                diagonals[(name_a, name_b, i - j)].append(i)
    runs = []
    for (name_a, name_b, shift), starts in diagonals.items():
        for start, end in _spans(sorted(starts), min_lines):
            runs.append((name_a, start, end, name_b, start - shift, end - shift))
    return [_to_places(files, run) for run in _merge(sorted(runs))]


def _spans(starts: list[int], min_lines: int) -> list[tuple[int, int]]:
    """Window starts on one diagonal -> (first, last) logical-line spans, windows that overlap or touch joined."""
    spans: list[tuple[int, int]] = []
    for s in starts:
        if spans and s <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], s + min_lines - 1)
        else:
            spans.append((s, s + min_lines - 1))
    return spans


def _merge(runs: list[tuple[str, int, int, str, int, int]]) -> list[tuple[str, int, int, str, int, int]]:
    """Runs between the same two files whose sides both overlap or touch become one run."""
    merged: list[tuple[str, int, int, str, int, int]] = []
    for run in runs:
        for k, old in enumerate(merged):
            same_files = old[0] == run[0] and old[3] == run[3]
            if (
                same_files
                and run[1] <= old[2] + 1
                and old[1] <= run[2] + 1
                and run[4] <= old[5] + 1
                and old[4] <= run[5] + 1
            ):
                merged[k] = (
                    old[0],
                    min(old[1], run[1]),
                    max(old[2], run[2]),
                    old[3],
                    min(old[4], run[4]),
                    max(old[5], run[5]),
                )
                break
        else:
            merged.append(run)
    return merged


def _to_places(files: dict[str, list[Line]], run: tuple[str, int, int, str, int, int]) -> tuple[Place, Place]:
    name_a, a0, a1, name_b, b0, b1 = run
    return (
        Place(name_a, files[name_a][a0].first, files[name_a][a1].last),
        Place(name_b, files[name_b][b0].first, files[name_b][b1].last),
    )


def package_sources(folder: pathlib.Path) -> dict[str, str]:
    """Every .py file below `folder`, by its path relative to it."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.py"))}


def main(argv: list[str]) -> None:
    shape, physical = "--exact" not in argv, "--physical" in argv
    args = [a for a in argv if not a.startswith("--")]
    folder = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parent.parent / "jaxnn"
    pairs = find_pairs(package_sources(folder), shape=shape, physical=physical)
    print(f"{len(pairs)} pairs ({'shape' if shape else 'exact'}, {'physical' if physical else 'logical'} lines)")
    for a, b in pairs:
        print(f"{a.name}:{a.first}-{a.last} ~ {b.name}:{b.first}-{b.last}")


if __name__ == "__main__":
    main(sys.argv[1:])
