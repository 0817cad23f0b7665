"""File helpers used everywhere: atomic writes (temp beside the target, then a rename), sha256, JSON lines.

A reader never sees a half-written file or folder: an exception, Ctrl-C or kill before the rename
leaves the target as it was (absent, or the previous version).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from server.errors import ConfigError

_CHUNK = 1 << 22


def _update(digest, path: Path) -> None:
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)


def file_sha256(path: Path) -> str:
    """Hex sha256 of one file, streamed."""
    digest = hashlib.sha256()
    _update(digest, Path(path))
    return digest.hexdigest()


def files_sha256(paths: Iterable[Path]) -> str:
    """Hex sha256 over several files: each one's name then its bytes, in sorted path order."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(path.name.encode())
        _update(digest, path)
    return digest.hexdigest()


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write; a clean exit renames it over `path`, an error removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # (mkstemp's 0600 would keep other users, a server's among them, out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data) -> Path:
    """Write `data` as indented JSON (+ newline) through atomic_file; returns the path."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return Path(path)


def _check_can_create(path: Path, what: str) -> None:
    """ConfigError unless `path` could be made: its nearest existing ancestor is a folder we can create entries in
    (tried, not judged by permission bits: root passes those where /proc, say, still refuses)."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: {parent} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(prefix=".neuronmm-check-", dir=parent).cleanup()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot write in {parent} ({exc.strerror or exc})") from None


def check_out_dir(path: Path, what: str, replaceable: Callable[[Path], bool]) -> Path:
    """The folder a long job will write at `path` (absolute), checked before the job starts: a ConfigError (one line)
    where it could not be written, or where it would replace anything but an empty folder or one that
    `replaceable(path)` accepts (an earlier output of the same kind): an output path never deletes a user's files."""
    path = Path(path).expanduser().resolve()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{what} {path}: exists and is a file (nothing was replaced)")
        if any(path.iterdir()) and not replaceable(path):
            raise ConfigError(f"{what} {path}: exists and holds other files; it would be replaced whole, so nothing "
                              f"was done (name a new folder, or remove it first)")
    _check_can_create(path, what)
    return path


def check_out_file(path: Path, what: str) -> Path:
    """The file a long job will write at `path`, checked before the job starts (ConfigError, one line)."""
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        raise ConfigError(f"{what} {path}: is a folder")
    _check_can_create(path, what)
    return path


def swap_in_dir(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder tmp to out_dir (same parent); an existing out_dir stays whole until then."""
    if out_dir.exists():
        # Two renames: the old folder stays whole until the new one is complete beside it.
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "a")
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _as_umask_allows(folder: Path) -> None:
    """Give a finished temp folder and what it holds the modes a plain mkdir and open would have: mkdtemp makes the
    folder 0700 and safetensors writes its files 0600, so a server running as another user could not read them."""
    umask = _umask()
    for path in (folder, *folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o777 & ~umask)
        elif path.is_file() and not path.is_symlink():
            path.chmod((0o777 if os.access(path, os.X_OK) else 0o666) & ~umask)


@contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temp folder beside out_dir to fill; a clean exit swaps it in, an error removes it."""
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        _as_umask_allows(tmp)
        swap_in_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSON-lines file; bad JSON is a ConfigError."""
    with open(path, encoding="utf-8") as fh:
        for num, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield num, json.loads(line)
                except json.JSONDecodeError:
                    raise ConfigError(f"{path}:{num}: not valid JSON") from None


def read_jsonl_texts(path: Path) -> list[str]:
    """The `text` field of every record of a JSON-lines file (a document corpus such as the C4 sample), in order."""
    texts = []
    for num, record in read_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError(f"{path}:{num}: not a JSON object with a `text` field")
        texts.append(record["text"])
    return texts
