"""Opening a checkpoint folder: config.json, the index and every shard's header.

Only headers and small JSON files are read here; tensor data is streamed later by
the writer. Everything a runtime would trip over (a missing shard, an index entry
pointing outside the folder, a tensor the index places in the wrong file) is
reported here with the file it concerns.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.json_text import MAX_FILE_BYTES, JsonRefused, parse_json
from fp8fix.io.safetensors_file import SafetensorsHeader, TensorInfo, read_header, read_values
from fp8fix.io.source_files import SourceFiles
from fp8fix.io.source_tree import SourceTree, read_regular
from fp8fix.numerics.dtypes import E8M0, E8M0_NAN, decode_floats

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: The model card: convert writes its own (keeping the source's text), so it is never copied as is.
CARD = "README.md"
#: The suffix every shard has: vLLM loads the `*.safetensors` files the index lists, and fp8fix writes
#: its own files (config, index, card) under other names, so a shard can never be written over them.
SHARD_SUFFIX = ".safetensors"
#: NVIDIA ModelOpt's quantization config beside config.json (registry/formats.py reads it).
MODELOPT_CONFIG = "hf_quant_config.json"
#: Configuration files beside config.json that a format reads.
SIDE_CONFIGS = (MODELOPT_CONFIG,)


@dataclass
class Checkpoint:
    root: Path
    config: dict[str, Any]
    index: dict[str, Any] | None  # the parsed index file, None for a single-file checkpoint
    shards: dict[str, SafetensorsHeader]  # shard file name (relative to root) -> header, in order
    tensors: dict[str, TensorInfo]  # every tensor of the model, shard by shard in data order
    has_data: bool = True  # False when only the headers are known (read from the Hub)
    #: False where the scales' values are on disk but not the weights' codes (a streamed conversion's stand-ins)
    codes_on_disk: bool = True
    warnings: list[str] = field(default_factory=list)  # oddities that do not stop a conversion (see `_warnings`)
    #: Every other readable file of the folder (tokenizer, generation config, license, card...): regular
    #: files inside it, hidden ones and unlisted `*.safetensors` excepted (`_other_files`).
    extra_files: list[str] = field(default_factory=list)
    #: For a checkpoint described before it is written (`has_data` False): a small tensor's values (scales) from
    #: the source bytes it will be made of, or None where that takes more than reading them.
    planned_values: Callable[[str], list[float] | None] | None = None

    def other_files(self) -> list[str]:
        """Every other file of the folder (tokenizer, generation config, license, card...)."""
        return [f for f in self.extra_files if f not in self.model_files]

    def copied_files(self, rewritten: Collection[str]) -> list[str]:
        """The files a conversion copies byte for byte: every other file but the card and the
        `rewritten` config files. Convert copies exactly these and verify checks exactly these."""
        return [f for f in self.other_files() if f != CARD and f not in rewritten]

    @property
    def model_files(self) -> set[str]:
        """Files the conversion rewrites; every other file of the folder is copied."""
        files = set(self.shards) | {CONFIG}
        if self.index is not None:
            files.add(INDEX)
        return files


def first_invalid_scale(values: list[float]) -> float | None:
    """The first value no weight can be recovered from (zero, negative, inf, NaN), or None."""
    if values and 0 < min(values) and max(values) < math.inf and sum(values) == sum(values):
        return None  # all finite and positive, at C speed (a NaN makes the sum NaN; min and max may step over it)
    return next((v for v in values if not 0 < v < math.inf), None)


def scale_bytes(scales: list[TensorInfo], files: SourceFiles) -> Iterator[tuple[TensorInfo, bytes]]:
    """Each scale with its bytes, file by file (in the order each file first appears: a checkpoint's tensors
    are in file order), each file's read in a few large reads (`SourceFiles.prefetch`): a DeepSeek-V3 has 45k
    block grids."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for scale in scales:
        by_file.setdefault(scale.path, []).append(scale)
    for path, in_file in by_file.items():
        files.prefetch(path, [(s.start, s.end) for s in in_file])
        for scale in in_file:
            yield scale, files.read(scale.path, scale.start, scale.end)


