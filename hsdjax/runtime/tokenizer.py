"""Text <-> token ids for hsdjax models, without torch or transformers.

A GGUF file carries no ``tokenizer.json``; it stores the vocabulary, the BPE merges, the token types
and the special token ids as metadata under llama.cpp's key names (``tokenizer.ggml.*``). This module
rebuilds a Hugging Face ``tokenizers`` byte-level BPE tokenizer from those fields, splitting text with
the pre-tokenizer that ``tokenizer.ggml.pre`` names (as llama.cpp does), and renders the file's chat
template with jinja2 the way transformers' ``apply_chat_template`` does.

Ids match transformers' GGUF tokenizer except where transformers does not know the ``pre`` type:
for ``smollm`` (StarCoder-style vocabularies) every digit is split off first, as in llama.cpp and in
SmolLM's own tokenizer.json, while transformers applies GPT-2's pattern alone, so the two differ on
numbers after whitespace runs (``"  1"`` is ``ĠĠ 1`` here, ``Ġ Ġ 1`` there) and on non-ASCII numerals.

Building a 49k-token vocabulary takes ~0.15 s and a 152k one ~0.4 s, and loading a serialized
``tokenizer.json`` of the same size is no faster, so nothing is cached on disk. ``gguf.GGUFReader``
is slow on big vocabularies (it makes numpy views for every string: ~3 s for SmolLM2's 49k tokens,
~10 s for Qwen2.5's 152k), so :meth:`Tokenizer.from_gguf` walks the key/value section itself and
decodes only the ``tokenizer.*`` keys (~0.2 s); :meth:`Tokenizer.from_gguf_reader` takes a reader a
caller already has open.

:class:`IncrementalDecoder` turns a stream of generated ids into text without ever splitting a
multi-byte UTF-8 character.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import mmap
import numbers
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from hsdjax.errors import HsdjaxError

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn or a document; those present in a vocabulary join eos in `stop_ids`.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)

# Split patterns for byte-level BPE, by llama.cpp pre-tokenizer family. These are the patterns the
# models' own tokenizer.json files use (Oniguruma syntax, as `tokenizers` expects).
_SPLIT_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_SPLIT_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> family. "gpt2": GPT-2's own pattern; "digits": every digit on its own,
# then GPT-2's pattern (StarCoder-style vocabularies such as SmolLM's); otherwise a split pattern.
_PRE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), "llama3"),
    **dict.fromkeys(
        ("falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe", "chatglm-bpe"), "llama3-merges"
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "f2llmv2"), "qwen2"),
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), "gpt4o"),
}
_FAMILY_SPLITS = {
    "llama3": _SPLIT_LLAMA3,
    "llama3-merges": _SPLIT_LLAMA3,
    "qwen2": _SPLIT_QWEN2,
    "tekken": _SPLIT_TEKKEN,
    "gpt4o": _SPLIT_GPT4O,
}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The pre-tokenizer for ``tokenizer.ggml.pre`` and whether BPE should ignore merges for whole words."""
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with GPT-2's pattern", pre)
        family = "gpt2"
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True), False
    if family == "digits":
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            False,
        )
    split = pre_tokenizers.Split(Regex(_FAMILY_SPLITS[family]), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, byte_level]), family == "llama3"


