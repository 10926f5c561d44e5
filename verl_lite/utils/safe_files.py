"""Reading a directory someone else wrote (a downloaded checkpoint) without being turned against its reader.

Everything in a shared checkpoint is treated as hostile. Every file a run reads from one is resolved inside
the directory (plain relative names, each component opened with ``O_NOFOLLOW``: no symbolic link anywhere
on the way is followed), must be a regular file (opened non-blocking: no FIFO that blocks), and has a size
bound checked on the open descriptor before a byte is read; a safetensors header is bounded and every
tensor's byte range lies inside the file. :func:`scan_tree` refuses any link or special file in a whole
tree. Files a run writes where the name is not fresh are created with ``O_EXCL | O_NOFOLLOW``.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path, PurePosixPath

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
JSON_LIMIT = 16 * MIB  # a metadata JSON file of a checkpoint (the largest, the manifest, is ~150 B per file)
SAFETENSORS_HEADER_LIMIT = 100_000_000  # bytes: the safetensors format's own bound on its JSON header
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(ValueError):
    """A file of an untrusted directory cannot be read safely; the message names it and says why."""


def relative_parts(rel: str | os.PathLike) -> tuple[str, ...]:
    """The components of ``rel``, refused unless it is a relative path of plain names (no ``..`` or ``.``)."""
    text = os.fspath(rel)
    parts = PurePosixPath(text).parts
    if not parts or text.startswith("/") or "\\" in text or "\x00" in text or any(p in ("..", ".", "") for p in parts):
        raise UnsafeFile(f"{text!r} is not a plain relative path (absolute, or with '..')")
    return parts


def is_plain_relative(rel: str, depth: int | None = None) -> bool:
    """Whether ``rel`` passes :func:`relative_parts` (and, with ``depth``, has exactly that many components)."""
    try:
        parts = relative_parts(rel)
    except UnsafeFile:
        return False
    return depth is None or len(parts) == depth


def open_inside(root: str | os.PathLike, rel: str | os.PathLike) -> int:
    """A read-only, non-blocking descriptor of the regular file ``root/rel``, each component opened inside the
    last with ``O_NOFOLLOW`` (a symbolic link anywhere is refused). The caller closes it."""
    parts = relative_parts(rel)
    where = Path(root, *parts)
    try:
        fd = os.open(root, _OPEN_DIR)
    except OSError as e:
        raise UnsafeFile(f"{root}: cannot open the directory ({e.strerror or e}; "
                         f"a symbolic link is not followed)") from None
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, _OPEN_DIR, dir_fd=fd)
            except OSError as e:
                raise UnsafeFile(f"{where}: {name!r} on its path is not a directory inside {root} "
                                 f"({e.strerror or e}; symbolic links are not followed)") from None
            os.close(fd)
            fd = child
        try:
            file_fd = os.open(parts[-1], _OPEN_FILE, dir_fd=fd)
        except OSError as e:
            raise UnsafeFile(f"{where}: cannot be opened as a file inside {root} ({e.strerror or e}; "
                             f"symbolic links are not followed)") from None
    finally:
        os.close(fd)
    mode = os.fstat(file_fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(file_fd)
        raise UnsafeFile(f"{where}: not a regular file ({_kind(mode)})")
    return file_fd


def size_inside(root: str | os.PathLike, rel: str | os.PathLike) -> int:
    """The size of the regular file ``root/rel`` (resolved as :func:`open_inside` does)."""
    with open(open_inside(root, rel), "rb") as f:
        return os.fstat(f.fileno()).st_size


def read_bounded(root: str | os.PathLike, rel: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``root/rel`` (see :func:`open_inside`), refused when the file holds more than ``limit``."""
    with open(open_inside(root, rel), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise UnsafeFile(f"{Path(root, rel)}: {size} bytes, more than the {limit} a file of this kind may hold")
        return f.read(size)


def read_json(root: str | os.PathLike, rel: str | os.PathLike, limit: int = JSON_LIMIT):
    """The parsed JSON of ``root/rel`` (bounded, see :func:`read_bounded`); :class:`UnsafeFile` if it does not parse."""
    data = read_bounded(root, rel, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UnsafeFile(f"{Path(root, rel)} is unreadable ({type(e).__name__}: {e})") from None


def read_safetensors_header(f) -> tuple[dict, int]:
    """(header, data bytes after it) of the safetensors file open as ``f`` (binary, at its start): the 8-byte length,
    bounded by the format and by the file's size, then the JSON object, never a tensor. :class:`UnsafeFile` saying
    why (the caller names the file)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise UnsafeFile(f"{size} bytes, too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(SAFETENSORS_HEADER_LIMIT, size - 8):
        raise UnsafeFile(f"its header claims {header_len} bytes, more than the file ({size} bytes) or the format's "
                         f"bound holds")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UnsafeFile(f"its safetensors header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise UnsafeFile("its safetensors header is not a JSON object")
    return header, size - 8 - header_len


def check_safetensors(root: str | os.PathLike, rel: str | os.PathLike) -> dict:
    """The header of a safetensors file, checked against the file: bounded JSON, known dtypes, byte ranges of
    shape x dtype-size bytes that cover the data section exactly."""
    where = Path(root, rel)
    with open(open_inside(root, rel), "rb") as f:
        try:
            header, data_size = read_safetensors_header(f)
        except UnsafeFile as e:
            raise UnsafeFile(f"{where}: {e}") from None
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise UnsafeFile(f"{where}: its __metadata__ is not a map of strings")
            continue
        ranges.append(_tensor_range(where, name, info, data_size))
    covered = 0
    for begin, end in sorted(ranges):
        if begin != covered:
            raise UnsafeFile(f"{where}: tensor byte ranges overlap or leave a gap at byte {covered}")
        covered = end
    if covered != data_size:
        raise UnsafeFile(f"{where}: the tensors cover {covered} of the {data_size} data bytes")
    return header


def _tensor_range(where: Path, name: str, info, data_size: int) -> tuple[int, int]:
    ok = (isinstance(info, dict) and info.get("dtype") in SAFETENSORS_DTYPE_BYTES
          and isinstance(info.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(isinstance(o, int) for o in info["data_offsets"]))
    if not ok:
        raise UnsafeFile(f"{where}: tensor {name!r} has a malformed header entry")
    begin, end = info["data_offsets"]
    nbytes = math.prod(info["shape"]) * SAFETENSORS_DTYPE_BYTES[info["dtype"]]
    if not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise UnsafeFile(f"{where}: tensor {name!r} claims bytes {begin}..{end} for shape {info['shape']} "
                         f"{info['dtype']}, outside or unlike the file's {data_size} data bytes")
    return begin, end


def scan_tree(root: str | os.PathLike) -> dict[str, int]:
    """``{relative POSIX path: size}`` of every file under ``root``, walked without following links; a
    symbolic link, FIFO, socket or device anywhere under it is refused (:class:`UnsafeFile` naming it)."""
    root = Path(root)
    found: dict[str, int] = {}
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            raise UnsafeFile(f"{root}: not a directory (a symbolic link is not followed)")
    except FileNotFoundError:
        raise UnsafeFile(f"{root}: does not exist") from None
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise UnsafeFile(f"{path}: {_kind(mode)}; a checkpoint holds only regular files and directories")
            found[path.relative_to(root).as_posix()] = os.lstat(path).st_size
    return found


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write descriptor of a new file at ``path`` (``O_EXCL | O_NOFOLLOW``: never through a planted link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
