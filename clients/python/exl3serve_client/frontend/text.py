"""Text side of the front end: a model directory's tokenizer (tokenizer.json through Hugging Face
`tokenizers`), its chat template rendered as transformers' apply_chat_template renders it, incremental
detokenization and stop strings.
"""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# The UTF-8 step of codecs' incremental decoder (its BufferedIncrementalDecoder), called directly.
_utf8_decode = codecs.utf_8_decode


class ChatTemplateError(ValueError):
    """The template refused the messages (raise_exception) or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers); renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled with the environment transformers' apply_chat_template uses (sandboxed,
    trim_blocks, lstrip_blocks, loopcontrols, tojson without ASCII escapes, raise_exception,
    strftime_now)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # AddedToken as saved by transformers
        return value.get("content")
    return value


# Unicode's normalization forms shorten a text's UTF-8 by at most this factor: a 4-byte character
# can become one ASCII byte (NFKC of U+1D400 is "A"); composition joins at most three characters
# (Hangul jamo, 9 bytes, into one 3-byte syllable).
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_UNICODE_FORM_SHRINK = 4


def _normalizer_shrink(spec: Optional[dict[str, Any]]) -> Optional[int]:
    """By what factor tokenizer.json's normalizer may shorten a text's UTF-8 at most (1: it cannot);
    None for a normalizer that may remove any amount of it (Strip, Replace, ...)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _UNICODE_FORMS:
        return _UNICODE_FORM_SHRINK
    if kind == "Prepend":
        return 1
    return None


def _pre_tokenizer_keeps_bytes(spec: Optional[dict[str, Any]]) -> bool:
    """Whether the pre-tokenizer splits the text without dropping any of it (a Split or Punctuation
    with behavior Removed drops what it matches), and maps it to byte-level BPE's alphabet."""
    def keeps(p: dict[str, Any]) -> bool:
        kind = p.get("type")
        if kind == "Sequence":
            return all(keeps(q) for q in p.get("pretokenizers") or [])
        if kind in ("Split", "Punctuation"):
            return p.get("behavior") != "Removed"
        return kind in ("ByteLevel", "Digits")

    def has_byte_level(p: dict[str, Any]) -> bool:
        if p.get("type") == "Sequence":
            return any(has_byte_level(q) for q in p.get("pretokenizers") or [])
        return p.get("type") == "ByteLevel"
    return spec is not None and keeps(spec) and has_byte_level(spec)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet of GPT-2's BPE: printable character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ModelTokenizer:
    """tokenizer.json and tokenizer_config.json of a model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = d / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self.chat_template: Optional[str] = template
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        spec = json.loads(self.tokenizer.to_str())
        self.byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self.special_ids = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._bytes: dict[int, bytes] = {}
        self._max_text_bytes_per_token = self._text_bytes_per_token_bound(spec)

    def _text_bytes_per_token_bound(self, spec: dict[str, Any]) -> Optional[int]:
        """The most UTF-8 bytes of a prompt one token can stand for, where the tokenizer allows a
        bound (byte-level BPE whose pre-tokenizer keeps every byte, and no normalizer beyond
        Unicode's forms): the longest token's bytes (an added token's content included) times what
        the normalizer may shorten the text by. None where it allows none."""
        shrink = _normalizer_shrink(spec.get("normalizer"))
        model = spec.get("model") or {}
        if not self.byte_level or model.get("type") != "BPE" or shrink is None or \
                not _pre_tokenizer_keeps_bytes(spec.get("pre_tokenizer")):
            return None
        added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        longest = max((len(self.token_bytes(i)) for i in (model.get("vocab") or {}).values()
                       if i not in added), default=1)
        longest = max([longest, *(len(c.encode("utf-8")) for c in added.values())])
        return shrink * max(longest, 1)

    def min_token_count(self, text: str) -> int:
        """A lower bound of len(encode(text)), known without tokenizing: the text's UTF-8 bytes
        over the most one token can stand for (0 where the tokenizer allows no bound)."""
        per_token = self._max_text_bytes_per_token
        if per_token is None:
            return 0
        return len(text.encode("utf-8", "surrogatepass")) // per_token

    def encode_off_loop(self, text: str, limit: int,
                        add_special_tokens: bool = True) -> tuple[int, Optional[list[int]]]:
        """For a long text, off the event loop (the tokenizer process, tokenizer_process.py):
        encode(text)'s length, and its ids if fewer than `limit` (none made of a text too long to
        use). Through tokenizers' batch call without offsets (encode_batch_fast: half the time of
        encode), which also lets go of the GIL while it tokenizes, where encode holds it."""
        batch = getattr(self.tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21
        if batch is None:
            batch = self.tokenizer.encode_batch
        encoding = batch([text], add_special_tokens=add_special_tokens)[0]
        n = len(encoding)
        return n, (encoding.ids if n < limit else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) gives it."""
        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template (tokenizer_config.json)")
        ctx = {k: v for k, v in self.special_tokens.items() if v is not None}
        ctx.update(kwargs)
        try:
            return compile_chat_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids as apply_chat_template(tokenize=True): the rendering already holds its special
        tokens, so none are added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token contributes to decode(skip_special_tokens=True) (byte-level BPE)."""
        b = self._bytes.get(token_id)
        if b is None:
            if token_id in self.special_ids:
                b = b""
            else:
                tok = self.tokenizer.id_to_token(token_id) or ""
                table = _byte_decoder()
                # As the ByteLevel decoder: a token outside the alphabet stands for its own UTF-8.
                b = bytes(table[c] for c in tok) if all(c in table for c in tok) else tok.encode()
            self._bytes[token_id] = b
        return b

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """One token alone as text (logprobs): its text and its bytes."""
        if self.byte_level:
            b = self.token_bytes(token_id) if token_id not in self.special_ids else \
                (self.tokenizer.id_to_token(token_id) or "").encode()
            return b.decode("utf-8", errors="replace"), b
        s = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s, s.encode()

    def detokenizer(self) -> "Detokenizer":
        return ByteDetokenizer(self) if self.byte_level else DecodeDetokenizer(self)


class Detokenizer:
    """Turns token ids into text piece by piece: no piece ends inside a UTF-8 character, and the
    pieces joined (with finish()) equal decode(all ids, skip_special_tokens=True)."""

    def add(self, token_ids: Iterable[int]) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        raise NotImplementedError


class ByteDetokenizer(Detokenizer):
    """Byte-level BPE: the tokens' bytes through an incremental UTF-8 decoder, which holds back an
    unfinished character and replaces invalid bytes as decode does (U+FFFD per maximal subpart)."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self._tok = tok
        self._held = b""  # an unfinished character's bytes (what codecs' incremental decoder buffers)

    def add(self, token_ids: Iterable[int]) -> str:
        tb = self._tok.token_bytes
        return self.add_bytes(b"".join([tb(t) for t in token_ids]))

    def add_bytes(self, data: bytes) -> str:
        """The text of the next tokens' bytes (the front end's streaming loop calls this directly)."""
        if self._held:
            data = self._held + data
        text, used = _utf8_decode(data, "replace", False)
        self._held = data[used:] if used < len(data) else b""
        return text

    def finish(self) -> str:
        text, _ = _utf8_decode(self._held, "replace", True)
        self._held = b""
        return text