def scale_values(scales: list[TensorInfo], files: SourceFiles) -> Iterator[tuple[TensorInfo, list[float]]]:
    """Each scale with its values, read by `scale_bytes`."""
    for scale, data in scale_bytes(scales, files):
        yield scale, decode_floats(data, scale.dtype)


def check_scales(scales: list[TensorInfo], files: SourceFiles) -> None:
    """`check_scale_values` for many scales, read by `scale_bytes`. E8M0 bytes are checked as bytes: each is a
    positive power of two but 255, NaN (an MX model has a scale byte per 32 weights: billions)."""
    for scale, data in scale_bytes(scales, files):
        if scale.dtype == E8M0:
            if E8M0_NAN in data:
                _refuse_invalid(scale, [math.nan])
            continue
        _refuse_invalid(scale, decode_floats(data, scale.dtype))


def check_scale_values(scale: TensorInfo, files: SourceFiles | None = None) -> list[float]:
    """The scale's values, each finite and positive, or a clear error naming the first that is not."""
    values = read_values(scale, files)
    _refuse_invalid(scale, values)
    return values


def _refuse_invalid(scale: TensorInfo, values: list[float]) -> None:
    bad = first_invalid_scale(values)
    if bad is not None:
        raise InvalidCheckpoint(
            f"{scale.path.name}: scale '{scale.name}' holds {bad}; scales must be finite and positive "
            "(fp8fix inspect lists every such scale)"
        )


def known_values(ckpt: Checkpoint, scale: TensorInfo) -> list[float] | None:
    """A scale's values where they can be known without more than reading them: from the file (a folder),
    from the source bytes a planned output makes it of; None for headers only (the Hub) or an unreadable file."""
    if ckpt.has_data:
        try:
            return read_values(scale)
        except OSError:
            return None
    return ckpt.planned_values(scale.name) if ckpt.planned_values is not None else None


def side_config(root: Path) -> Any:
    """hf_quant_config.json beside config.json, parsed; None where the folder has none. (`open_checkpoint`
    has refused one that is a link out of the folder, a FIFO or a device.)"""
    path = root / MODELOPT_CONFIG
    return read_json(path) if path.is_file() else None


def card_front_matter(text: str) -> tuple[set[str], str] | None:
    """(the items of the model card's front-matter `tags:` list, as YAML's block style writes them (`- fp8`);
    the text after the front matter), or None for a card without front matter. What verify checks of the tags
    and `--overwrite` recognises an fp8fix folder by."""
    front, _, body = text.removeprefix("---\n").partition("\n---\n")
    if not text.startswith("---\n") or not body:
        return None
    lines = front.splitlines()
    tags: set[str] = set()
    for line in lines[lines.index("tags:") + 1 :] if "tags:" in lines else []:
        if not line.startswith("- "):
            break
        tags.add(line[2:].strip().strip("'\""))
    return tags, body


def read_json(path: Path, what: str = "") -> Any:
    """A small JSON file (config, index, quantization config), bounded and checked: any problem is one line."""
    try:
        return parse_json(read_regular(path, MAX_FILE_BYTES), keyed=False)  # a key given twice: the last, as json
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{path.name}: missing; {what}" if what else f"{path.name}: missing") from None
    except OSError as e:
        raise InvalidCheckpoint(f"{path.name}: cannot read: {e.strerror or e}") from e
    except JsonRefused as e:
        raise InvalidCheckpoint(f"{path.name}: invalid JSON: {e}") from None


def open_checkpoint(root: Path, role: str = "SOURCE") -> Checkpoint:
    """Read config, index and every shard header of the checkpoint folder `root`; errors name the folder
    and which argument it is (`role`: SOURCE or OUTPUT)."""
    if not root.is_dir():
        what = "no such folder" if not root.exists() else "not a folder"
        raise InvalidCheckpoint(f"{role} {root}: {what}; {role} must be a checkpoint folder with config.json")
    try:
        return _read_checkpoint(root)
    except InvalidCheckpoint as e:
        raise InvalidCheckpoint(f"{role} {root}: {e}") from None