def _build_byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int] | None,
    pre: str,
    add_prefix_space: bool = False,
) -> _Backend:
    """A byte-level BPE ``tokenizers.Tokenizer`` whose ids are the GGUF token indices."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    types = list(token_types) if token_types is not None and len(token_types) == len(tokens) else None
    vocab: dict[str, int] = {}
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for index, token in enumerate(tokens):
        kind = types[index] if types is not None else _NORMAL
        if kind == _CONTROL:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
        elif not spelled.issuperset(token):
            # A plain token stored as real text rather than in the byte alphabet: respell it.
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if sep:
            pairs.append((left, right))
    pre_tokenizer, ignore_merges = _pre_tokenizer(pre, add_prefix_space)
    backend = _Backend(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


# GGUF value types (gguf.GGUFValueType) -> struct format of one value.
_GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _NotLittleEndianGGUF(Exception):
    """A GGUF this reader does not walk (big-endian or an old version); GGUFReader handles it."""


def _read_gguf_metadata(path: Path, prefix: str = "tokenizer.") -> dict[str, Any]:
    """Decode the metadata keys starting with ``prefix`` from a GGUF file, skipping over the rest.

    Values come out as ``GGUFReader.fields[key].contents()`` gives them (str, int, float, bool, lists).
    """
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise HsdjaxError(f"{path} is not a readable GGUF file: bad magic {bytes(buf[:4])!r}")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise _NotLittleEndianGGUF(version)
        _, kv_count = struct.unpack_from("<QQ", buf, 8)
        offset = 24

        def read_string() -> str:
            nonlocal offset
            (length,) = struct.unpack_from("<Q", buf, offset)
            offset += 8 + length
            return buf[offset - length : offset].decode("utf-8", "replace")

        def skip_string() -> None:
            nonlocal offset
            offset += 8 + struct.unpack_from("<Q", buf, offset)[0]

        def read_value(kind: int, keep: bool) -> Any:
            nonlocal offset
            if kind == _GGUF_STRING:
                if keep:
                    return read_string()
                skip_string()
                return None
            if kind == _GGUF_ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, offset)
                offset += 12
                if item_kind in _GGUF_FORMATS:
                    fmt = f"<{count}{_GGUF_FORMATS[item_kind]}"
                    values = list(struct.unpack_from(fmt, buf, offset)) if keep else None
                    offset += struct.calcsize(fmt)
                    return values
                if item_kind == _GGUF_STRING:
                    if keep:
                        return [read_string() for _ in range(count)]
                    for _ in range(count):
                        skip_string()
                    return None
                values = [read_value(item_kind, keep) for _ in range(count)]
                return values if keep else None
            fmt = "<" + _GGUF_FORMATS[kind]
            (value,) = struct.unpack_from(fmt, buf, offset)
            offset += struct.calcsize(fmt)
            return value

        out: dict[str, Any] = {}
        try:
            for _ in range(kv_count):
                key = read_string()
                (kind,) = struct.unpack_from("<I", buf, offset)
                offset += 4
                keep = key.startswith(prefix)
                value = read_value(kind, keep)
                if keep:
                    out[key] = value
        except (struct.error, KeyError) as exc:
            raise HsdjaxError(f"{path} is not a readable GGUF file: corrupt metadata ({exc})") from exc
        return out


def _valid_id(value: Any, size: int) -> int | None:
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < size else None


def _make_generation_extension() -> type:
    """A jinja extension that renders ``{% generation %}`` blocks (assistant-mask markers) as plain text."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    return GenerationBlock


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in a sandbox configured like transformers' (cached per template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_make_generation_extension(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise HsdjaxError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc


