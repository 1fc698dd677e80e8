"""Text in and out of a checkpoint's tokenizer.json (the `tokenizers` package).

Hazard: a token is not a character. Byte-level BPE splits a multi-byte UTF-8 character across
tokens, and SentencePiece-style decoders change a piece's spelling with its context (a leading
space), so decoding token by token garbles text. Contract: `StreamDecoder.push` returns only
text that decoding cannot change any more: it decodes a short window of recent tokens, and holds
back output that ends in U+FFFD (an incomplete character) until a later token completes it;
`finish()` returns the rest, so the pieces concatenate to `decode(all tokens)`. Cost: each push
decodes the tokens since the last emitted piece plus the window, not the whole output.
"""
from __future__ import annotations

import pathlib

from gpu_worker.checkpoints.paths import CheckpointFiles
from services.common.errors import InvalidArgument

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 64 << 20   # Llama 3's is 9 MiB, Gemma's 33 MiB


class TextCodec:
    """A checkpoint's tokenizer: `encode` text to ids, `decode` ids to text."""

    def __init__(self, path: pathlib.Path, files: CheckpointFiles | None = None) -> None:
        """The tokenizer at `path` (relative to the directory of `files`, the checkpoint's
        sandbox; without `files`, a sandbox of the file's own directory), at most
        MAX_TOKENIZER_BYTES."""
        from tokenizers import Tokenizer
        path = pathlib.Path(path)
        files, rel = (CheckpointFiles(path.parent), path.name) if files is None else (files, str(path))
        data = files.read_bytes(rel, MAX_TOKENIZER_BYTES, "tokenizer")
        try:
            self._tok = Tokenizer.from_buffer(data)
        except Exception as exc:  # noqa: BLE001  (the Rust library raises a bare Exception)
            raise InvalidArgument(f"{files.name(rel)} could not be read as a tokenizer "
                                  f"({str(exc)[:200]})", file=files.name(rel)) from None

    @classmethod
    def for_checkpoint(cls, directory: pathlib.Path,
                       root: pathlib.Path | None = None) -> TextCodec | None:
        """The checkpoint's tokenizer.json, or None when it has none. `root`: the model root
        (the sandbox); by default the directory is its own."""
        files = CheckpointFiles(directory, root)
        return cls(pathlib.Path(TOKENIZER_FILE), files) if files.exists(TOKENIZER_FILE) else None

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with the special tokens (BOS) the tokenizer's post-processor adds."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental, UTF-8 safe decoding of a token stream (see the module docstring)."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._tokens: list[int] = []
        self._prefix = 0   # start of the window whose text is already emitted up to `_read`
        self._read = 0     # tokens whose text has been emitted

    def push(self, tokens: list[int]) -> str:
        self._tokens.extend(int(t) for t in tokens)
        done = self._codec.decode(self._tokens[self._prefix:self._read])
        text = self._codec.decode(self._tokens[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete: wait for the next token
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(done):]

    def finish(self) -> str:
        """The text still held back (possibly an incomplete character, decoded as U+FFFD)."""
        done = self._codec.decode(self._tokens[self._prefix:self._read])
        text = self._codec.decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return text[len(done):] if text.startswith(done) else ""
