"""Reading model files: split parts and the model fingerprint.

The fingerprint says "these two machines hold the same model file" without hashing 40 GB at startup. It is
defined here and in the patched ggml-rpc (``rpc-local-gguf.cpp``); the two must agree byte for byte, and a test
checks that they do. Version 1 is SHA-256 over:

    b"mesh-llm-gguf-fp-v1\\0"
    u64 number of parts
    for each part, in order:
        u64 file size, u64 offset of the tensor data section
        the file's bytes [0, data offset)            -- header, metadata, tensor table (names, types, shapes)
        for each tensor, in file order:
            u64 nbytes
            its bytes, whole when nbytes <= 64 KiB, else 16 windows of 4 KiB at j*(nbytes-4096)//15

(integers little-endian). So it changes with any metadata or tensor table change, with the file size, and with
any tensor data that differs in a sampled window. A fine-tune or another quantization changes essentially every
window; a corruption of a few bytes between windows is not seen (downloads are sha256-checked instead). Cost:
the header plus at most 64 KiB per tensor, about 45 MB for a 700-tensor 40 GB model.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from meshllm.errors import UserError

FP_MAGIC = b"mesh-llm-gguf-fp-v1\0"
WINDOW = 4096
WINDOWS = 16
_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


# GGUF value types -> struct format of a scalar (8 string, 9 array are handled apart)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_HEADER = 1 << 30  # refuse absurd headers rather than reading gigabytes of "metadata"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute offset of the data in its file
    nbytes: int


@dataclass
class GGUFHeader:
    """What mesh-llm needs from a GGUF file: scalar metadata (arrays as their length), the tensor table, and
    where the data section starts. Parsed here rather than with gguf.GGUFReader, which takes ~20 s on a
    262k-token vocabulary; this takes a fraction of a second."""

    path: Path
    version: int
    metadata: dict[str, object]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int


class _Cursor:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.buf, self.pos = f, path, b"", 0
        self.base = 0  # file offset of buf[0]

    def _need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        if self.base + self.pos + n > _MAX_HEADER:
            raise UserError(f"{self.path}: GGUF header larger than {_MAX_HEADER >> 20} MiB; refusing it")
        rest = self.buf[self.pos :]
        more = self.f.read(max(n - len(rest), 1 << 20))
        self.base += self.pos
        self.buf, self.pos = rest + more, 0
        if len(self.buf) < n:
            raise UserError(f"{self.path}: truncated GGUF file")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.unpack("<Q")
            self._need(n)
            self.pos += n

    def value(self, vtype: int) -> object:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:
                self.skip_strings(count)
            elif etype in _SCALAR:
                size = struct.calcsize(_SCALAR[etype]) * count
                self._need(size)
                self.pos += size
            else:
                for _ in range(count):  # arrays of arrays: rare, walk them
                    self.value(etype)
            return count
        raise UserError(f"{self.path}: unknown GGUF value type {vtype}")

    @property
    def offset(self) -> int:
        return self.base + self.pos


def _type_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(k): (int(v[0]), int(v[1])) for k, v in GGML_QUANT_SIZES.items()}


def read_header(path: Path) -> GGUFHeader:
    """Parse a GGUF file's header and tensor table. One clear UserError for anything that is not GGUF."""
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        size = path.stat().st_size
        c = _Cursor(f, path)
        try:
            magic = c.unpack("<4s")
        except UserError:
            raise UserError(f"{path}: not a GGUF file (too short)") from None
        if magic != b"GGUF":
            raise UserError(f"{path}: not a GGUF file")
        version = c.unpack("<I")
        if version not in (2, 3):
            raise UserError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.unpack("<I"))
        sizes = _type_sizes()
        raw: list[tuple[str, int, tuple[int, ...], int]] = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.unpack("<I")
            if n_dims > 8:
                raise UserError(f"{path}: tensor {name} has {n_dims} dimensions")
            shape = tuple(c.unpack("<q") for _ in range(n_dims))
            gtype, offset = c.unpack("<I"), c.unpack("<Q")
            raw.append((name, gtype, shape, offset))
        align = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
        data_offset = (c.offset + align - 1) // align * align
    tensors = []
    for name, gtype, shape, offset in raw:
        if gtype not in sizes:
            raise UserError(f"{path}: tensor {name} has unknown type {gtype}")
        blck, tsize = sizes[gtype]
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorInfo(name, gtype, shape, data_offset + offset, n // blck * tsize))
    return GGUFHeader(path, version, meta, tensors, data_offset, size)


def split_paths(first: Path) -> list[Path]:
    """Every part of a model given its first file (``x-00001-of-00003.gguf``), or ``[first]``."""
    first = Path(first)
    n = int(read_header(first).metadata.get("split.count", 1))  # type: ignore[call-overload]
    if n <= 1:
        return [first]
    m = _SPLIT_RE.match(first.name)
    if not m or int(m["idx"]) != 1 or int(m["n"]) != n:
        raise UserError(f"{first}: a split model ({n} parts) must be named <name>-00001-of-{n:05d}.gguf")
    return [first.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _hash_part(h: Any, path: Path, samples: Callable[[int], bytes] | None = None) -> None:
    """One part's share of the fingerprint; ``samples``: each tensor's sampled bytes (by its number in the tensor
    table) from elsewhere than the file (a partial copy holds few of them)."""
    hdr = read_header(path)
    if hdr.data_offset > hdr.file_size:
        raise UserError(f"{path}: truncated GGUF file")
    h.update(struct.pack("<QQ", hdr.file_size, hdr.data_offset))
    with path.open("rb") as f:
        h.update(f.read(hdr.data_offset))
        for i, t in enumerate(hdr.tensors):
            if t.offset + t.nbytes > hdr.file_size:
                raise UserError(f"{path}: tensor {t.name} lies outside the file")
            h.update(struct.pack("<Q", t.nbytes))
            if samples is not None:
                h.update(samples(i))
                continue
            for w_off, w_len in sampled(t):
                f.seek(w_off)
                h.update(f.read(w_len))


def sampled(t: TensorInfo) -> list[tuple[int, int]]:
    """The byte ranges (absolute offset, length) of tensor ``t`` the fingerprint hashes, in order: the whole tensor
    up to 64 KiB, else 16 windows of 4 KiB spread evenly (first and last included)."""
    off, nb = t.offset, t.nbytes
    if nb <= WINDOW * WINDOWS:
        return [(off, nb)]
    return [(off + j * (nb - WINDOW) // (WINDOWS - 1), WINDOW) for j in range(WINDOWS)]


_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The repeating layer a tensor belongs to (``blk.N.…``); None for the rest (embedding, output, norms)."""
    m = _LAYER_RE.match(name)
    return int(m[1]) if m else None


# encoders: embedding models whatever their pooling key says (llama.cpp's architecture names)
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "neo-bert",
                           "modern-bert", "t5encoder", "gemma-embedding"})  # fmt: skip
POOLING_EMBEDDINGS = (1, 2, 3)  # llama.cpp's pooling types mean, cls, last (4, rank, is a reranker's; 0 none)


def is_embedding_model(metadata: dict[str, object]) -> bool:
    """A model that makes embeddings, not text: an encoder architecture, or a pooling type in its
    metadata (``{arch}.pooling_type``: what llama.cpp pools a sequence's vectors with, e.g. Qwen3-Embedding's last)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return False
    pooling = metadata.get(f"{arch}.pooling_type")
    return arch in ENCODER_ARCHS or pooling in POOLING_EMBEDDINGS


def held_with_layer(name: str) -> int | None:
    """The layer a worker's copy holds a tensor for: its own layer, and layer 0 for the token embedding (the first
    worker looks tokens up: patch 0013); None for the rest (the host's: output, norms)."""
    return 0 if name == "token_embd.weight" else layer_of(name)


def model_fingerprint(first: Path, samples: Callable[[int], bytes] | None = None) -> str:
    """The model fingerprint (hex SHA-256) of a GGUF model, all parts included. See the module docstring.
    ``samples`` (a one-part model): each tensor's sampled bytes, given rather than read from the file."""
    parts = split_paths(Path(first))
    h = hashlib.sha256(FP_MAGIC)
    h.update(struct.pack("<Q", len(parts)))
    for p in parts:
        if not p.is_file():
            raise UserError(f"{p}: missing part of a split model")
        _hash_part(h, p, samples)
    return h.hexdigest()


def vocab_signature(hdr: GGUFHeader) -> tuple[object, ...]:
    """What a draft model must share with the main model: tokenizer kind, pre-tokenizer, vocabulary size and
    the special token ids (llama.cpp's speculative decoding needs them to agree)."""
    m = hdr.metadata
    return (
        m.get("tokenizer.ggml.model"), m.get("tokenizer.ggml.pre"), m.get("tokenizer.ggml.tokens"),
        m.get("tokenizer.ggml.bos_token_id"), m.get("tokenizer.ggml.eos_token_id"),
    )  # fmt: skip