def _plain(value: Any) -> Any:
    """A copy of template input made of plain dicts, lists and scalars."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    return value


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys and alias reasoning fields, as transformers does before rendering."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise HsdjaxError(f"chat messages must be dicts, got {type(message).__name__}")
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class Tokenizer:
    """A byte-level BPE tokenizer (HF ``tokenizers`` backend) plus the model's special ids and chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        source: str = "",
    ) -> None:
        self._backend = backend
        self._vocab_size = int(vocab_size) if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._unk_id = unk_id
        self._pad_id = pad_id
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.chat_template = chat_template or None
        self.source = source
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        stops: list[int] = [] if eos_id is None else [eos_id]
        for token in _END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                stops.append(token_id)
        stops.extend(int(i) for i in extra_stop_ids)
        self._stop_ids = tuple(dict.fromkeys(stops))
        self._token_bytes: list[bytes] | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's metadata."""
        path = Path(path)
        if not path.is_file():
            raise HsdjaxError(f"GGUF file not found: {path}")
        try:
            metadata = _read_gguf_metadata(path)
        except _NotLittleEndianGGUF:
            import gguf

            try:
                reader = gguf.GGUFReader(path)
            except Exception as exc:  # bad magic, truncated file...
                raise HsdjaxError(f"{path} is not a readable GGUF file: {exc}") from exc
            return cls.from_gguf_reader(reader, source=str(path))
        except (OSError, ValueError) as exc:  # empty file (mmap), unreadable file
            raise HsdjaxError(f"{path} is not a readable GGUF file: {exc}") from exc
        return cls._from_metadata(metadata.get, str(path))

    @classmethod
    def from_gguf_reader(cls, reader: Any, source: str = "") -> Tokenizer:
        """Build the tokenizer from an open ``gguf.GGUFReader`` (for a caller that already has one)."""
        source = source or str(getattr(getattr(reader, "data", None), "filename", "") or "GGUF")
        return cls._from_metadata(lambda key: _gguf_value(reader, key), source)

    @classmethod
    def _from_metadata(cls, get: Callable[[str], Any], source: str) -> Tokenizer:
        model = get("tokenizer.ggml.model")
        tokens = get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise HsdjaxError(f"{source} has no tokenizer metadata (tokenizer.ggml.model/tokens missing)")
        if model != "gpt2":
            raise HsdjaxError(
                f"{source}: tokenizer model {model!r} is not supported (hsdjax reads byte-level BPE, 'gpt2')"
            )
        merges = get("tokenizer.ggml.merges")
        if not merges:
            raise HsdjaxError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
        pre = get("tokenizer.ggml.pre") or "default"
        backend = _build_byte_level_bpe(
            tokens, merges, get("tokenizer.ggml.token_type"), pre, bool(get("tokenizer.ggml.add_space_prefix"))
        )
        size = len(tokens)
        add_bos = get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default: only Llama-3-style vocabularies add BOS
            add_bos = _PRE_FAMILIES.get(pre) == "llama3"
        return cls(
            backend,
            bos_id=_valid_id(get("tokenizer.ggml.bos_token_id"), size),
            eos_id=_valid_id(get("tokenizer.ggml.eos_token_id"), size),
            unk_id=_valid_id(get("tokenizer.ggml.unknown_token_id"), size),
            pad_id=_valid_id(get("tokenizer.ggml.padding_token_id"), size),
            add_bos=bool(add_bos),
            add_eos=bool(get("tokenizer.ggml.add_eos_token")),
            chat_template=get("tokenizer.chat_template"),
            extra_stop_ids=[
                i
                for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                if (i := _valid_id(get(key), size)) is not None
            ],
            vocab_size=size,
            source=source,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a local Hugging Face folder (tokenizer.json, tokenizer_config.json, optional chat_template.jinja)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise HsdjaxError(f"{folder} has no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:
            raise HsdjaxError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template: Any = None
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: take the default one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
                template = named.get("default") or next(iter(named.values()), None)

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        # What the post-processor adds around a text tells whether the model wants BOS/EOS.
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and full[:start] == [bos_id]
        add_eos = config.get("add_eos_token")
        if add_eos is None:
            add_eos = eos_id is not None and full[start + len(plain) :] == [eos_id]
        generation = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = generation if isinstance(generation, list) else [] if generation is None else [generation]
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=token_id("unk_token"),
            pad_id=token_id("pad_token"),
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            chat_template=template if isinstance(template, str) else None,
            extra_stop_ids=[int(i) for i in extra],
            source=str(folder),
        )

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the GGUF vocabulary length, which matches the embedding rows)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, if the model has one."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, if the model has one."""
        return self._eos_id

    @property
    def unk_id(self) -> int | None:
        """Unknown-token id, if any."""
        return self._unk_id

    @property
    def pad_id(self) -> int | None:
        """Padding id, if any."""
        return self._pad_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, then end-of-turn/document tokens present in the vocabulary."""
        return self._stop_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens, the ones ``skip_special_tokens`` drops."""
        return self._special_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self.chat_template is not None

    @property
    def fingerprint(self) -> str:
        """sha256 of everything that decides token ids: the vocabulary and merges, the special ids, BOS
        handling and the chat template (recorded answers are bound to it)."""
        parts = [self._backend.to_str(), repr((self.vocab_size, self.bos_id, self.eos_id, self.add_bos,
                                               self.add_eos, self.stop_ids)), self.chat_template or ""]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary (special tokens as written), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of an id, or None."""
        return self._backend.id_to_token(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, add_bos={self.add_bos}, chat_template={self.has_chat_template})"
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it are matched whole.

        ``add_special_tokens`` adds BOS (and EOS) only where the model asks for them (``add_bos``/``add_eos``).
        """
        ids = _encode_texts(self._backend, [text])[0]
        if add_special_tokens:
            if self.add_bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if self.add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD and unknown ids are ignored."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token decodes to (byte-level tokenizers only; b"" for unknown ids)."""
        if not self._byte_level:
            raise HsdjaxError("token_bytes needs a byte-level tokenizer")
        table = self._bytes_table()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def _bytes_table(self) -> list[bytes]:
        if self._token_bytes is None:
            to_byte = _char_to_byte()
            vocab = self._backend.get_vocab(with_added_tokens=True)
            table = [b""] * (max(vocab.values(), default=-1) + 1)
            for token, index in vocab.items():
                # Mirrors the ByteLevel decoder: a token with any character outside the byte
                # alphabet decodes to its own UTF-8 bytes.
                try:
                    table[index] = bytes(to_byte[c] for c in token)
                except KeyError:
                    table[index] = token.encode("utf-8")
            self._token_bytes = table
        return self._token_bytes

    # ------------------------------------------------------------------ chat

    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``unk_token``/``pad_token`` strings, as chat templates see them."""
        out = {}
        for name, token_id in (("bos_token", self._bos_id), ("eos_token", self._eos_id),
                               ("unk_token", self._unk_id), ("pad_token", self._pad_id)):
            token = None if token_id is None else self._backend.id_to_token(token_id)
            if token is not None:
                out[name] = token
        return out

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation with the model's chat template (as transformers' ``apply_chat_template``).

        Extra keyword arguments (``tools``, ``documents``, ``enable_thinking``...) are passed to the template.
        """
        if self.chat_template is None:
            raise HsdjaxError(f"{self.source or 'this model'} has no chat template")
        import jinja2

        template = _compile_template(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self.special_tokens_map())
        variables.update({k: _plain(v) for k, v in kwargs.items()})
        try:
            return template.render(
                messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise HsdjaxError(f"chat template error: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself, none is added).

        Special tokens come from the template only: special-token text inside the messages or the
        template variables (a user typing ``<|im_end|>``) is encoded as plain text. Without such text
        the ids are exactly ``encode(apply_chat_template(...))``.
        """
        if not self._special_ids:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))
        # Hide special-token text in the input behind markers while the template renders, split the
        # result at the (template's) special tokens, then put the text back and encode it as plain text.
        specials = self._special_split
        nonce = uuid.uuid4().hex
        tokens = sorted(self._special_to_id)
        marker = {t: f"\ue000{nonce}:{i}\ue001" for i, t in enumerate(tokens)}
        unmark = re.compile(f"\ue000{nonce}:(\\d+)\ue001")

        def hide(text: str) -> str:
            return specials.sub(lambda m: marker[m[0]], text)

        text = self.apply_chat_template(_map_strings(messages, hide), add_generation_prompt,
                                        **_map_strings(kwargs, hide))
        pieces = specials.split(text)  # text, special, text, special, ..., text
        texts = [unmark.sub(lambda m: tokens[int(m[1])], p) for p in pieces[::2]]
        plain = _encode_texts(self._plain_backend, texts)
        ids = list(plain[0])
        for special, after in zip(pieces[1::2], plain[1:]):
            ids.append(self._special_to_id[special])
            ids += after
        return ids

    @functools.cached_property
    def _special_to_id(self) -> dict[str, int]:
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def _special_split(self) -> re.Pattern[str]:
        """Matches special-token text, longest token first (as the backend matches added tokens)."""
        tokens = sorted(self._special_to_id, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, tokens)) + ")")

    @functools.cached_property
    def _plain_backend(self) -> _Backend:
        """A copy of the backend that encodes special-token text as plain text."""
        backend = _Backend.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend


def _encode_texts(backend: _Backend, texts: list[str]) -> list[list[int]]:
    """Ids of each text, no BOS/EOS added. ``encode_batch`` releases the GIL (``encode`` holds it,
    ~0.6 s per MB of text), so a server thread tokenizing a long prompt does not stall the others."""
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """``value`` with ``fn`` applied to every string in it (dict values, list items; keys kept)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HsdjaxError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


class IncrementalDecoder:
    """Streams text for generated ids without splitting a multi-byte UTF-8 character.

    ``push`` returns only the newly completed text; an incomplete character at the end is held back
    until the bytes that finish it arrive (or ``flush``). The concatenation of every ``push`` and the
    final ``flush`` equals ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_level = tokenizer._byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Fallback for non-byte-level decoders: ids since the last emitted boundary.
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated ids; return the text they complete."""
        ids = [int(token_ids)] if isinstance(token_ids, numbers.Integral) else [int(t) for t in token_ids]
        if not self._byte_level:
            return self._push_generic(ids)
        table = self._tokenizer._bytes_table()
        special = self._tokenizer._special_ids if self._skip else frozenset()
        size = len(table)
        data = b"".join(table[i] for i in ids if 0 <= i < size and i not in special)
        return self._utf8.decode(data, final=False) if data else ""

    def flush(self) -> str:
        """Return whatever is held back (incomplete bytes become U+FFFD) and reset the decoder."""
        if not self._byte_level:
            text = self._decode(self._ids[self._prefix :])[len(self._decode(self._ids[self._prefix : self._read])) :]
            self._ids, self._prefix, self._read = [], 0, 0
            return text
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _push_generic(self, ids: list[int]) -> str:
        # Decode a short window of ids and emit what grew past the text already emitted from it.
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
