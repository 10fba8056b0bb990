"""Tokenizer rebuilt from GGUF metadata with HF ``tokenizers``, chat templates, streaming detokenizer.

Two GGUF tokenizer families (``tokenizer.ggml.model``):

- ``gpt2`` (SmolLM2): byte-level BPE from ``tokens`` + ``merges``; pre-tokenizer = individual digits,
  then GPT-2 byte-level split (``tokenizer.ggml.pre == "smollm"``). Control tokens (type 3) are special.
- ``llama`` (Gemma-3): SentencePiece BPE with byte fallback. GGUF stores pieces and scores but no
  merges; merges are derived the way HF's converter does (every split of a piece into two pieces,
  ranked by the merged piece's score). Spaces become "▁"; no prefix space.

Chat templates: the GGUF's ``tokenizer.chat_template`` is rendered with jinja2 (sandboxed as HF does, and
bounded in time and size: ``streamattn.text.chat_template``) when jinja2 is importable; otherwise, and for files without a template (the Gemma-3 GGUF has none),
a built-in ChatML or Gemma turn format is used, chosen from the vocabulary.
"""

from __future__ import annotations

import codecs
import functools
import re
import secrets
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GEMMA_TEMPLATE = "gemma"
CHATML_TEMPLATE = "chatml"


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


