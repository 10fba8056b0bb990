"""Rendering a model file's chat template: sandboxed, and bounded in time and in size.

A GGUF carries its chat template as jinja source, so the template is as untrusted as the file. It runs in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to internals, no mutation of the inputs,
as Hugging Face does), and on top of that:

* time: every call, attribute or item lookup and intercepted operator inside the template checks a
  deadline (``MAX_SECONDS``), so nested loops end with an error instead of hanging;
* size: ``range`` yields at most ``MAX_RANGE`` items; ``*`` refuses to build a string or list longer than
  ``MAX_CHARS`` and ``**`` refuses exponents that build huge integers; the output is streamed and
  refused once past ``MAX_CHARS``.

Every failure (a syntax error, ``raise_exception`` from the template, a bound) is a ``ValueError`` whose
message starts with ``chat template:``.
"""

from __future__ import annotations

import time

MAX_SECONDS = 2.0
MAX_CHARS = 1 << 20
MAX_RANGE = 10_000


class TemplateError(ValueError):
    """The chat template failed or went past a bound; the message says which."""


def render(source: str, **context) -> str:
    """Render jinja ``source`` with ``context`` in the bounded sandbox; see the module docstring.

    Raises
    ------
    TemplateError
        Syntax error, an exception raised by the template, past MAX_SECONDS, or output past MAX_CHARS.
    ImportError
        jinja2 is not installed (callers fall back to a built-in format).
    """
    import jinja2
    import jinja2.sandbox

    deadline = time.monotonic() + MAX_SECONDS

    def tick():
        if time.monotonic() > deadline:
            raise TemplateError(f"chat template: rendering took longer than {MAX_SECONDS} s; refused")

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call(self, __context, __obj, *args, **kwargs):
            tick()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            tick()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            tick()
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise TemplateError(f"chat template: exponent {right} is too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                        raise TemplateError(f"chat template: '*' would build {len(seq) * n} items, over "
                                            f"{MAX_CHARS}")
            return super().call_binop(context, operator, left, right)

    def bounded_range(*args):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateError(f"chat template: range of {len(r)} items, over {MAX_RANGE}")
        return r

    def raise_exception(msg):
        raise TemplateError(f"chat template: {msg}")

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(range=bounded_range, raise_exception=raise_exception)
    out, size = [], 0
    try:
        for piece in env.from_string(source).generate(**context):
            size += len(piece)
            if size > MAX_CHARS:
                raise TemplateError(f"chat template: output longer than {MAX_CHARS} characters; refused")
            tick()
            out.append(piece)
    except TemplateError:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - any failure of a file's template, by name
        raise TemplateError(f"chat template: {type(e).__name__}: {e}") from e
    return "".join(out)
