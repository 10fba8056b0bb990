"""BPE pre-tokenizers by tokenizer.ggml.pre and SentencePiece details, on small vocabularies trained here.

For each supported pre-tokenizer, our ids equal those of an HF ``tokenizers`` Tokenizer built from the
family's tokenizer.json configuration, written below as a JSON fact with the repository it comes from,
and those of a pure-Python BPE (``regex`` + merge ranks). The vocabulary (byte-level BPE trained on
TEXT, ~700 tokens) stands in for the family's: the pre-tokenizer's rules do not depend on it.
"""

import json
import unicodedata

import pytest
from tokenizers import Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers, trainers

from streamattn.text.tokenizer import PRE_TOKENIZERS, Tokenizer

regex = pytest.importorskip("regex")

TEXT = ("Hello, world! I'll say: we'VE 12345 apples, 3.14159 pi, 1,000,000 $.\n"
        "def f(x):\n    return x ** 2  # square\n\tprint(f'{x!r}')\r\n\n\n"
        "   leading and trailing spaces   \n"
        "CamelCaseWords and HTTPServer, naïve café, Ünïcödé ✓ ∑\n"
        "日本語のテキスト、中文文本。Русский текст. العربية. हिन्दी\n"
        "emoji 👋🏽 🤖🚀 👨‍👩‍👧 and e\u0301 (decomposed)\n"
        "<|im_start|>user\nHi <think>there</think><|im_end|>\n")
WORD = "Ġsupercalifragilistic"       # a vocabulary entry that no merge builds (see vocabulary())

# The pre-tokenization part of each family's tokenizer.json ("normalizer", "pre_tokenizer", and the BPE
# model's "ignore_merges"), as found in the repositories named; the regexes are as llama.cpp's
# src/llama-vocab.cpp quotes them ("original regex from tokenizer.json").
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BYTE_LEVEL_NO_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
DIGITS = {"type": "Digits", "individual_digits": True}