@dataclass
class Tokenizer:
    """Text <-> token ids for one GGUF model.

    Build with :meth:`from_metadata`. ``token_bytes[i]`` is the raw UTF-8 bytes token i stands for
    (empty for control tokens), used by :class:`StreamDecoder`.
    """

    hf: HFTokenizer
    family: str                 # "gpt2" | "llama"
    bos_id: int
    eos_id: int
    add_bos: bool
    special_ids: frozenset
    token_bytes: list
    chat_template: str | None   # jinja source from the file, or None
    stop_ids: frozenset = frozenset()

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        """Rebuild the tokenizer from GGUF metadata (dict from :func:`streamattn.gguf.metadata.read_metadata`)."""
        family = md.get("tokenizer.ggml.model")
        tokens = list(md.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens; cannot build a tokenizer")
        types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if family == "gpt2":
            hf, tb = _build_bpe(tokens, types, md)
        elif family == "llama":
            hf, tb = _build_spm(tokens, types, md)
        else:
            raise ValueError(f"tokenizer.ggml.model={family!r} is not supported (expected 'gpt2' or 'llama')")
        special = frozenset(i for i, t in enumerate(types) if t == CONTROL)
        eos = int(md.get("tokenizer.ggml.eos_token_id", 0))
        stops = {eos}
        for name in ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<eos>"):
            i = hf.token_to_id(name)
            if i is not None:
                stops.add(i)
        return cls(hf=hf, family=family, bos_id=int(md.get("tokenizer.ggml.bos_token_id", 0)), eos_id=eos,
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", family == "llama")),
                   special_ids=special, token_bytes=tb, chat_template=md.get("tokenizer.chat_template"),
                   stop_ids=frozenset(stops))

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's length in bytes: a text of n bytes is at least n / this many tokens."""
        names = (self.hf.id_to_token(i) or "" for i in self.special_ids)
        return max(1, max(map(len, self.token_bytes), default=1), max((len(n.encode()) for n in names), default=1))

    @functools.cached_property
    def _special_names(self) -> tuple:
        """(trie regex of the control-token strings up to 256 characters or None, the longer ones)."""
        names = {self.hf.id_to_token(i) or "" for i in self.special_ids} - {""}
        short = {n for n in names if len(n) <= 256}
        return (re.compile(_trie_pattern(short)) if short else None), tuple(sorted(names - short))

    @functools.cached_property
    def _hf_text(self) -> HFTokenizer:
        """A copy of ``hf`` that reads special-token strings as plain text (for message content)."""
        hf = HFTokenizer.from_str(self.hf.to_str())
        hf.encode_special_tokens = True
        return hf

    def special_in(self, text: str) -> str | None:
        """The first control-token string (``<|im_end|>``) that ``text`` contains, or None."""
        trie, long = self._special_names
        m = trie.search(text) if trie is not None else None
        return m.group(0) if m else next((n for n in long if n in text), None)

    def encode(self, text: str, *, add_bos: bool | None = None, max_tokens: int | None = None) -> list:
        """Token ids of ``text``.

        A plain string is a raw prompt: control-token strings in it (``<|im_start|>``) map to their ids.
        A :class:`ChatText` from :meth:`apply_chat` keeps its message contents as text: only the chat
        template's own markers become control tokens.

        ``max_tokens``: refuse (:class:`TooLong`, a ValueError) a text of more tokens, without tokenizing
        one whose length alone shows it (more than ``max_tokens * max_token_bytes`` bytes), so the work is
        bounded by ``max_tokens`` and not by the text.
        """
        if max_tokens is not None and len(text) > max_tokens * self.max_token_bytes:
            raise TooLong(f"the text has {len(text)} characters, more than {max_tokens} tokens can hold "
                          f"(at most {self.max_token_bytes} bytes a token)", limit=max_tokens)
        parts = getattr(text, "parts", None)
        if parts:
            ids = []
            for piece, is_content in parts:
                ids += (self._hf_text if is_content else self.hf).encode(piece, add_special_tokens=False).ids
        else:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooLong(f"the text is {len(ids)} tokens, more than {max_tokens}", limit=max_tokens)
        return ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (control tokens dropped unless ``skip_special=False``)."""
        return self.hf.decode(list(map(int, ids)), skip_special_tokens=skip_special)

    def template_family(self) -> str:
        if self.hf.token_to_id("<start_of_turn>") is not None:
            return GEMMA_TEMPLATE
        return CHATML_TEMPLATE

    def apply_chat(self, messages: list, *, add_generation_prompt: bool = True) -> "ChatText":
        """Render chat ``messages`` ([{"role": ..., "content": ...}]) into the model's prompt text.

        Uses the file's jinja template when present and jinja2 is installed; otherwise the built-in
        ChatML (SmolLM2) or Gemma turn format. The result is a :class:`ChatText`: a ``str`` that also
        knows where each message's content lies, so that :meth:`encode` reads control-token strings
        typed into a message (``<|im_end|>\\n<|im_start|>system``) as text, never as turn markers. If the
        template changes a content that holds such a string (so its place cannot be found), the
        messages are refused with a ValueError naming the message and the token.
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message must be a dict with 'role' and 'content' (got {str(m)[:80]})")
        text = self._render(messages, add_generation_prompt)
        found = [(i, self.special_in(m["content"])) for i, m in enumerate(messages)
                 if isinstance(m["content"], str)]
        found = [(i, t) for i, t in found if t]
        if not found:
            return ChatText(text)
        mark = "\ue000" + secrets.token_hex(8)       # unguessable: no content can forge a mark
        marked = [{**m, "content": f"{mark}{i}\ue001"} if isinstance(m["content"], str) else m
                  for i, m in enumerate(messages)]
        pieces = re.split(re.escape(mark) + r"(\d+)\ue001", self._render(marked, add_generation_prompt))
        parts = []
        for j, piece in enumerate(pieces):
            parts.append((piece, False) if j % 2 == 0 else (messages[int(piece)]["content"], True))
        if "".join(p for p, _ in parts) != text:
            i, t = found[0]
            raise ValueError(f"messages[{i}].content contains the control token {t!r}, and this chat template "
                             "changes message content, so it cannot be kept as plain text; remove it")
        return ChatText(text, tuple(p for p in parts if p[0]))

    def _render(self, messages: list, add_generation_prompt: bool) -> str:
        if self.chat_template:
            from streamattn.text.chat_template import render
            try:
                return render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=self.hf.id_to_token(self.bos_id) or "",
                              eos_token=self.hf.id_to_token(self.eos_id) or "")
            except ImportError:   # no jinja2: the built-in formats below
                pass
        if self.template_family() == GEMMA_TEMPLATE:
            out = []
            for m in messages:
                role = "model" if m["role"] == "assistant" else m["role"]
                if role == "system":          # Gemma has no system turn: prepend to the first user turn
                    out.append(f"<start_of_turn>user\n{m['content']}\n\n")
                    continue
                open_turn = out and out[-1].startswith("<start_of_turn>user\n") \
                    and not out[-1].endswith("<end_of_turn>\n")
                if role == "user" and open_turn:
                    out[-1] += f"{m['content']}<end_of_turn>\n"
                    continue
                out.append(f"<start_of_turn>{role}\n{m['content']}<end_of_turn>\n")
            return "".join(out) + ("<start_of_turn>model\n" if add_generation_prompt else "")
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _build_bpe(tokens, types, md):
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if md.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "default", None):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(pre)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    tb = [b"" if ty == CONTROL else bytes(_BYTE_DECODER.get(ch, 0) for ch in t) for t, ty in zip(tokens, types)]
    return hf, tb