class DecodeDetokenizer(Detokenizer):
    """Any other decoder: decodes the whole output and sends what is new once it no longer ends in
    U+FFFD (an unfinished character). Quadratic in the output length, for tokenizers without a
    byte-level decoder only."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._sent = 0

    def add(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd") or len(text) < self._sent:
            return ""
        out, self._sent = text[self._sent:], len(text)
        return out

    def finish(self) -> str:
        text = self._tok.decode(self._ids)
        out, self._sent = text[self._sent:], len(text)
        return out


class StopMatcher:
    """Stop strings over streamed text: holds back a tail that could begin a stop string, and cuts
    the text before the first stop string found (which is not returned)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._text = ""
        self._sent = 0
        self.stopped = False

    def push(self, piece: str, final: bool = False) -> str:
        """Adds text; returns what may be sent now. After a stop string, stopped is True."""
        if self.stopped:
            return ""
        self._text += piece
        if not self.stops:
            out, self._sent = self._text[self._sent:], len(self._text)
            return out
        # A match cannot begin in text already sent: that text had no tail starting a stop string.
        window_from = self._sent
        cut = -1
        for s in self.stops:
            i = self._text.find(s, window_from)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            out = self._text[self._sent:cut]
            self._sent = cut
            return out
        end = len(self._text)
        if not final:
            for k in range(min(self._longest - 1, end - self._sent), 0, -1):
                tail = self._text[end - k:]
                if any(s.startswith(tail) for s in self.stops):
                    end -= k
                    break
        out, self._sent = self._text[self._sent:end], end
        return out
