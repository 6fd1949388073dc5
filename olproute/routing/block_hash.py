"""A prompt's blocks named as a vLLM engine names them, so that the router can look a new
prompt up in what the engine says it caches (``olproute.routing.kv_events``).

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``) hashes a prompt's token
ids in full blocks of ``block_size``: block i's hash is ``H((parent, tuple(ids of block
i), None))``, its parent the hash of block i-1, or for the first block ``NONE_HASH =
H(seed)``. ``H`` is the engine's ``--prefix-caching-hash-algo``: ``sha256`` (SHA-256 of
the tuple pickled with protocol 5, vLLM's default) or ``sha256_cbor`` (SHA-256 of its
canonical CBOR). The seed is the engine's ``PYTHONHASHSEED`` when it sets one, else
``"vllm-none-hash"``. The ``xxhash`` algorithms draw a random seed per engine process
unless ``PYTHONHASHSEED`` is set, and need a library of their own; they are refused
(``ValueError``), as is any other name: the engine's hashes would never match. The third
element, the block's extra keys (LoRA, multimodal inputs, ``cache_salt``), is None for
the plain text prompts the router matches: a request carrying those has hashes the
router cannot reproduce, and simply finds nothing cached.

The token ids are the backend's tokenizer's (``tokenizers``' ``tokenizer.json``, loaded
from a local folder, never downloaded): a completion's prompt encoded with its special
tokens (as vLLM encodes it: a BOS where the tokenizer's post-processor adds one), a chat
rendered with the tokenizer's chat template (``tokenizer_config.json``'s
``chat_template``, through Jinja2 as ``transformers`` renders it, with the generation
prompt) and encoded without. ``WordTokenizer`` is the emulator's tokenizer: one id per
whitespace word, so that the emulator and the router agree without a model folder.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from olproute.routing.kv_events import block_key

IntArray = npt.NDArray[np.int64]

HASH_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    """vLLM's block hashes for one hash setting (``algo``, ``seed``: module docstring)."""

    __slots__ = ("_fn", "algo", "none_hash", "seed")

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix-caching hash algorithm {algo!r} cannot be matched by "
                             f"the router (one of {', '.join(HASH_ALGOS)}; xxhash seeds "
                             "itself at random per engine)")
        self.algo = algo
        self.seed = DEFAULT_SEED if seed is None else seed
        self._fn = _sha256_pickle if algo == "sha256" else _sha256_cbor
        self.none_hash = self._fn(self.seed)

    def block(self, parent: bytes | None, ids: Sequence[int]) -> bytes:
        """One full block's hash after ``parent`` (None: the prompt's first block)."""
        return self._fn((parent or self.none_hash, tuple(ids), None))

    def digests(self, ids: Sequence[int], block_size: int,
                max_blocks: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``ids`` (at most ``max_blocks``), in order."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        n = len(ids) // block_size
        if max_blocks is not None:
            n = min(n, max(max_blocks, 0))
        out: list[bytes] = []
        parent: bytes | None = None
        for i in range(n):
            parent = self.block(parent, [int(t) for t in ids[i * block_size:
                                                              (i + 1) * block_size]])
            out.append(parent)
        return out

    def keys(self, ids: Sequence[int], block_size: int,
             max_blocks: int | None = None) -> IntArray:
        """``digests`` as the prefix index's keys (``kv_events.block_key``), read-only."""
        keys = np.fromiter((block_key(d) for d in self.digests(ids, block_size, max_blocks)),
                           dtype=np.int64)
        keys.setflags(write=False)
        return keys


class PromptTokenizer(Protocol):
    """What the router needs of a backend's tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...


class WordTokenizer:
    """The emulator's tokenizer: each whitespace-separated word (``str.split``, as the
    emulator counts a prompt's tokens) is one id, the low 31 bits of its UTF-8 bytes'
    8-byte blake2b; a chat is its messages' ``role: content`` lines. Nothing to load."""

    name = "words"

    def encode(self, text: str) -> list[int]:
        return [int.from_bytes(blake2b(w.encode("utf-8", "surrogatepass"),
                                       digest_size=8).digest(), "little") & 0x7FFFFFFF
                for w in text.split()]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode("\n".join(f"{m.get('role', '')}: {_content(m)}"
                                     for m in messages))


class HfTokenizer:
    """A Hugging Face tokenizer folder's ``tokenizer.json`` (through ``tokenizers``) and
    chat template (``tokenizer_config.json``)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {root}")
        self.name = str(root)
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        self._special = {k: _token_text(config.get(k)) for k in
                         ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._template = None if not isinstance(template, str) else _compile(template)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if self._template is None:
            raise ValueError(f"the tokenizer at {self.name} has no chat template")
        text = self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=True, **self._special)
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def _compile(template: str) -> Any:
    """A chat template compiled as ``transformers`` compiles it (a sandboxed Jinja2
    environment, blocks trimmed, ``raise_exception`` defined)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``"words"`` (``WordTokenizer``) or a local tokenizer folder (``HfTokenizer``)."""
    return WordTokenizer() if spec == "words" else HfTokenizer(spec)


class PromptNamer:
    """A backend's names for a prompt's blocks: its tokenizer, hash setting and block
    size. ``keys`` of a completion's text, of its token ids, or of a chat."""

    __slots__ = ("block_size", "hasher", "tokenizer")

    def __init__(self, tokenizer: PromptTokenizer, hasher: BlockHasher,
                 block_size: int) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.block_size = block_size

    def ids(self, text: str | None, ids: Sequence[int] | None,
            chat: Sequence[Mapping[str, Any]] | None) -> list[int] | None:
        """The prompt's token ids as the backend would see them, or None without a prompt."""
        if chat is not None:
            return self.tokenizer.encode_chat(chat)
        if ids is not None:
            return [int(t) for t in ids]
        return None if text is None else self.tokenizer.encode(text)

    def keys(self, text: str | None, ids: Sequence[int] | None = None,
             chat: Sequence[Mapping[str, Any]] | None = None) -> IntArray | None:
        tokens = self.ids(text, ids, chat)
        return None if tokens is None else self.hasher.keys(tokens, self.block_size)
