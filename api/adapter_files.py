"""Where an adapter's files may come from: names, paths inside the adapter root, and the two files of an
upload (told apart by their contents when their fields are swapped), written into the adapter store."""
import errno
import os
import re
import shutil
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

from slora.adapters.weights import PICKLE_SUFFIXES, WEIGHTS_FILE
from slora.api.errors import APIError, bad_request
from slora.api.protocol import ADAPTER_NAME_PATTERN
from slora.execution.adapter_manager import folder_bytes

CONFIG_FILE = "adapter_config.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
SNIFF_BYTES = 64                # of an uploaded file, read to tell JSON from safetensors
ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)


def check_adapter_name(name: str, base_model: str | Collection[str]) -> None:
    """An adapter name must match ADAPTER_NAME_PATTERN and be none of the base model's names."""
    if not ADAPTER_NAME.fullmatch(name):           # fullmatch: `$` alone would let a final newline through
        raise bad_request("adapter name must be 1-128 letters, digits, '.', '_' or '-', starting with a letter "
                          "or digit", param="name")
    if name in ((base_model,) if isinstance(base_model, str) else base_model):
        raise bad_request("adapter name must differ from the base model's name", param="name")


def resolve_in_root(root: Path | None, user_path: str, param: str) -> Path:
    """The adapter folder `user_path` names inside `root`. Refuses `..`, absolute paths and symlinks that
    lead outside the root; the folder and its two files must all resolve inside it. Every failure of the file
    system is a 400 naming the problem, never the server-side path."""
    if root is None:
        raise bad_request("loading adapters by path is disabled: the server has no adapter root "
                          "(start it with --adapter-root DIR, or upload the files)", param=param)
    _check_path_text(user_path, param)
    try:
        return _folder_in_root(root.resolve(), user_path, param)
    except OSError as exc:
        raise bad_request(f"adapter path cannot be used: {os_problem(exc)}", param=param) from None
    except RuntimeError:                  # what Path.resolve raises for a loop of symlinks (Python 3.11)
        raise bad_request("adapter path cannot be used: it leads into a loop of symbolic links",
                          param=param) from None


def _check_path_text(user_path: str, param: str) -> None:
    if not user_path or "\x00" in user_path:
        raise bad_request("adapter path is empty or invalid", param=param)
    try:
        os.fsencode(user_path)
    except UnicodeEncodeError:            # lone surrogates, which JSON can carry and no file name holds
        raise bad_request("adapter path is not valid text", param=param) from None
    if ".." in PurePosixPath(user_path).parts or ".." in PureWindowsPath(user_path).parts:
        raise bad_request("adapter path must not contain '..'", param=param)


def _folder_in_root(real_root: Path, user_path: str, param: str) -> Path:
    pure = PurePosixPath(user_path)
    candidate = Path(user_path) if pure.is_absolute() else real_root / pure
    folder = candidate.resolve()
    targets = [folder] + [(folder / name).resolve() for name in ADAPTER_FILES if (folder / name).exists()]
    if not all(t == real_root or t.is_relative_to(real_root) for t in targets) or folder == real_root:
        raise bad_request("adapter path must name a folder inside the adapter root", param=param)
    if not folder.is_dir():
        raise bad_request(f"no adapter folder at {user_path!r} in the adapter root", param=param)
    return folder


def os_problem(exc: OSError) -> str:
    """What went wrong, in words, without the path that the exception's own text holds."""
    if exc.errno == errno.ENAMETOOLONG:
        return "it is too long (a name in it over the file system's limit, usually 255 bytes)"
    return os.strerror(exc.errno).lower() if exc.errno else "the file system refused it"


@dataclass(frozen=True)
class UploadedFile:
    field: str
    filename: str
    source: BinaryIO            # the spooled upload; copied to disk in chunks, never read whole into memory
    size: int


def choose_upload_files(files: list[UploadedFile]) -> dict[str, UploadedFile]:
    """The upload's two PEFT files, by their names in the adapter folder. Pickle files are refused unread."""
    chosen: dict[str, UploadedFile] = {}
    for item in files:
        filename = base_filename(item)
        if filename.endswith(PICKLE_SUFFIXES) or item.field.endswith(PICKLE_SUFFIXES):
            raise bad_request(f"{filename}: pickle files are never loaded; upload {WEIGHTS_FILE}",
                              param=item.field)
        target = _upload_target(item.field, filename)
        if target is None:
            raise bad_request(f"unexpected file {filename!r}: upload exactly {CONFIG_FILE} and {WEIGHTS_FILE}",
                              param=item.field)
        chosen[target] = item
    _refuse_swapped(chosen)
    missing = [f for f in ADAPTER_FILES if f not in chosen]
    if missing:
        raise bad_request(f"the upload lacks {', '.join(missing)}", param="files")
    return chosen


