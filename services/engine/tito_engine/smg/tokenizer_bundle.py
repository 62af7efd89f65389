"""GetTokenizer's archive: the model directory's tokenizer files as one ZIP and its SHA-256, the
form SMG fetches (it joins the chunks, checks the digest the last chunk carries, and builds its
tokenizer, chat template and media processor from the files).

The file set is SMG's own (its servicers' list: the tokenizer's files, the model and generation
configs, the chat template, the media processors' configs). Built once per engine, off the event
loop (reading and deflating a large tokenizer takes a fraction of a second), then kept.
"""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tito.errors import FailedPrecondition

FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
         "chat_template.json", "preprocessor_config.json", "processor_config.json",
         "video_preprocessor_config.json")
PATTERNS = ("*.tiktoken", "*.jinja", "*.model")
#: Bytes per GetTokenizerChunk (SMG's chunk size).
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class TokenizerArchive:
    data: bytes
    sha256: str  # hex digest of `data`

    def chunks(self) -> list[bytes]:
        return [self.data[start:start + CHUNK_BYTES] for start in range(0, len(self.data), CHUNK_BYTES)]


def build_archive(model_dir: Path) -> TokenizerArchive:
    buffer = io.BytesIO()
    added: set[str] = set()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        candidates = [model_dir / name for name in FILES]
        candidates += sorted(path for pattern in PATTERNS for path in model_dir.glob(pattern))
        for path in candidates:
            if path.is_file() and path.name not in added:
                archive.write(path, path.name)
                added.add(path.name)
    if not any(name in added for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")):
        raise FailedPrecondition("the model directory holds no tokenizer files to serve; start SMG with "
                                 "--model-path or --tokenizer-path instead", reason="TOKENIZER_UNAVAILABLE")
    data = buffer.getvalue()
    return TokenizerArchive(data, hashlib.sha256(data).hexdigest())


class ArchiveCache:
    """The archive of one model directory, built on first use and kept (the directory is fixed
    for the engine's life). A failed build is not kept: the next call tries again."""

    def __init__(self, model_dir: Path):
        self._model_dir = Path(model_dir)
        self._archive: TokenizerArchive | None = None
        self._lock = threading.Lock()

    def get(self) -> TokenizerArchive:
        with self._lock:
            if self._archive is None:
                self._archive = build_archive(self._model_dir)
            return self._archive
