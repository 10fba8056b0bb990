"""POST /tokenize and POST /detokenize: the served model's text <-> token ids, in llama-server's shape.

==============  ==========================================================  ================================
route           request                                                     response
==============  ==========================================================  ================================
/tokenize       ``content`` str; ``add_special`` (false: no BOS/EOS),       ``{"tokens": [id, ...]}``, or
                ``parse_special`` (true: ``<|im_start|>`` is one control    with ``with_pieces``
                token; false: text), ``with_pieces`` (false)                ``[{"id", "piece"}, ...]``
/detokenize     ``tokens`` [id, ...]                                        ``{"content": str}``
==============  ==========================================================  ================================

A piece is its token's text, or, where the token's bytes are not valid UTF-8 on their own (a part of a
character), the list of its byte values, as llama-server answers; a control token's piece is its name.
``/detokenize`` renders control tokens as their names, so ``detokenize(tokenize(x)) == x`` for any text
the tokenizer's pieces cover exactly (byte-level BPE: every text).

Bounds, each a 400 naming the field: at most ``MAX_TOKENS`` ids either way (a text longer than that many
tokens is refused from its length before it is tokenized, ``Tokenizer.encode``), every id an integer in
the vocabulary.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from streamattn.serve.protocol import APIError, load_request
from streamattn.text.tokenizer import ChatText, TooLong

#: Token ids one /tokenize answer or one /detokenize request may hold.
MAX_TOKENS = 1 << 18


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)        # as protocol.py's schemas


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int] = Field(max_length=MAX_TOKENS)


def tokenize(body: bytes, tok) -> dict:
    """The /tokenize answer to a request ``body`` (see the module docstring); APIError 400 on bad input."""
    req = load_request(body, TokenizeRequest)
    text = req.content if req.parse_special else ChatText(req.content, ((req.content, True),))
    special = None if req.add_special else False           # None: the file's add_bos_token / add_eos_token
    try:
        ids = tok.encode(text, add_bos=special, add_eos=special, max_tokens=MAX_TOKENS)
    except TooLong:
        raise APIError(400, f"content: more than {MAX_TOKENS} tokens ({len(req.content)} characters); send it "
                       "in parts", param="content", code="invalid_value") from None
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": _piece(tok, i)} for i in ids]}


def detokenize(body: bytes, tok) -> dict:
    """The /detokenize answer to a request ``body``; APIError 400 naming ``tokens.<index>`` for an id
    outside the vocabulary."""
    req = load_request(body, DetokenizeRequest)
    n = tok.vocab_size
    for k, i in enumerate(req.tokens):
        if not 0 <= i < n:
            raise APIError(400, f"tokens.{k}: token ids must be in 0..{n - 1} (got {i})", param=f"tokens.{k}",
                           code="invalid_value")
    return {"content": tok.decode(req.tokens, skip_special=False)}


def _piece(tok, i: int):
    b = tok.token_bytes[i]
    if not b:                                               # a control token: its name
        return tok.hf.id_to_token(i) or ""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


async def tokenize_route(st, body: bytes) -> dict:
    """/tokenize for the server state ``st`` (off the event loop: a long text takes a while)."""
    st.need_ready()
    return await asyncio.to_thread(tokenize, body, st.tok)


async def detokenize_route(st, body: bytes) -> dict:
    """/detokenize for the server state ``st``."""
    st.need_ready()
    return await asyncio.to_thread(detokenize, body, st.tok)
