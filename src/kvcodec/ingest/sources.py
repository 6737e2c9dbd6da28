"""Where ingested documents come from: a folder of text files, a JSON Lines file, or a file of prompts
(one per line), each optionally put into a shared template.

Every document gets an id (file name, the record's id field or its line number) used in progress
and error reports; a record that cannot be read becomes a Document with an `error`, so one bad
line never stops a job.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

from kvcodec.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
PLACEHOLDER = "{text}"


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    text: str = ""
    error: str | None = None  # why it could not be read (then it is reported, not ingested)


def apply_template(template: str | None, text: str) -> str:
    """`template` with {text} replaced by the document (other braces are left alone)."""
    return text if not template else template.replace(PLACEHOLDER, text)


def check_template(template: str | None) -> None:
    if template is not None and PLACEHOLDER not in template:
        raise ConfigError(f"the template must contain {PLACEHOLDER} where each document goes; got {template!r}")


def read_documents(
    path: str | Path, *, template: str | None = None, text_field: str = "text", id_field: str = "id"
) -> Iterator[Document]:
    """The documents of `path`: a directory (its text files, sorted by name, recursively), a
    JSON Lines file (.jsonl or .ndjson: objects with `text_field` and optionally `id_field`, or plain
    strings), or any other file but .json (one prompt per non-empty line). A document whose text is
    empty or only white space is reported, not stored."""
    check_template(template)
    p = Path(path)
    if p.is_dir():
        docs = _folder(p)
    elif p.is_file():
        suffix = p.suffix.lower()
        if suffix == ".json":  # its lines would be stored as prompts: JSON text that no request begins with
            raise ConfigError(f"{p}: a .json file is not read; give JSON Lines (.jsonl), one record a line")
        docs = _jsonl(p, text_field, id_field) if suffix in JSON_LINES_SUFFIXES else _lines(p)
    else:
        raise ConfigError(f"{str(p)!r} is neither a folder nor a file")
    for d in docs:
        if d.error:
            yield d
        elif not d.text.strip():
            yield Document(d.id, error="the text is empty or only white space")
        else:
            yield dataclasses.replace(d, text=apply_template(template, d.text))


def _folder(root: Path) -> Iterator[Document]:
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(f"{root} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    for f in files:
        rel = f.relative_to(root).as_posix()
        try:
            yield Document(rel, f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            yield Document(rel, error=f"cannot read: {e}")


def _utf8_lines(path: Path) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, None) per line, or (line number, None, error) for a line that is not
    UTF-8: it is reported, never ingested with its bytes replaced."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                yield n, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield n, None, f"not UTF-8 text: {e}"


def _jsonl(path: Path, text_field: str, id_field: str) -> Iterator[Document]:
    for n, line, error in _utf8_lines(path):
        if error:
            yield Document(f"line {n}", error=error)
            continue
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            yield Document(f"line {n}", error=f"not JSON: {e}")
            continue
        if isinstance(rec, str):
            yield Document(f"line {n}", rec)
        elif isinstance(rec, dict) and isinstance(rec.get(text_field), str):
            given = rec.get(id_field)
            yield Document(f"line {n}" if given is None else str(given), rec[text_field])
        else:
            yield Document(f"line {n}", error=f"no string field {text_field!r}")


def _lines(path: Path) -> Iterator[Document]:
    for n, line, error in _utf8_lines(path):
        if error:
            yield Document(f"line {n}", error=error)
        elif line.strip():
            yield Document(f"line {n}", line.rstrip("\r\n"))
