"""Tokenizer rebuilt from GGUF metadata with HF ``tokenizers``, chat templates, streaming detokenizer.

Two GGUF tokenizer families (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE from ``tokens`` + ``merges``. ``tokenizer.ggml.pre`` names the family's
  pre-tokenizer; :data:`PRE_TOKENIZERS` holds each supported one as the family's tokenizer.json states it
  (SmolLM2's ``smollm``: individual digits, then GPT-2's byte-level split; Llama-3's ``llama-bpe``: one
  regex with digit groups of 1-3, whole-word vocabulary hits first; Qwen2/Qwen3's ``qwen2``: NFC, then a
  regex with single digits; ...). A name outside the table, or no name, is refused: never approximated.
- ``llama``: SentencePiece BPE with byte fallback. GGUF stores pieces and scores but no merges; merges are
  derived the way HF's converter does (every split of a piece into two pieces, ranked by the merged
  piece's score). Spaces become "▁"; ``tokenizer.ggml.add_space_prefix`` (default true, as llama.cpp's)
  prepends one to every text piece (Llama-2, Mistral, Phi-3), false for Gemma.

Control and unknown tokens (types 3, 2) are special: their strings in a raw prompt map to their ids, and
decoding drops them. User-defined tokens (type 4, Qwen3's ``<think>``) are matched in the text the same way but kept in
decoded text. ``tokenizer.ggml.*`` keys this module does not implement are refused by name.

Chat templates: the GGUF's ``tokenizer.chat_template`` is rendered with jinja2 (sandboxed as HF does, and
bounded in time and size: ``streamattn.text.chat_template``) when jinja2 is importable; otherwise, and for files without a template (the Gemma-3 GGUF has none),
a built-in ChatML or Gemma turn format is used, chosen from the vocabulary.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import json
import numbers
import re
import secrets
from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GEMMA_TEMPLATE = "gemma"
CHATML_TEMPLATE = "chatml"


@dataclass(frozen=True)
class PreTokenizer:
    """One family's byte-level BPE rules, as its tokenizer.json states them (``source``).

    ``split``: a regex whose matches, and the text between them, become the words (HF ``Split``, behaviour
    ``isolated``), then mapped to GPT-2's byte alphabet without a further split; None: GPT-2's own regex
    (HF ``ByteLevel(use_regex=True)``). ``digits``: every digit is split off first (HF ``Digits``).
    ``nfc``: the text is NFC-normalized first. ``ignore_merges``: a word that is itself a vocabulary entry
    is that token, whatever the merges would build (tiktoken's rule, HF BPE ``ignore_merges``).
    ``add_bos``: llama.cpp's default when the file has no ``tokenizer.ggml.add_bos_token``.
    ``merge_check``: the family's tokenizer.json is not at hand to say whether ``ignore_merges`` holds;
    the file is accepted only if its vocabulary makes the flag irrelevant (see :func:`_unreachable_token`).
    """

    source: str
    split: str | None = None
    digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False
    merge_check: bool = False


# The regexes are the "original regex from tokenizer.json" that llama.cpp's src/llama-vocab.cpp quotes for
# each pre-tokenizer type (its own copies rewrite (?i:...) for its regex engine; HF's Oniguruma takes them
# as they are). cl100k = GPT-4's regex (tiktoken), taken over by Llama-3 and DBRX.
_CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_LLAMA3 = PreTokenizer("meta-llama/Llama-3.2-1B-Instruct", split=_CL100K, ignore_merges=True, add_bos=True)

# tokenizer.ggml.pre -> rules. The names are the ones llama.cpp's convert_hf_to_gguf.py writes
# (get_vocab_base_pre) for the families streamattn loads, plus llama.cpp's aliases of the same rules.
PRE_TOKENIZERS = {
    "gpt-2": PreTokenizer("openai-community/gpt2"),
    "smollm": PreTokenizer("HuggingFaceTB/SmolLM2-135M-Instruct", digits=True),
    "starcoder": PreTokenizer("bigcode/starcoder2-3b", digits=True),
    "refact": PreTokenizer("smallcloudai/Refact-1_6-base", digits=True),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": PreTokenizer("Qwen/Qwen2.5-0.5B-Instruct (Qwen3 too)", split=_QWEN2, nfc=True),
    "qwen35": PreTokenizer("Qwen/Qwen3.5-9B-Instruct (no NFC: combining marks kept by the regex)",
                           split=_QWEN35),
    "tekken": PreTokenizer("mistralai/Mistral-Nemo-Instruct-2407", split=_TEKKEN, ignore_merges=True,
                           add_bos=True),
    "dbrx": PreTokenizer("databricks/dbrx-instruct, microsoft/phi-4", split=_CL100K, merge_check=True),
    "gpt-4o": PreTokenizer("Xenova/gpt-4o, microsoft/Phi-4-mini-instruct", split=_O200K, merge_check=True),
}

# End-of-turn tokens found by their text, as llama.cpp's src/llama-vocab.cpp does (its end-of-generation
# list) for files that name only EOS: ChatML, Gemma, Llama-3 (eot, eom, end_of_text), Phi-3, DeepSeek.
_STOP_NAMES = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<eos>", "<|eot_id|>", "<|eom_id|>",
               "<|end_of_text|>", "<|end|>", "<｜end▁of▁sentence｜>")

# tokenizer.ggml.* keys that change nothing here (ids of tokens the engine does not insert itself; the
# chat templates are read elsewhere) or that are read below. Any other tokenizer.ggml key is refused.
_KEYS_READ = {"model", "pre", "tokens", "token_type", "scores", "merges", "bos_token_id", "eos_token_id",
              "eot_token_id", "eom_token_id", "unknown_token_id", "add_bos_token", "add_eos_token",
              "add_space_prefix", "add_sep_token", "remove_extra_whitespaces", "precompiled_charsmap"}
_KEYS_WITHOUT_EFFECT = {"padding_token_id", "seperator_token_id", "mask_token_id", "cls_token_id",
                        "token_type_count", "fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id",
                        "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id", "prefix_token_id",
                        "suffix_token_id", "middle_token_id"}


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
# str.translate table: each character of the byte alphabet -> the latin-1 character of its byte, every other
# character below 256 -> "\0" (as _BYTE_DECODER.get(ch, 0)); the alphabet's characters run up to U+0143, and
# _OUTSIDE finds the ones above it (also "\0")
_TO_LATIN1 = {**{i: "\0" for i in range(256)}, **{ord(c): chr(b) for c, b in _BYTE_DECODER.items()}}
_OUTSIDE = re.compile("[^\x00-\u0143]")


def _byte_level_bytes(tokens) -> list:
    """``bytes(_BYTE_DECODER.get(ch, 0) for ch in t)`` of every token, without a Python loop per token or
    character: all tokens joined, translated and encoded in three C calls, then cut at their lengths."""
    whole = _OUTSIDE.sub("\0", "".join(tokens)).translate(_TO_LATIN1).encode("latin-1")
    ends = list(itertools.accumulate(map(len, tokens)))
    return list(map(whole.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def _ids(hf, text: str) -> list:
    """Token ids of ``text`` without special-token insertion. Through ``encode_batch``, which releases
    the GIL while Rust works (``encode`` holds it, and long prompts parsed in server threads stalled the
    event loop; measured: docs/perf/figures-from-docstrings.md), with the same ids."""
    return hf.encode_batch([text], add_special_tokens=False)[0].ids


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
    add_eos: bool = False
    pre: str | None = None      # tokenizer.ggml.pre of a gpt2 file (a key of PRE_TOKENIZERS)
    space_prefix: bool = False  # SentencePiece add_space_prefix: "▁" before every piece of text

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        """Rebuild the tokenizer from GGUF metadata (dict from :func:`streamattn.gguf.metadata.read_metadata`).

        Raises
        ------
        ValueError
            Naming the key and its value: an unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``
            (with the supported ones), a ``tokenizer.ggml.*`` key this class does not implement, or a
            setting it implements only in part (``add_sep_token``, ``remove_extra_whitespaces``, a
            SentencePiece vocabulary without its 256 byte tokens).
        """
        family, tokens, types, pre, rules = _checked(md)
        if family == "gpt2":
            hf, tb = _build_bpe(tokens, types, md, rules)
            add_bos_default = rules.add_bos
        else:
            hf, tb = _build_spm(tokens, types, md)
            add_bos_default = True
        add_bos = _flag(md, "add_bos_token", add_bos_default)
        special = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN))
        eos = _token_id(md, "eos_token_id", len(tokens), 2 if family == "llama" else 0)
        stops = {eos} | {_token_id(md, k, len(tokens), eos) for k in ("eot_token_id", "eom_token_id")}
        for name in _STOP_NAMES:
            i = hf.token_to_id(name)
            if i is not None:
                stops.add(i)
        bos = _token_id(md, "bos_token_id", len(tokens), 1 if family == "llama" else 0)
        return cls(hf=hf, family=family, bos_id=bos, eos_id=eos, add_bos=add_bos,
                   special_ids=special, token_bytes=tb, chat_template=md.get("tokenizer.chat_template"),
                   stop_ids=frozenset(stops), add_eos=_flag(md, "add_eos_token", False), pre=pre,
                   space_prefix=family == "llama" and _flag(md, "add_space_prefix", True))

    @staticmethod
    def check_metadata(md: dict) -> None:
        """Every refusal of :meth:`from_metadata` that the keys decide, with the same messages, without
        building anything: what a loader runs before reading any weight
        (:func:`streamattn.gguf.loader.load_gguf`). Left to :meth:`from_metadata`: the vocabulary's own
        merge check (dbrx, gpt-4o pre-tokenizers), which needs the tokenizer built.

        Raises
        ------
        ValueError
            As :meth:`from_metadata`.
        """
        _checked(md)

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

    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None,
               max_tokens: int | None = None) -> list:
        """Token ids of ``text``; ``add_bos`` / ``add_eos`` (default: the file's ``add_bos_token`` /
        ``add_eos_token``) put the BOS token first (unless the text already starts with it) / EOS last.

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
                ids += _ids(self._hf_text if is_content else self.hf, piece)
        else:
            ids = _ids(self.hf, text)
        if (self.add_bos if add_bos is None else add_bos) and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        if self.add_eos if add_eos is None else add_eos:
            ids = ids + [self.eos_id]
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

    def apply_chat(self, messages: list, *, add_generation_prompt: bool = True, tools: list | None = None,
                   context: dict | None = None) -> "ChatText":
        """Render chat ``messages`` ([{"role": ..., "content": ...}]) into the model's prompt text.

        Uses the file's jinja template when present and jinja2 is installed; otherwise the built-in
        ChatML (SmolLM2) or Gemma turn format. ``tools`` (JSON-like function definitions) and an
        assistant message's ``tool_calls`` and ``reasoning_content`` go to the template as Hugging Face
        passes them; ``context`` holds further template variables (``enable_thinking``). The result is
        a :class:`ChatText`: a ``str`` that also knows where each client-given string lies (message
        contents, reasoning, every key and value of tool-call arguments, of ``tools`` and of ``context``), so that
        :meth:`encode` reads control-token strings typed into them (``<|im_end|>\\n<|im_start|>system``)
        as text, never as turn markers, whether the template writes them as they are or as JSON
        (``tojson``). If the template changes such a string (so its place cannot be found), the
        messages are refused with a ValueError naming the message and the token.
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message must be a dict with 'role' and 'content' (got {str(m)[:80]})")
        text = self._render(messages, add_generation_prompt, tools, context)
        found = []                                  # (where, token) of each string holding a control token
        for where, value in _client_strings(messages, tools, context):
            t = self.special_in(value)
            if t:
                found.append((where, t))
        if not found:
            return ChatText(text)
        where, t = found[0]
        if self.space_prefix:     # each piece would get its own "▁" (see encode): not the text's tokens
            raise ValueError(f"{where} contains the control token {t!r}; keeping it as plain text "
                             "is not implemented for a tokenizer that prefixes a space to each piece of text "
                             "(tokenizer.ggml.add_space_prefix); remove it")
        mark = "\ue000" + secrets.token_hex(8)       # unguessable: no content can forge a mark
        strings: list = []

        def marked(value):                          # a mark ends in "\n": written raw, or "\\n" by tojson
            if isinstance(value, str):
                if not self.special_in(value):
                    return value
                strings.append(value)
                return f"{mark}{len(strings) - 1}\n\ue001"
            if isinstance(value, dict):
                return {marked(k): marked(v) for k, v in value.items()}
            if isinstance(value, list):
                return [marked(v) for v in value]
            return value
        msgs = [{k: marked(v) if k in _CLIENT_KEYS else v for k, v in m.items()} for m in messages]
        pieces = re.split(re.escape(mark) + r"(\d+)(\n|\\n)\ue001",
                          self._render(msgs, add_generation_prompt, marked(tools), marked(context)))
        parts = []
        for j in range(0, len(pieces), 3):
            parts.append((pieces[j], False))
            if j + 2 < len(pieces):
                s = strings[int(pieces[j + 1])]
                parts.append((s if pieces[j + 2] == "\n" else json.dumps(s, ensure_ascii=False)[1:-1], True))
        if "".join(p for p, _ in parts) != text:
            raise ValueError(f"{where} contains the control token {t!r}, and this chat template "
                             "changes message content, so it cannot be kept as plain text; remove it")
        return ChatText(text, tuple(p for p in parts if p[0]))

    def _render(self, messages: list, add_generation_prompt: bool, tools=None, context=None) -> str:
        if self.chat_template:
            from streamattn.text.chat_template import render
            extra = {**(context or {}), **({"tools": tools} if tools is not None else {})}
            try:
                return render(self.chat_template, **extra, messages=messages,
                              add_generation_prompt=add_generation_prompt,
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


def _checked(md: dict) -> tuple:
    """(family, tokens, types, pre, PreTokenizer rules or None) of metadata that passes every check its keys
    decide (:meth:`Tokenizer.check_metadata`), else ValueError naming the key."""
    family = md.get("tokenizer.ggml.model")
    tokens = list(md.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens "
                         f"{len(tokens)}; expected one type per token")
    _check_keys(md)
    pre = rules = None
    if family == "gpt2":
        pre = md.get("tokenizer.ggml.pre")
        rules = PRE_TOKENIZERS.get(pre) if isinstance(pre, str) else None
        if rules is None:
            raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported, so this BPE tokenizer is refused "
                             f"rather than approximated (supported: {', '.join(PRE_TOKENIZERS)})")
        if _flag(md, "add_space_prefix", False):
            raise ValueError("metadata key 'tokenizer.ggml.add_space_prefix' = True is not implemented for a BPE "
                             f"(gpt2) tokenizer with tokenizer.ggml.pre={pre!r}")
    elif family == "llama":
        have = {t for t, ty in zip(tokens, types) if ty == BYTE}
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in have]
        if missing:
            raise ValueError(f"this SentencePiece (tokenizer.ggml.model='llama') vocabulary lacks {len(missing)} "
                             f"of the 256 byte tokens (first: {missing[0]}); tokenizing without byte fallback is "
                             "not implemented")
        _flag(md, "add_space_prefix", True)
        _token_id(md, "unknown_token_id", len(tokens), 0)
    else:
        raise ValueError(f"tokenizer.ggml.model={family!r} is not supported (expected 'gpt2' or 'llama')")
    add_bos = _flag(md, "add_bos_token", rules.add_bos if rules is not None else True)
    if add_bos and family == "gpt2" and "tokenizer.ggml.bos_token_id" not in md:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} adds a BOS token (tokenizer.ggml.add_bos_token absent or "
                         "true) but the file has no tokenizer.ggml.bos_token_id")
    eos = _token_id(md, "eos_token_id", len(tokens), 2 if family == "llama" else 0)
    for key in ("eot_token_id", "eom_token_id"):
        _token_id(md, key, len(tokens), eos)
    _token_id(md, "bos_token_id", len(tokens), 1 if family == "llama" else 0)
    _flag(md, "add_eos_token", False)
    return family, tokens, types, pre, rules


def _check_keys(md: dict) -> None:
    """ValueError naming the first ``tokenizer.ggml.*`` key that is neither read here nor without effect:
    it may change the tokenization (a normalizer, a new flag), so the file is refused, not approximated."""
    unknown = sorted(k for k in md if k.startswith("tokenizer.ggml.")
                     and k[len("tokenizer.ggml."):] not in _KEYS_READ | _KEYS_WITHOUT_EFFECT)
    if unknown:
        raise ValueError(f"metadata key {unknown[0]!r} = {str(md[unknown[0]])[:40]!r} is not implemented by the "
                         "tokenizer; it may change the tokenization, so the file is refused. Keys implemented: "
                         + ", ".join(f"tokenizer.ggml.{k}" for k in sorted(_KEYS_READ | _KEYS_WITHOUT_EFFECT)))
    for key in ("add_sep_token", "remove_extra_whitespaces"):
        if _flag(md, key, False):
            raise ValueError(f"metadata key 'tokenizer.ggml.{key}' = True is not implemented by the tokenizer "
                             "(expected False or absent)")
    if "tokenizer.ggml.precompiled_charsmap" in md:
        raise ValueError("metadata key 'tokenizer.ggml.precompiled_charsmap' (a SentencePiece normalizer) is not "
                         "implemented by the tokenizer")


def _flag(md: dict, key: str, default: bool) -> bool:
    """The boolean ``tokenizer.ggml.<key>``, ``default`` when absent."""
    v = md.get("tokenizer.ggml." + key, default)
    if type(v).__name__ not in ("bool", "bool_"):          # Python's or numpy's
        raise ValueError(f"metadata key 'tokenizer.ggml.{key}' must be a boolean (got {type(v).__name__} "
                         f"{str(v)[:40]!r})")
    return bool(v)


def _token_id(md: dict, key: str, n_tokens: int, default: int) -> int:
    """The token id ``tokenizer.ggml.<key>`` in 0..n_tokens-1, ``default`` when absent."""
    v = md.get("tokenizer.ggml." + key, default)
    if type(v).__name__ in ("bool", "bool_") or not isinstance(v, numbers.Integral) or not 0 <= v < n_tokens:
        raise ValueError(f"metadata key 'tokenizer.ggml.{key}' must be a token id in 0..{n_tokens - 1} (got "
                         f"{type(v).__name__} {str(v)[:40]!r})")
    return int(v)


def _add_tokens(hf: HFTokenizer, tokens, types, *, rstrip=frozenset()) -> None:
    """Add the control and unknown (special) and user-defined (plain) tokens to ``hf``: matched in the raw
    text before any normalization, as llama.cpp's partition of the text on them does (and HF's added
    tokens); ``rstrip``: the ones that swallow the whitespace after them."""
    added = [AddedToken(t, special=ty != USER_DEFINED, normalized=False, rstrip=t in rstrip)
             for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)]
    hf.add_tokens([a for a in added if not a.special])
    hf.add_special_tokens([a for a in added if a.special])


def _build_bpe(tokens, types, md, rules: PreTokenizer):
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                ignore_merges=rules.ignore_merges))
    if rules.merge_check:
        word = _unreachable_token(vocab, merges, tokens, types)
        if word is not None:
            raise ValueError(
                f"tokenizer.ggml.pre={md.get('tokenizer.ggml.pre')!r}: the vocabulary entry {word!r} is not built "
                "by its own merges, so it matters whether a whole word found in the vocabulary is one token "
                "(tiktoken) or is merged (llama.cpp for this pre-tokenizer); that rule is not settled here, so "
                "the tokenizer is refused rather than approximated")
    if rules.split is None:
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        pre = [pre_tokenizers.Split(Regex(rules.split), behavior="isolated", invert=False),
               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if rules.digits:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(pre)
    if rules.nfc:
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    _add_tokens(hf, tokens, types)
    # user-defined tokens are stored as their text, not in the byte alphabet (the converter decodes them)
    tb = _byte_level_bytes(tokens)
    for i in np.flatnonzero(np.isin(np.asarray(types), (CONTROL, UNKNOWN, USER_DEFINED))).tolist():
        tb[i] = b"" if types[i] != USER_DEFINED else tokens[i].encode("utf-8")
    return hf, tb


def _unreachable_token(vocab: dict, merges: list, tokens, types) -> str | None:
    """A normal token that BPE over its own symbols does not build with ``merges``, or None. When there is
    none, ``ignore_merges`` cannot change any word's tokens: a word that is a vocabulary entry merges into
    that entry anyway. (Its cost: docs/perf/figures-from-docstrings.md.)"""
    bare = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    words = [t for t, ty in zip(tokens, types) if ty == NORMAL and len(t) > 1]
    for word, enc in zip(words, bare.encode_batch(words, add_special_tokens=False)):
        if len(enc.ids) != 1:
            return word
    return None


# Phi-3's tokenizer.json marks its chat tokens rstrip (they swallow the newline after them) but not these;
# llama.cpp applies the same rule (src/llama-vocab.cpp, "phi-3" in general.name).
_PHI3_NOT_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


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
    unk = _token_id(md, "unknown_token_id", len(tokens), 0)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=tokens[unk],
                                fuse_unk=True, byte_fallback=True))
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if _flag(md, "add_space_prefix", True):       # llama.cpp's default for SentencePiece files
        # HF's Llama/Phi-3 tokenizer.json: Prepend("▁") to every text piece between added tokens (llama.cpp:
        # a space before the first piece and after every special token), and the decoder drops it again.
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence(decode)
    rstrip = frozenset()
    if md.get("general.architecture") == "phi3":
        rstrip = frozenset(t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)) \
            - _PHI3_NOT_RSTRIP
    _add_tokens(hf, tokens, types, rstrip=rstrip)
    tb = []
    for t, ty in zip(tokens, types):
        if ty in (CONTROL, UNKNOWN, UNUSED):
            tb.append(b"")
        elif ty == BYTE:
            tb.append(bytes([int(t[3:-1], 16)]))
        else:
            tb.append(t.replace("▁", " ").encode("utf-8"))
    return hf, tb


def _trie_pattern(words) -> str:
    """A regex matching any of ``words``, written as a trie (``<(?:end_of_turn|start_of_(?:image|turn))``):
    a flat alternation of Gemma's 6249 control tokens searched far slower (measured:
    docs/perf/figures-from-docstrings.md)."""
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


_CLIENT_KEYS = ("content", "reasoning_content", "tool_calls")     # a message's client-given strings


def _client_strings(messages: list, tools, context) -> list:
    """(where, string) of every client-given string of a chat: message contents and reasoning, every key
    and value of each message's tool calls, of ``tools`` and of the template variables ``context``."""
    out, todo = [], [(f"messages[{i}].{k}", m[k]) for i, m in enumerate(messages) for k in _CLIENT_KEYS if k in m]
    todo += [("tools", tools), ("context", list((context or {}).values()))]
    for where, x in todo:                           # grows as it goes: breadth first, in the chat's order
        if isinstance(x, str):
            out.append((where, x))
        elif isinstance(x, dict):
            todo += [(where, k) for k in x] + [(f"{where}.{k}", v) for k, v in x.items()]
        elif isinstance(x, list):
            todo += [(f"{where}[{j}]", v) for j, v in enumerate(x)]
    return out


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

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True, keep: frozenset = frozenset()):
        """``skip_special``: drop control tokens from the text; ``keep``: the control-token ids whose
        strings are written all the same (a chat reply's markers that the server reads, Mistral's
        ``[TOOL_CALLS]``)."""
        self.tb = tokenizer.token_bytes
        self.special = tokenizer.special_ids - keep if skip_special else frozenset()
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
