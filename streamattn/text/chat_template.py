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

``tojson`` is Hugging Face's, not jinja's: keys in their given order and ``<``, ``>``, ``&`` unescaped
(``ensure_ascii`` false), so that tools and tool-call arguments render as the model saw them in training.
"""

from __future__ import annotations

import json
import time

MAX_SECONDS = 2.0
MAX_CHARS = 1 << 20
MAX_RANGE = 10_000


class TemplateError(ValueError):
    """The chat template failed or went past a bound; the message says which."""


_SIZE_FILTERS = ("center", "indent", "format", "replace", "slice", "batch", "tojson", "wordwrap", "truncate")
_SIZE_METHODS = ("center", "ljust", "rjust", "zfill", "expandtabs", "replace", "format", "format_map")
_MAX_INT_BITS = 1 << 12                   # integers a template may build (4096 bits, 1233 digits)
_NUMBER = __import__("re").compile(r"\d+")


def _too_big(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_CHARS


def _check_size_args(name: str, value, args, kwargs) -> None:
    """Refuse, before the work, a single operation whose output size an argument sets past MAX_CHARS:
    ``center(2500000000)``, ``'%2500000000s' % x``, ``'{:>9999999999}'.format(x)``, ``replace`` that
    multiplies a string, ``indent`` of many lines by a wide prefix."""
    nums = [*args, *kwargs.values()]
    if any(_too_big(n) for n in nums):
        raise TemplateError(f"chat template: {name}() with a size over {MAX_CHARS}; refused")
    if name in ("format", "format_map", "%") and isinstance(value, str) \
            and any(int(d) > MAX_CHARS for d in _NUMBER.findall(value) if len(d) > 6):
        raise TemplateError(f"chat template: a format width or precision over {MAX_CHARS}; refused")
    if name == "replace" and isinstance(value, str) and len(args) >= 2 and isinstance(args[0], str) \
            and isinstance(args[1], str):
        grow = value.count(args[0]) * (len(args[1]) - len(args[0])) if args[0] else (len(value) + 1) * len(args[1])
        if len(value) + grow > MAX_CHARS:
            raise TemplateError(f"chat template: replace() would build {len(value) + grow} characters, over "
                                f"{MAX_CHARS}; refused")
    if name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        if len(value) + (value.count("\n") + 1) * w > MAX_CHARS:
            raise TemplateError(f"chat template: indent() would build over {MAX_CHARS} characters; refused")
    if name == "slice" and args and isinstance(args[0], int) and args[0] > MAX_RANGE:
        raise TemplateError(f"chat template: slice({args[0]}) over {MAX_RANGE} slices; refused")


def _checked_result(name: str, out):
    if isinstance(out, (str, list, tuple)) and len(out) > MAX_CHARS:
        raise TemplateError(f"chat template: {name}() built {len(out)} items, over {MAX_CHARS}; refused")
    return out


def _bound_loops(node, jinja2) -> None:
    """Rewrite the parsed template: every ``for`` iterates through ``__bounded_iter`` (the deadline is
    checked on each item: nested loops with empty bodies end in time), and every ``~`` concatenation goes
    through ``__bounded_concat`` (its size is checked before it is built)."""
    from jinja2 import nodes
    for n in node.find_all(nodes.For):
        n.iter = nodes.Call(nodes.Name("__bounded_iter", "load"), [n.iter], [], None, None)
    for parent in node.find_all(nodes.Node):
        for field in parent.fields:
            v = getattr(parent, field, None)
            if isinstance(v, nodes.Concat):
                setattr(parent, field, nodes.Call(nodes.Name("__bounded_concat", "load"), v.nodes, [], None, None))
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    if isinstance(x, nodes.Concat):
                        v[i] = nodes.Call(nodes.Name("__bounded_concat", "load"), x.nodes, [], None, None)


def render(source: str, **context) -> str:
    """Render jinja ``source`` with ``context`` in the bounded sandbox; see the module docstring.

    Raises
    ------
    TemplateError
        Syntax error, an exception raised by the template, past MAX_SECONDS, or output past MAX_CHARS.
    ImportError
        jinja2 is not installed (callers fall back to a built-in format).
    """
    import functools
    import types

    import jinja2
    import jinja2.sandbox

    deadline = time.monotonic() + MAX_SECONDS

    def tick():
        if time.monotonic() > deadline:
            raise TemplateError(f"chat template: rendering took longer than {MAX_SECONDS} s; refused")

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call(self, __context, __obj, *args, **kwargs):
            tick()
            name = getattr(__obj, "__name__", "")
            if isinstance(__obj, (types.BuiltinMethodType, types.MethodType, functools.partial)) \
                    and isinstance(getattr(__obj, "__self__", None), str) and name in _SIZE_METHODS:
                _check_size_args(name, __obj.__self__, args, kwargs)
            elif name in ("format", "format_map"):          # str.format as wrapped by the sandbox
                _check_size_args(name, None, args, kwargs)
            return _checked_result(name or "call", super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            tick()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_size_args("format", obj, (), {})
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
                if isinstance(left, int) and isinstance(right, int) \
                        and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise TemplateError(f"chat template: '*' would build an integer over {_MAX_INT_BITS} bits")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > MAX_CHARS:
                raise TemplateError(f"chat template: '+' would build {len(left) + len(right)} items, over "
                                    f"{MAX_CHARS}")
            if operator == "%" and isinstance(left, str):
                _check_size_args("%", left, right if isinstance(right, tuple) else (right,), {})
            return _checked_result(operator, super().call_binop(context, operator, left, right))

    def bounded_range(*args):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateError(f"chat template: range of {len(r)} items, over {MAX_RANGE}")
        return r

    def bounded_iter(it):
        for x in it:
            tick()
            yield x

    def bounded_concat(*parts):
        parts = [p if isinstance(p, str) else jinja2.utils.soft_str(p) for p in parts]
        if sum(map(len, parts)) > MAX_CHARS:
            raise TemplateError(f"chat template: '~' would build {sum(map(len, parts))} characters, over "
                                f"{MAX_CHARS}")
        return "".join(parts)

    def bounded_lipsum(n=5, html=True, min=20, max=100):
        if not all(isinstance(x, int) for x in (n, min, max)) or n * max > MAX_RANGE:
            raise TemplateError(f"chat template: lipsum(n={n!r}, max={max!r}) over {MAX_RANGE} words; refused")
        return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Hugging Face's filter (transformers' chat template utilities): json.dumps as given
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(msg):
        raise TemplateError(f"chat template: {msg}")

    def guard(name, f):
        @functools.wraps(f)
        def guarded(*args, **kwargs):
            tick()
            skip = 1 + (jinja2.utils._PassArg.from_obj(f) is not None)   # the context and the filtered value
            _check_size_args(name, args[skip - 1] if len(args) >= skip else None, args[skip:], kwargs)
            return _checked_result(name, f(*args, **kwargs))
        return guarded

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.filters = {k: guard(k, f) if k in _SIZE_FILTERS else f for k, f in env.filters.items()}
    env.globals.update(range=bounded_range, raise_exception=raise_exception, lipsum=bounded_lipsum,
                       __bounded_iter=bounded_iter, __bounded_concat=bounded_concat)
    out, size = [], 0
    try:
        tree = env.parse(source)
        _bound_loops(tree, jinja2)
        for piece in env.from_string(tree).generate(**context):
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