def _read_checkpoint(root: Path) -> Checkpoint:
    tree = _model_files_inside(root, (CONFIG, INDEX, *SIDE_CONFIGS))
    config = read_json(root / CONFIG, "a checkpoint folder needs the model's config.json")
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{CONFIG}: expected a JSON object")
    index = None
    if (root / INDEX).exists():
        index = read_json(root / INDEX, "")
        weight_map = index_weight_map(index)
        index = {**index, "weight_map": weight_map}  # file names normalized: one name per file
        shard_names = sorted(set(weight_map.values()))
    else:
        weight_map = None
        shard_names = _single_file(root)
    shards = {name: read_header(_shard_path(tree, name)) for name in shard_names}
    tensors: dict[str, TensorInfo] = {}
    for name, header in shards.items():
        count = len(tensors)
        tensors.update(header.tensors)
        if len(tensors) != count + len(header.tensors):  # a name of this shard was in an earlier one
            earlier = {t: s.path.name for s in list(shards.values())[: list(shards).index(name)] for t in s.tensors}
            twice = next(t for t in header.tensors if t in earlier)
            raise InvalidCheckpoint(f"tensor '{twice}' is stored twice: in {earlier[twice]} and {name}")
    if weight_map is not None:
        for tensor_name, file in weight_map.items():
            if tensor_name not in shards[file].tensors:
                raise InvalidCheckpoint(
                    f"{INDEX}: maps tensor '{tensor_name}' to {file}, which does not contain it; "
                    "the index does not match the shards"
                )
    extras, warnings = _other_files(tree, set(shards))
    warnings += _warnings(index, tensors)
    return Checkpoint(root, config, index, shards, tensors, warnings=warnings, extra_files=extras)


def _model_files_inside(root: Path, names: tuple[str, ...]) -> SourceTree:
    """The folder's tree, each of the config files `names` that exists refused unless it may be read."""
    tree = SourceTree.of(root)
    for name in names:
        if (root / name).is_symlink() or (root / name).exists():
            tree.require(name)
    return tree


def _other_files(tree: SourceTree, shards: set[str]) -> tuple[list[str], list[str]]:
    """The folder's other files that may be copied, and a warning for each that may not: links out
    of the folder, FIFOs and devices, and `*.safetensors` files the index does not list (a stale
    `model.safetensors` or Mistral's `consolidated.safetensors`: copied unconverted, a loader could
    read them instead of the converted shards)."""
    files, warnings = tree.files()
    kept = []
    for name in files:
        if name.endswith(SHARD_SUFFIX) and name not in shards:
            warnings.append(
                f"{name}: a {SHARD_SUFFIX} file that is not one of the checkpoint's shards; not converted, "
                "not copied to OUTPUT"
            )
        else:
            kept.append(name)
    return kept, warnings


def _warnings(index: Any, tensors: dict[str, TensorInfo]) -> list[str]:
    """What is odd but not wrong enough to refuse: said out loud rather than fixed silently."""
    found: list[str] = []
    if index is not None:
        listed = index["weight_map"]  # each of its tensors is in its shard (checked): equal counts, equal sets
        unlisted = [t for t in tensors if t not in listed] if len(listed) != len(tensors) else []
        if unlisted:
            found.append(
                f"{INDEX}: {len(unlisted)} tensor(s) of the shards are missing from its weight_map "
                f"(first: '{unlisted[0]}'); OUTPUT's index lists them"
            )
        total = (index.get("metadata") or {}).get("total_size")
        actual = sum(t.end - t.start for t in tensors.values())
        if total is not None and total != actual:
            found.append(
                f"{INDEX}: total_size {total!r:.40} is not the {actual} bytes the shards hold; "
                "OUTPUT's index gives the right one"
            )
    return found