def write_upload(folder: Path, files: dict[str, UploadedFile]) -> Path:
    """Copy the chosen files into `folder` (made here), a MiB at a time; nothing of it is left if the copy
    fails."""
    try:
        folder.mkdir(parents=True)
        for filename, item in files.items():
            item.source.seek(0)
            with open(folder / filename, "wb") as out:
                shutil.copyfileobj(item.source, out, length=2 ** 20)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, OSError):      # a full disk, above all
            raise insufficient_storage("the upload could not be stored", exc) from None
        raise
    return folder


def insufficient_storage(what: str, exc: OSError) -> APIError:
    return APIError(507, f"{what}: {os_problem(exc)}", code="insufficient_storage", error_type="server_error")


def _upload_target(field: str, filename: str) -> str | None:
    """Which PEFT file an upload part is: by its field name (the file's name, with or without its suffix), the
    form's contract; by its file name only for a field of another name."""
    for target in ADAPTER_FILES:
        if _field_names(field, target):
            return target
    return filename if filename in ADAPTER_FILES else None


def _field_names(field: str, target: str) -> bool:
    return field in (target, target.split(".")[0])


def _refuse_swapped(chosen: dict[str, UploadedFile]) -> None:
    """A 400 naming both parts if the config's part holds safetensors weights and the weights' part JSON.

    Refused, not loaded the other way round: vLLM and LoRAX load an adapter from what the request names and
    answer a request that names the wrong thing with an error, not a guess, and so does this server for every
    other mistake in an upload. A client whose two fields are crossed has a bug that a guessing server would
    hide until it meets one that does not guess; the 400 says which fields to exchange. Without the check the
    client would be told that the config is not valid JSON, which is true and no help."""
    config, weights = chosen.get(CONFIG_FILE), chosen.get(WEIGHTS_FILE)
    if config is None or weights is None or not _is_safetensors(config) or not _is_json_object(weights):
        return
    raise bad_request(f"the upload's two files are swapped: {_part(config, CONFIG_FILE)} holds safetensors "
                      f"weights and {_part(weights, WEIGHTS_FILE)} holds JSON; send {CONFIG_FILE} as "
                      f"'{CONFIG_FILE.split('.')[0]}' and {WEIGHTS_FILE} as '{WEIGHTS_FILE.split('.')[0]}'",
                      param="files", code="upload_files_swapped")


def _part(item: UploadedFile, target: str) -> str:
    """An upload part as the client named it: by its field, or by its file name where that chose its place."""
    return f"field '{item.field}'" if _field_names(item.field, target) else f"file '{base_filename(item)}'"


def base_filename(item: UploadedFile) -> str:
    """The part's file name without the client's folders (a browser may send them, with either slash)."""
    return PurePosixPath(item.filename.replace("\\", "/")).name


def _head(item: UploadedFile) -> bytes:
    item.source.seek(0)
    head = item.source.read(SNIFF_BYTES)
    item.source.seek(0)
    return head


def _is_safetensors(item: UploadedFile) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then the JSON header, within the file."""
    head = _head(item)
    if len(head) < 9:
        return False
    header_length = struct.unpack("<Q", head[:8])[0]
    return head[8:9] == b"{" and 8 + header_length <= item.size


def _is_json_object(item: UploadedFile) -> bool:
    """What begins like a JSON object (after a byte-order mark and white space) and is no safetensors file,
    whose length bytes may begin with '{' too."""
    return _head(item).removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"{" and not _is_safetensors(item)


def sanitize(message: str, hidden: list[Path]) -> str:
    """Drop server-side folder names from an engine message (they are internal paths)."""
    for path in hidden:
        message = message.replace(str(path.resolve()), "<adapter>").replace(str(path), "<adapter>")
    return message


def stat_bytes(folder: Path) -> int:
    """The bytes of an adapter folder's two files, from their sizes on disk: nothing of them is read."""
    try:
        return folder_bytes(folder)
    except OSError as exc:
        raise bad_request(f"adapter path cannot be used: {os_problem(exc)}", param="path") from None


@dataclass(frozen=True)
class Origin:
    """Where a load's files come from, and so what the adapter store records of it."""

    kind: str                         # UPLOAD, PATH or MODULE (--lora-modules: loaded at each start, not recorded)
    where: str | None = None          # UPLOAD: the folder, relative to the store; PATH: relative to the root

    @property
    def owns_files(self) -> bool:
        return self.kind == UPLOAD


UPLOAD, PATH, MODULE = "upload", "path", "module"