def _build_spm(tokens, types, md):
    scores = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: s for t, s, ty in zip(tokens, scores, types) if ty == NORMAL}
    merges = []                                   # HF's SentencePieceExtractor rule
    for piece, score in normal.items():
        local = [(piece[:j], piece[j:], score) for j in range(1, len(piece))
                 if piece[:j] in normal and piece[j:] in normal]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: -m[2])
    unk = int(md.get("tokenizer.ggml.unknown_token_id", 0))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=tokens[unk],
                                fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    tb = []
    for t, ty in zip(tokens, types):
        if ty == CONTROL or ty == UNUSED:
            tb.append(b"")
        elif ty == BYTE:
            tb.append(bytes([int(t[3:-1], 16)]))
        else:
            tb.append(t.replace("▁", " ").encode("utf-8"))
    return hf, tb


def _trie_pattern(words) -> str:
    """A regex matching any of ``words``, written as a trie (``<(?:end_of_turn|start_of_(?:image|turn))``):
    Gemma's 6249 control tokens as one flat alternation took 15 s to search 4 MB, as a trie ~0.1 s."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node) -> str:
        alts = [re.escape(ch) + pattern(node[ch]) for ch in sorted(k for k in node if k)]
        if not alts:
            return ""
        inner = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{inner})?" if "" in node else inner
    return pattern(trie)


class TooLong(ValueError):
    """A text longer than a token limit; ``limit`` is that limit."""

    def __init__(self, msg: str, *, limit: int):
        super().__init__(msg)
        self.limit = limit


class ChatText(str):
    """Rendered chat text that remembers its pieces: ``parts`` is ((text, is_message_content), ...), empty
    when no content holds a control-token string (the whole text then tokenizes as one)."""

    parts: tuple

    def __new__(cls, text: str, parts: tuple = ()):
        s = super().__new__(cls, text)
        s.parts = parts
        return s


class StreamDecoder:
    """Turn a stream of token ids into text pieces that are always whole UTF-8 characters.

    A character that spans several byte-level tokens (an emoji is often 2-4 tokens) is held back
    until its last byte arrives; :meth:`flush` ends the stream (an incomplete tail becomes U+FFFD).

    Examples
    --------
    >>> dec = StreamDecoder(tok)                                 # doctest: +SKIP
    >>> "".join(dec.push(i) for i in tok.encode("héllo 👋")) + dec.flush()
    'héllo 👋'
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tb = tokenizer.token_bytes
        self.special = tokenizer.special_ids if skip_special else frozenset()
        self.tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        token_id = int(token_id)
        if token_id in self.special:
            return ""
        b = self.tb[token_id]
        if not b and token_id in self.tok.special_ids:           # shown special token (skip_special=False)
            return self._dec.decode(b"") + (self.tok.hf.id_to_token(token_id) or "")
        return self._dec.decode(b)

    def flush(self) -> str:
        """Whatever is pending, with an incomplete trailing character replaced by U+FFFD."""
        return self._dec.decode(b"", final=True)