def index_weight_map(index: Any) -> dict[str, str]:
    """The index's weight map, each file name checked and normalized (`shard_name`)."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidCheckpoint(f"{INDEX}: has no weight_map object")
    if not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidCheckpoint(f"{INDEX}: weight_map values must be file names")
    if not isinstance(index.get("metadata", {}), (dict, type(None))):
        raise InvalidCheckpoint(
            f"{INDEX}: metadata must be an object (it holds total_size), not {index['metadata']!r:.60}"
        )
    names = {file: shard_name(file) for file in set(weight_map.values())}
    if all(file == name for file, name in names.items()):
        return dict(weight_map)  # every name already normal (the usual index): no second pass over 100k entries
    return {tensor: names[file] for tensor, file in weight_map.items()}


#: The longest file name (one path component) Linux and macOS file systems take, in bytes.
MAX_NAME_BYTES = 255
#: The longest path a shard name may be, in bytes: Linux's PATH_MAX (4096) less room for the folder it is in.
MAX_PATH_BYTES = 3072


def shard_name(name: str) -> str:
    """The index's file name `name` normalized (`./a` and `sub/../a` are `a`: one name per file),
    or an error saying why no shard may be called that: outside the folder, not a `.safetensors`
    file (so never a file fp8fix writes: config.json, the index, README.md), a control character,
    a name longer than a file system takes."""
    shown = repr(name) if len(name) <= 80 else repr(name[:77]) + "..."
    normal = posixpath.normpath(name) if name else ""
    problem = None
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        problem = "holds a control character"
    elif not name or normal.startswith("/") or normal == ".." or normal.startswith("../"):
        problem = "is a path outside the checkpoint folder"
    elif not normal.endswith(SHARD_SUFFIX):
        problem = f"is not a {SHARD_SUFFIX} file (a shard cannot be config.json, the index or README.md)"
    elif any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in normal.split("/")):
        problem = f"has a part longer than the {MAX_NAME_BYTES} bytes a file name can be"
    elif len(normal.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        problem = f"is a path longer than {MAX_PATH_BYTES} bytes, more than a file system takes under a folder"
    if problem:
        raise InvalidCheckpoint(f"{INDEX}: names the file {shown}, which {problem}; refusing to read it")
    return normal


def _shard_path(tree: SourceTree, name: str) -> Path:
    path = tree.root / name
    try:
        missing = not path.exists() and not path.is_symlink()
    except OSError as e:  # a path the file system refuses (too long under this folder, a loop of links)
        raise InvalidCheckpoint(f"{INDEX}: names '{name[:80]}...', which cannot be looked up: {e.strerror}") from None
    if missing:
        raise InvalidCheckpoint(
            f"{INDEX}: names '{name}', which does not exist in {tree.root}; the download is incomplete"
        )
    return tree.require(name)


def _single_file(root: Path) -> list[str]:
    if (root / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if not found:
        raise InvalidCheckpoint(f"{root}: no .safetensors files (fp8fix reads safetensors checkpoints only)")
    raise InvalidCheckpoint(f"{root}: {len(found)} .safetensors files but no {INDEX} to say which belong to the model")


def checkpoint_from_headers(root: Path, headers: dict[str, tuple[dict[str, str], dict[str, Any]]]) -> Checkpoint:
    """A checkpoint whose shard headers came from elsewhere (the Hub's safetensors metadata), without data.

    `headers` maps each shard file to (its __metadata__, {tensor: (dtype, shape, (begin, end))}).
    """
    _model_files_inside(root, (CONFIG, INDEX))
    config = read_json(root / CONFIG, "a checkpoint needs the model's config.json")
    index = read_json(root / INDEX, "") if (root / INDEX).exists() else None
    shards: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for file, (metadata, entries) in sorted(headers.items()):
        infos = {
            name: TensorInfo(name, root / file, dtype, tuple(shape), begin, end)
            for name, (dtype, shape, (begin, end)) in entries.items()
        }
        shards[file] = SafetensorsHeader(root / file, dict(metadata or {}), infos)
        tensors.update(infos)
    return Checkpoint(root, config, index, shards, tensors, has_data=False)
