"""Chat templates written for the tests in the syntaxes of the model families that call tools natively
(Hermes/Qwen, Llama-3.1, Mistral) or reason in a think block (a DeepSeek-R1-like one), and the forcing
of a reply: a logits processor that lets only the next token of a given text through.

The templates are ours (not the families' files): each renders ``tools``, every history tool call and
tool result in its family's syntax, as the real ones do, and nothing more.
"""

from dataclasses import replace

import numpy as np

# Hermes / Qwen style: tools in the system turn, calls in <tool_call> tags, optional reasoning.
QWEN = """{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call one or more functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer each call with a JSON object in tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif -%}
{%- endif -%}"""

# Llama-3.1 style: headers, tools in the last user turn, a call is {"name", "parameters"}.
LLAMA31 = """{{ bos_token }}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{{ "\n" if not loop.last }}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' -%}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.role == 'user' and loop.last and tools -%}
<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call with its proper arguments.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{{ message.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

# Mistral style: [AVAILABLE_TOOLS] before the last user turn, calls as [TOOL_CALLS][{...}, ...].
MISTRAL = """{{ bos_token }}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' -%}
{%- if message.tool_calls -%}
[TOOL_CALLS][{% for c in message.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]
{%- else %}{{ message.content }}{% endif %}{{ eos_token }}
{%- elif message.role == 'tool' -%}
[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}

{% endif -%}
{%- endfor -%}"""

# DeepSeek-R1 style: ChatML turns, no tools; the generation prompt opens the think block.
R1 = """{%- for message in messages -%}
<|im_start|>{{ message.role }}
{{ message.content.split('</think>')[-1] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif -%}"""

TEMPLATES = {"qwen": QWEN, "llama31": LLAMA31, "mistral": MISTRAL, "r1": R1}


class Script:
    """A logits processor that forces a reply: at completion step k only token ``ids[k]`` keeps its logit
    (then only ``eos``); the grammar's mask comes after it, so a scripted token the grammar forbids leaves
    no token at all, and the sequence ends with the grammar's error."""

    def __init__(self, ids: list, prompt_len: int, eos: int):
        self.ids, self.prompt_len, self.eos = list(ids), prompt_len, eos

    def __call__(self, token_ids, logits):
        k = len(token_ids) - self.prompt_len
        out = np.full(len(logits), -np.inf, np.float32)
        out[self.ids[k] if k < len(self.ids) else self.eos] = 0.0
        return out


def force(st, text):
    """Make the server ``st`` (``app.ServerState``) reply ``text`` (a string, encoded as a raw prompt is:
    control-token strings become their tokens; or a list of token ids) to every request from now on
    (None: the model's own replies again): its engine's ``submit`` puts a :class:`Script` on each sequence,
    after the request's own logits processors."""
    engine = st.engine
    original = getattr(engine, "_unforced_submit", None) or engine.submit
    engine._unforced_submit = original
    if text is None:
        engine.submit = original
        return
    ids = list(text) if isinstance(text, list) else st.tok.encode(text, add_bos=False)

    def submit(seq):
        script = Script(ids, len(seq.job.prompt), st.tok.eos_id)
        seq.job = replace(seq.job, logits_processors=(script,) + seq.job.logits_processors)
        return original(seq)
    engine.submit = submit


# Magistral style: the Mistral template, told to think in a [THINK] block first.
MAGISTRAL = "{{ bos_token }}[SYSTEM_PROMPT]Think in [THINK]...[/THINK] first.[/SYSTEM_PROMPT]" + \
    MISTRAL.removeprefix("{{ bos_token }}")
TEMPLATES["magistral"] = MAGISTRAL

#: The marker vocabulary: SmolLM2's vocabulary with seven of its unused control tokens (<repo_name>, ...)
#: renamed, as real files hold them: Mistral's [TOOL_CALLS] and Magistral's [THINK] / [/THINK] as control
#: tokens (type 3), Qwen's <think> / </think> and <tool_call> / </tool_call> as user-defined ones (type 4).
MARKERS = {3: ("[TOOL_CALLS]", 3), 4: ("[THINK]", 3), 5: ("[/THINK]", 3), 6: ("<think>", 4), 7: ("</think>", 4),
           8: ("<tool_call>", 4), 9: ("</tool_call>", 4)}


def marker_tokenizer(path: str):
    """The Tokenizer of the SmolLM2 file at ``path`` with :data:`MARKERS` in its vocabulary."""
    from _model_util import tokenizer
    from streamattn.text.tokenizer import Tokenizer
    md = dict(tokenizer(path)[0])
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    for i, (text, kind) in MARKERS.items():
        tokens[i], types[i] = text, kind
    md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"] = tokens, types
    return Tokenizer.from_metadata(md)


def use_template(st, name: str | None, markers: bool = False):
    """Render chats on ``st`` with the template ``name`` of :data:`TEMPLATES` (None: the file's own), with
    the marker vocabulary (:func:`marker_tokenizer`) and its grammars when ``markers``."""
    from _model_util import smollm2_path
    from streamattn.engine.grammar import Grammars
    original = getattr(st, "_file_tok", None) or st.tok
    st._file_tok = original
    st._file_grammars = getattr(st, "_file_grammars", None) or st.grammars
    if markers and getattr(st, "_marker_grammars", None) is None:
        st._marker_grammars = Grammars(marker_tokenizer(smollm2_path()))
    base = st._marker_grammars.tok if markers else original
    st.tok = base if name is None else replace(base, chat_template=TEMPLATES[name])
    st.grammars = st._marker_grammars if markers else st._file_grammars