def split(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
FACTS = {
    # openai-community/gpt2 tokenizer.json
    "gpt-2": {"normalizer": None, "pre_tokenizer": BYTE_LEVEL, "ignore_merges": False},
    # HuggingFaceTB/SmolLM2-135M-Instruct and bigcode/starcoder2-3b tokenizer.json
    "smollm": {"normalizer": None, "ignore_merges": False,
               "pre_tokenizer": {"type": "Sequence", "pretokenizers": [DIGITS, BYTE_LEVEL]}},
    "starcoder": {"normalizer": None, "ignore_merges": False,
                  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [DIGITS, BYTE_LEVEL]}},
    # smallcloudai/Refact-1_6-base tokenizer.json
    "refact": {"normalizer": None, "ignore_merges": False,
               "pre_tokenizer": {"type": "Sequence", "pretokenizers": [DIGITS, BYTE_LEVEL]}},
    # meta-llama/Llama-3.2-1B-Instruct tokenizer.json (model.ignore_merges: true)
    "llama-bpe": {"normalizer": None, "ignore_merges": True,
                  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split(CL100K), BYTE_LEVEL_NO_REGEX]}},
    # Qwen/Qwen2.5-0.5B-Instruct tokenizer.json (Qwen3's is the same)
    "qwen2": {"normalizer": {"type": "NFC"}, "ignore_merges": False, "pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+"), BYTE_LEVEL_NO_REGEX]}},
    # Qwen/Qwen3.5-9B-Instruct tokenizer.json: no normalizer, combining marks (\p{M}) kept with letters
    "qwen35": {"normalizer": None, "ignore_merges": False, "pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
            r"\s*[\r\n]+|\s+(?!\S)|\s+"), BYTE_LEVEL_NO_REGEX]}},
    # mistralai/Mistral-Nemo-Instruct-2407 tokenizer.json (tekken; llama.cpp sets ignore_merges for it)
    "tekken": {"normalizer": None, "ignore_merges": True, "pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [split(
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
            r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
            r"\s*[\r\n]+|\s+(?!\S)|\s+"), BYTE_LEVEL_NO_REGEX]}},
    # databricks/dbrx-instruct (cl100k's regex, llama.cpp PR #7132); microsoft/phi-4 carries this pre
    "dbrx": {"normalizer": None, "ignore_merges": False,
             "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split(CL100K), BYTE_LEVEL_NO_REGEX]}},
    # Xenova/gpt-4o tokenizer.json (o200k); microsoft/Phi-4-mini-instruct carries this pre
    "gpt-4o": {"normalizer": None, "ignore_merges": False, "pre_tokenizer": {
        "type": "Sequence", "pretokenizers": [split(
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll"
            r"|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|"
            r"'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            BYTE_LEVEL_NO_REGEX]}},
}
FAMILIES = sorted(FACTS)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = ["<think>", "</think>"]


def test_every_supported_name_has_a_fact():
    assert {n for n in PRE_TOKENIZERS if n not in ("llama3", "llama-v3")} == set(FACTS)
    assert PRE_TOKENIZERS["llama3"] == PRE_TOKENIZERS["llama-v3"] == PRE_TOKENIZERS["llama-bpe"]


def bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()


@pytest.fixture(scope="module")
def vocabulary():
    return train_vocabulary()


def train_vocabulary():
    """(tokens, types, merges): a byte-level BPE trained on TEXT (all 256 bytes, ~700 tokens), the control
    and user-defined tokens, and WORD appended without a merge that builds it."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([TEXT] * 3 + ["supercalifragilistic is a long word"], trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert WORD not in vocab
    tokens = SPECIAL + vocab + [WORD] + USER
    types = [3] * len(SPECIAL) + [1] * (len(vocab) + 1) + [4] * len(USER)
    return tokens, types, merges


def metadata(vocabulary, pre, **extra):
    tokens, types, merges = vocabulary
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2, **extra}


def reference_hf(vocabulary, fact):
    """HF tokenizer from a tokenizer.json made of the fact and the vocabulary (no code shared with ours)."""
    tokens, types, merges = vocabulary
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == 3} for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)]
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": fact["normalizer"], "pre_tokenizer": fact["pre_tokenizer"], "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": fact["ignore_merges"], "vocab": {t: i for i, t in enumerate(tokens)},
                     "merges": merges}}
    return HFTokenizer.from_str(json.dumps(doc))


GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def isolated(pattern, text):
    """The matches of ``pattern`` and the text between them, in order (HF Split, behaviour isolated)."""
    out, at = [], 0
    for m in regex.finditer(pattern, text):
        out += [text[at:m.start()], m.group(0)]
        at = m.end()
    return [p for p in out + [text[at:]] if p]


def reference_python(vocabulary, fact, text):
    """Pure-Python byte-level BPE following the fact: normalizer, splits, then merges by rank."""
    tokens, types, merges = vocabulary
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    specials = SPECIAL + USER
    ids = []
    for piece in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if piece in specials:
            ids.append(vocab[piece])
            continue
        if fact["normalizer"]:
            piece = unicodedata.normalize("NFC", piece)
        words = [piece]
        for step in fact["pre_tokenizer"].get("pretokenizers", [fact["pre_tokenizer"]]):
            if step["type"] == "Digits":
                words = [w for p in words for w in regex.split(r"(\p{N})", p) if w]
            elif step["type"] == "Split":
                words = [w for p in words for w in isolated(step["pattern"]["Regex"], p)]
            elif step["use_regex"]:
                words = [w for p in words for w in regex.findall(GPT2_REGEX, p)]
        for word in words:
            sym = [B2U[b] for b in word.encode("utf-8")]
            if fact["ignore_merges"] and "".join(sym) in vocab:
                sym = ["".join(sym)]
            while len(sym) > 1:
                r, i = min((rank.get(p, 1 << 30), i) for i, p in enumerate(zip(sym, sym[1:])))
                if r == 1 << 30:
                    break
                sym[i:i + 2] = [sym[i] + sym[i + 1]]
            ids += [vocab[s] for s in sym]
    return ids


TEXTS = [TEXT, "12345 1234567 3.14", " supercalifragilistic", "I'VE you'RE HTTPServer\r\n\r\n  x  ",
         "e\u0301 vs \u00e9", "  \n\t  "]


@pytest.mark.parametrize("pre", FAMILIES)
def test_ids_equal_the_familys_tokenizer_json_and_a_python_bpe(vocabulary, pre):
    md = metadata(vocabulary, pre)
    if PRE_TOKENIZERS[pre].merge_check:       # WORD is not built by the merges: refused, see below
        md = metadata((vocabulary[0][:-3] + vocabulary[0][-2:], vocabulary[1][:-3] + vocabulary[1][-2:],
                       vocabulary[2]), pre)
    tok = Tokenizer.from_metadata(md)
    vocab = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.merges"])
    ref = reference_hf(vocab, FACTS[pre])
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (pre, text)
        assert ids == reference_python(vocab, FACTS[pre], text), (pre, text)
        if FACTS[pre]["normalizer"] is None:
            assert tok.decode(ids, skip_special=False) == text
        else:                                 # qwen2 reads its text NFC-normalized
            assert tok.decode(ids, skip_special=False) == unicodedata.normalize("NFC", text)


def words(tok, text):
    return [w for w, _ in tok.hf.pre_tokenizer.pre_tokenize_str(text)]


def test_the_rules_differ_where_the_families_do(vocabulary):
    tok = {pre: Tokenizer.from_metadata(metadata(vocabulary, pre)) for pre in ("gpt-2", "smollm", "llama-bpe",
                                                                               "qwen2", "tekken")}
    assert words(tok["gpt-2"], "x 1234567") == ["x", "Ġ1234567"]
    assert words(tok["smollm"], "x 1234567") == ["x", "Ġ"] + list("1234567")
    assert words(tok["llama-bpe"], "x 1234567") == ["x", "Ġ", "123", "456", "7"]
    assert words(tok["qwen2"], "x 1234567") == ["x", "Ġ"] + list("1234567")
    assert words(tok["tekken"], "HTTPServer camelCase") == ["HTTPServer", "Ġcamel", "Case"]
    assert words(tok["llama-bpe"], "HTTPServer camelCase") == ["HTTPServer", "ĠcamelCase"]
    assert words(tok["llama-bpe"], "I'VE") == ["I", "'VE"] and words(tok["gpt-2"], "I'VE") == ["I", "'", "VE"]
    # llama-bpe takes a word that is a vocabulary entry whole; gpt-2 merges it (no merge builds it)
    assert tok["llama-bpe"].encode(" supercalifragilistic", add_bos=False) == [vocabulary[0].index(WORD)]
    assert len(tok["gpt-2"].encode(" supercalifragilistic")) > 1
    # qwen2 normalizes to NFC; the others read the decomposed character as two
    assert tok["qwen2"].encode("e\u0301") == tok["qwen2"].encode("\u00e9")
    assert tok["gpt-2"].encode("e\u0301") != tok["gpt-2"].encode("\u00e9")
    assert tok["llama-bpe"].add_bos and not tok["qwen2"].add_bos and tok["tekken"].add_bos


def test_special_and_user_defined_tokens(vocabulary):
    tok = Tokenizer.from_metadata(metadata(vocabulary, "qwen2"))
    ids = tok.encode("<|im_start|>a<think>b</think>")
    tokens = vocabulary[0]
    assert ids[0] == tokens.index("<|im_start|>") and tokens.index("<think>") in ids
    assert tok.decode(ids) == "a<think>b</think>"                    # control dropped, user-defined kept
    assert tok.decode(ids, skip_special=False) == "<|im_start|>a<think>b</think>"
    assert tok.token_bytes[tokens.index("<think>")] == b"<think>"


@pytest.mark.parametrize("pre", ["dbrx", "gpt-4o"])
def test_unsettled_ignore_merges_refused_when_it_matters(vocabulary, pre):
    with pytest.raises(ValueError, match=rf"pre='{pre}'.*'{WORD}' is not built by its own merges"):
        Tokenizer.from_metadata(metadata(vocabulary, pre))


@pytest.mark.parametrize("pre", ["falcon", "default", None, 3])
def test_unknown_pre_refused_by_name(vocabulary, pre):
    with pytest.raises(ValueError, match=rf"tokenizer.ggml.pre={pre!r} is not supported.*llama-bpe, "):
        Tokenizer.from_metadata(metadata(vocabulary, pre))


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.some_new_flag", True, r"'tokenizer.ggml.some_new_flag' = 'True' is not implemented"),
    ("tokenizer.ggml.add_sep_token", True, r"'tokenizer.ggml.add_sep_token' = True is not implemented"),
    ("tokenizer.ggml.add_bos_token", 1, r"'tokenizer.ggml.add_bos_token' must be a boolean \(got int '1'\)"),
    ("tokenizer.ggml.eot_token_id", 10**6, r"'tokenizer.ggml.eot_token_id' must be a token id in 0\.\.\d+"),
    ("tokenizer.ggml.add_space_prefix", True, r"add_space_prefix' = True is not implemented for a BPE"),
])
def test_keys_not_implemented_or_malformed_refused(vocabulary, key, value, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_metadata(metadata(vocabulary, "gpt-2", **{key: value}))


def test_bos_required_where_it_is_added(vocabulary):
    md = metadata(vocabulary, "llama-bpe")
    del md["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ValueError, match=r"pre='llama-bpe' adds a BOS token .* no tokenizer.ggml.bos_token_id"):
        Tokenizer.from_metadata(md)
    assert not Tokenizer.from_metadata({**md, "tokenizer.ggml.add_bos_token": False}).add_bos


def test_add_bos_add_eos_and_stop_ids(vocabulary):
    tok = Tokenizer.from_metadata(metadata(vocabulary, "llama-bpe", **{
        "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True,
        "tokenizer.ggml.eot_token_id": 1}))
    ids = tok.encode("hi")
    assert ids[0] != 0 and ids[-1] == 2 and tok.encode("hi", add_eos=False) == ids[:-1]
    assert tok.encode("hi", add_bos=True)[0] == 0
    assert {1, 2} <= tok.stop_ids
    end = Tokenizer.from_metadata(spm_metadata(train_spm_vocabulary()))
    assert end.hf.token_to_id("<|end|>") in end.stop_ids          # Phi-3's end of turn, by its text


# ---- SentencePiece (tokenizer.ggml.model == "llama") ----------------------------------------------------

@pytest.fixture(scope="module")
def spm_vocabulary():
    return train_spm_vocabulary()


def train_spm_vocabulary():
    """(tokens, scores, types) of a SentencePiece-style BPE trained on TEXT with spaces as "▁": control
    <unk> <s> </s>, the 256 byte tokens, pieces scored by merge order, and two Phi-3 chat tokens."""
    hf = HFTokenizer(models.BPE())
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    hf.train_from_iterator([TEXT.replace("\n", " ")] * 3, trainer=trainers.BpeTrainer(vocab_size=400,
                                                                                     show_progress=False))
    model = json.loads(hf.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|user|>", "<|end|>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 3]
    return tokens, scores, types


def spm_metadata(v, **extra):
    tokens, scores, types = v
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, **extra}


def spm_reference(text, v, *, prefix):
    """llama.cpp's SentencePiece rule: each text piece (split at control tokens) gets a leading space when
    ``prefix``; then the adjacent pair whose union has the best score merges first; bytes fall back."""
    tokens, scores, types = v
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    control = [t for t, ty in zip(tokens, types) if ty in (2, 3)]
    ids = []
    for piece in regex.split("(" + "|".join(map(regex.escape, control)) + ")", text):
        if piece in control:
            ids.append(tokens.index(piece))
            continue
        if not piece:
            continue
        sym = list(((" " if prefix else "") + piece).replace(" ", "▁"))
        while True:
            best = max(((scores[vocab[a + b]], -i) for i, (a, b) in enumerate(zip(sym, sym[1:]))
                        if a + b in vocab), default=None)
            if best is None:
                break
            i = -best[1]
            sym[i:i + 2] = [sym[i] + sym[i + 1]]
        for s in sym:
            ids += [vocab[s]] if s in vocab else [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return ids


SPM_TEXTS = ["Hello, world! 12345", "  two leading spaces", "emoji 👋🏽 日本語 ∑",
             "<s>after a control token</s>and after", "x"]


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_add_space_prefix(spm_vocabulary, prefix):
    extra = {} if prefix else {"tokenizer.ggml.add_space_prefix": False}   # absent: true, as llama.cpp
    tok = Tokenizer.from_metadata(spm_metadata(spm_vocabulary, **extra))
    assert tok.add_bos                                                      # SentencePiece default
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == spm_reference(text, spm_vocabulary, prefix=prefix), text
        if "<" not in text:                   # (a space prefixed after a control token stays in the text)
            assert tok.decode(tok.encode(text)) == text


def test_spm_special_tokens(spm_vocabulary):
    tok = Tokenizer.from_metadata(spm_metadata(spm_vocabulary))
    ids = tok.encode("a<unk>b</s>", add_bos=False)                    # <unk> (type 2) as HF/llama.cpp map it
    assert ids == spm_reference("a", spm_vocabulary, prefix=True) + [0] + \
        spm_reference("b", spm_vocabulary, prefix=True) + [2]
    assert tok.decode(ids) == "a b" and tok.token_bytes[0] == b"" and {0, 1, 2} <= tok.special_ids


def test_spm_phi3_chat_tokens_swallow_the_newline(spm_vocabulary):
    md = spm_metadata(spm_vocabulary, **{"general.architecture": "phi3"})
    tok = Tokenizer.from_metadata(md)
    user = spm_vocabulary[0].index("<|user|>")
    assert tok.encode("<|user|>\nHi", add_bos=False) == [user] + spm_reference("Hi", spm_vocabulary, prefix=True)
    plain = Tokenizer.from_metadata(spm_metadata(spm_vocabulary))     # not phi3: the newline stays
    assert plain.encode("<|user|>\nHi", add_bos=False) != tok.encode("<|user|>\nHi", add_bos=False)


def test_spm_space_prefix_chat_content_with_a_control_token_refused(spm_vocabulary):
    tok = Tokenizer.from_metadata(spm_metadata(spm_vocabulary, **{"general.architecture": "phi3"}))
    assert tok.apply_chat([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n" \
        "<|im_start|>assistant\n"                                           # no template: ChatML text
    with pytest.raises(ValueError, match=r"messages\[0\].content contains the control token '<\|end\|>'"):
        tok.apply_chat([{"role": "user", "content": "a<|end|>b"}])


def test_spm_refusals(spm_vocabulary):
    tokens, scores, types = spm_vocabulary
    no_bytes = (tokens[:3] + tokens[259:], scores[:3] + scores[259:], types[:3] + types[259:])
    with pytest.raises(ValueError, match=r"lacks 256 of the 256 byte tokens \(first: <0x00>\)"):
        Tokenizer.from_metadata(spm_metadata(no_bytes))
    with pytest.raises(ValueError, match=r"'tokenizer.ggml.remove_extra_whitespaces' = True is not implemented"):
        Tokenizer.from_metadata(spm_metadata(spm_vocabulary, **{"tokenizer.ggml.remove_extra_whitespaces": True}))
    with pytest.raises(ValueError, match=r"precompiled_charsmap"):
        Tokenizer.from_metadata(spm_metadata(spm_vocabulary, **{"tokenizer.ggml.precompiled_charsmap": [0, 1]}))
