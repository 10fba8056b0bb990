"""Tokenizer rebuilt from GGUF metadata: round trips, ids against small independent encoders, streaming decode."""

import pytest

from _model_util import (gemma_path, need_gemma, need_smollm2,
                         smollm2_path, tokenizer)
from streamattn.text.tokenizer import StreamDecoder

TEXTS = ["Hello, world!", "The year 2024 had 366 days; 3.14159 is pi.", "emoji 👋🏽 and 日本語 and café",
         "def f(x):\n    return x ** 2  # square\n\tprint(f'{x!r}')", "  leading spaces and trailing  ",
         "mixed: Ünïcödé ✓ ∑ 🤖🚀"]

pytestmark = pytest.mark.usefixtures("one_thread")


def smol():
    return tokenizer(smollm2_path())


def gpt2_reference_encode(text, tokens, merges):
    """Independent byte-level BPE (GPT-2 regex after splitting every digit off), by merge rank."""
    regex = pytest.importorskip("regex")
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    b2u = dict(zip(bs, map(chr, cs)))
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    vocab = {t: i for i, t in enumerate(tokens)}
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids = []
    for part in regex.split(r"(\p{N})", text):
        for word in pat.findall(part):
            sym = [b2u[b] for b in word.encode("utf-8")]
            while len(sym) > 1:
                pairs = [(rank.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(sym, sym[1:]))]
                r, i = min(pairs)
                if r == 1 << 30:
                    break
                sym[i:i + 2] = [sym[i] + sym[i + 1]]
            ids += [vocab[s] for s in sym]
    return ids


@need_smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip_and_reference_ids(text):
    md, tok = smol()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == gpt2_reference_encode(text, md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"])


@need_smollm2
def test_smollm2_known_ids_and_special_tokens():
    _, tok = smol()
    # digits are split one by one; "The capital of France is" as in the model's own vocabulary
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]
    chat = "<|im_start|>user\nHi there<|im_end|>\n"
    ids = tok.encode(chat)
    assert ids[0] == 1 and 2 in ids and tok.decode(ids, skip_special=False) == chat
    assert tok.decode(ids) == "user\nHi there\n"
    assert tok.encode("hello") == tok.encode("hello", add_bos=False)          # SmolLM2: no BOS
    assert tok.stop_ids >= {2, 0}


@need_smollm2
def test_smollm2_chat_template():
    _, tok = smol()
    text = tok.apply_chat([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat([{"content": "x"}])


def stream_pieces(tok, ids):
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@need_smollm2
def test_streaming_decode_never_splits_a_character():
    _, tok = smol()
    text = "Wave 👋🏽, 日本語, naïve café, 🤖🚀!"
    ids = tok.encode(text)
    pieces, tail = stream_pieces(tok, ids)
    assert "".join(pieces) + tail == text
    assert tail == "" and all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 3          # multi-byte characters spread over several tokens were held back
    for p in pieces:                       # each piece is valid text on its own
        p.encode("utf-8")


@need_smollm2
def test_streaming_decode_incomplete_tail_and_specials():
    _, tok = smol()
    ids = tok.encode("🤖")
    assert len(ids) > 1
    pieces, tail = stream_pieces(tok, ids[:-1])
    assert "".join(pieces) == "" and tail == "\ufffd"
    dec = StreamDecoder(tok)
    assert dec.push(2) == ""                                          # <|im_end|> skipped
    assert StreamDecoder(tok, skip_special=False).push(2) == "<|im_end|>"


def spm_reference_encode(text, tokens, scores, types):
    """llama.cpp's SPM rule, independently: merge the adjacent pair whose union has the best score."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    sym = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(sym) - 1):
            j = vocab.get(sym[i] + sym[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]
    byte_id = {tokens[i]: i for i in range(len(tokens)) if types[i] == 6}
    ids = []
    for s in sym:
        ids += [vocab[s]] if s in vocab else [byte_id[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


@need_gemma
@pytest.mark.parametrize("text", TEXTS)
def test_gemma_round_trip(text):
    _, tok = tokenizer(gemma_path())
    ids = tok.encode(text)
    assert ids[0] == 2                                    # Gemma adds <bos>
    assert tok.decode(ids) == text
    pieces, tail = stream_pieces(tok, ids)
    assert "".join(pieces) + tail == text


@need_gemma
@pytest.mark.parametrize("text", ["The capital of France is Paris.", "emoji 👋🏽 and 日本語 and café",
                                  "Numbers 12345 and words"])
def test_gemma_reference_ids(text):
    md, tok = tokenizer(gemma_path())
    ref = spm_reference_encode(text, md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"],
                               md["tokenizer.ggml.token_type"])
    assert tok.encode(text, add_bos=False) == ref


@need_gemma
def test_gemma_builtin_chat_format():
    _, tok = tokenizer(gemma_path())
    text = tok.apply_chat([{"role": "user", "content": "Hi"}])
    assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text)[:3] == [2, 105, 2364]


@need_gemma
def test_gemma_file_config_hybrid_windows():
    from streamattn.gguf.loader import config_from_metadata
    md, _ = tokenizer(gemma_path())
    c = config_from_metadata(md)
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert c.layer_windows == tuple(None if i % 6 == 5 else 512 for i in range(18))
    assert (c.rope_base, c.rope_base_local) == (1e6, 1e4)


@need_smollm2
def test_chat_without_a_template_falls_back_to_chatml():
    import dataclasses
    _, tok = smol()
    bare = dataclasses.replace(tok, chat_template=None)
    want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert bare.apply_chat([{"role": "user", "content": "Hi"}]) == want


def test_token_bytes_of_a_byte_level_vocabulary_read_at_once():
    """The joined, translated read of every token's bytes gives what the per-character map gives: GPT-2's
    alphabet, characters below 256 outside it and above it (both 0), an empty token."""
    from streamattn.text.tokenizer import _BYTE_DECODER, _byte_level_bytes
    tokens = ["ĠHello", "Ċ", "a\u0100b", "\u0143", "\n", "\x7f", "日本", "", "x\udc80y", "ÿ¡®", "\u0144"]
    want = [bytes(_BYTE_DECODER.get(ch, 0) for ch in t) for t in tokens]
    assert _byte_level_bytes(tokens) == want
    assert want[0] == b" Hello" and want[4] == b"\0" and want[6] == b"\0\0"
    assert _byte_level_bytes([]) == []
