"""Byte-level corpora for ``muon-fn train``: the Python standard library by default, or a path.

The default corpus needs no download: every ``*.py`` file under ``sysconfig``'s ``stdlib`` directory
(``site-packages`` and ``__pycache__`` excluded), read in sorted order of their relative paths.
Files are split into train and validation by a hash of the relative path (CRC-32 mod 10 == 0 →
validation, about 10 %), so the split does not depend on the file list's order and is the same on
every run and every rank. A text file passed with ``--data`` is split by position instead (last
10 % → validation); a directory is treated like the standard library (all regular files, or the
given glob).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .args import UsageError

__all__ = ["Corpus", "load_corpus", "stdlib_files", "Batcher", "WindowDataset"]

_SEPARATOR = b"\n\n"
VAL_BUCKETS = 10  # 1 of VAL_BUCKETS hash buckets is validation


@dataclass
class Corpus:
    name: str
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    n_files: int

    def describe(self) -> str:
        return (
            f"{self.name}: {self.n_files} files, train {self.train.numel() / 1e6:.2f} MB, "
            f"val {self.val.numel() / 1e6:.2f} MB (byte-level, vocab 256)"
        )


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's ``*.py`` files, sorted by relative path (third-party dirs pruned)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return root, sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).as_posix())


def _is_val(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % VAL_BUCKETS == 0


def _from_files(name: str, root: Path, files: list[Path], max_bytes: int | None, what: str | None = None) -> Corpus:
    """The corpus of ``files`` (``what``: how messages name it, default ``name``)."""
    train, val = bytearray(), bytearray()
    # With a byte budget, fill each split to its share (so both exist), in file order.
    val_cap = None if max_bytes is None else max(1, max_bytes // VAL_BUCKETS)
    train_cap = None if max_bytes is None else max_bytes - val_cap
    for f in files:
        rel = f.relative_to(root).as_posix()
        is_val = _is_val(rel)
        buf, cap = (val, val_cap) if is_val else (train, train_cap)
        if cap is not None and len(buf) >= cap:
            if len(train) >= train_cap and len(val) >= val_cap:
                break
            continue
        buf.extend(_read(f, f"{what or name}: cannot read {rel!r}") + _SEPARATOR)
    if not train or not val:
        raise UsageError(_split_error(what or name, len(files), bool(train), max_bytes))
    return Corpus(name, _to_tensor(train), _to_tensor(val), len(files))


def _split_error(what: str, n_files: int, has_train: bool, max_bytes: int | None) -> str:
    """Why a corpus of ``n_files`` files has no training bytes (``has_train`` False) or no validation bytes."""
    if n_files == 0:
        return f"{what}: no files to read"
    if not has_train and max_bytes == 1:
        return f"{what}: --max-bytes 1 leaves no bytes for the training split"
    where = "validation" if not has_train else "training"
    files = "its only file is" if n_files == 1 else f"all its {n_files} files are"
    return (f"{what}: {files} in the {where} split (a file's split is a hash of its path: about 1 in "
            f"{VAL_BUCKETS} files is validation); a run needs both: add files, or pass one text file")


def _read(f: Path, message: str) -> bytes:
    """The bytes of ``f``; :class:`UsageError` with ``message`` and the reason if it cannot be read."""
    try:
        return f.read_bytes()
    except OSError as e:
        raise UsageError(f"{message} ({e.strerror or e})") from None


def _to_tensor(b: bytearray) -> torch.Tensor:
    return torch.frombuffer(b, dtype=torch.uint8).clone() if b else torch.empty(0, dtype=torch.uint8)


def load_corpus(path: str | None = None, *, glob: str = "*", max_bytes: int | None = None) -> Corpus:
    """Load the default corpus (``path=None``), a text file, or a directory of files.

    A path that is missing or unreadable, or data too small to split, raises :class:`UsageError`
    (a ``ValueError``) with a message naming ``--data``."""
    if path is None:
        root, files = stdlib_files()
        return _from_files(f"Python {sysconfig.get_python_version()} stdlib ({root})", root, files, max_bytes)
    p, what = Path(path), f"--data {str(path)!r}"
    if p.is_dir():
        files = sorted((f for f in p.rglob(glob) if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        return _from_files(str(p), p, files, max_bytes, what)
    if p.is_file():
        data = _read(p, f"{what}: cannot read the file")
        cut = f" (--max-bytes {max_bytes})" if max_bytes is not None and max_bytes < len(data) else ""
        data = data if max_bytes is None else data[:max_bytes]
        split = int(len(data) * (1 - 1 / VAL_BUCKETS))
        if split < 2 or len(data) - split < 2:
            raise UsageError(f"{what}: {len(data)} bytes{cut}, too few to split into training and validation")
        return Corpus(str(p), _to_tensor(bytearray(data[:split])), _to_tensor(bytearray(data[split:])), 1)
    problem = "not a file or a directory" if p.exists() else "no such file or directory"
    raise UsageError(f"{what}: {problem}")


class Batcher:
    """Random training windows from a seeded generator (its state is checkpointed)."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if data.numel() <= seq_len + 1:
            raise ValueError(f"corpus split has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return windows(self.data, ix, self.seq_len)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    offs = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = data[offs].long()
    return chunk[:, :-1], chunk[:, 1:]


def val_starts(data: torch.Tensor, n_windows: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced, fixed validation windows: every evaluation sees the same bytes."""
    last = data.numel() - seq_len - 1
    if last <= 0:
        raise ValueError(f"validation split has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    return torch.linspace(0, last, n_windows).long()


class WindowDataset(torch.utils.data.Dataset):
    """``n`` fixed random windows of ``seq_len + 1`` bytes as a map-style dataset of ``(x, y)``
    (for ``DataLoader``-based trainers such as Lightning and Hugging Face)."""

    def __init__(self, data: torch.Tensor, seq_len: int, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.data, self.seq_len = data, seq_len
        self.starts = torch.randint(data.numel() - seq_len - 1, (n,), generator=gen)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = windows(self.data, self.starts[i : i + 1], self.seq_len)
        return x[0], y[0]
