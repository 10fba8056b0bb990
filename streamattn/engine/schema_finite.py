"""Whether a JSON schema admits any finite document: the check that refuses a schema before decoding.

llguidance compiles a schema whose every value must contain another value of the same schema (an object
whose required property refers back to the object, an array whose ``minItems`` >= 1 items do) and a
``$ref`` cycle with no content; the first then fails a few tokens into decoding ("too many items"), the
second matches nothing. Neither has a finite valid document, so no completion can be both complete and
valid: such a schema is refused up front by name, never decoded.

The check is the classic "productive nonterminal" computation of context-free grammars, over the schema:
a subschema is *productive* when some finite JSON value validates against it, as far as the keywords below
decide it; each ``$ref`` target starts unproductive and is raised to productive in passes until nothing
changes (a least fixpoint), so a cycle is productive only through a way out of it.

=====================  ==============================================================================
keyword                productive when
=====================  ==============================================================================
``true`` / ``false``   true / never
``$ref``               its target is (and the keywords beside it are: they apply together)
``allOf``              every branch is
``anyOf``, ``oneOf``   some branch is
``enum``, ``const``    always (a literal value); ``enum: []`` never
``type``               some listed type is (absent: every type, so always)
object                 every ``required`` property's schema is (``properties``, else ``additionalProperties``)
array                  the first ``minItems`` items' schemas are (``prefixItems``, then ``items``)
=====================  ==============================================================================

Everything else is taken as productive: the check only ever refuses a schema it proves empty, and leaves
what it cannot decide to llguidance (a grammar that still fails while decoding ends that one sequence with
a one-line error: :mod:`streamattn.engine.sequence`). Work is bounded: linear in the schema per pass, at
most :data:`MAX_PASSES` passes; a schema past that is not refused.
"""

from __future__ import annotations

MAX_PASSES = 64
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def finite_documents(schema) -> bool:
    """True unless ``schema`` (a dict or bool) provably admits no finite JSON document.

    >>> finite_documents({"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]})
    False
    >>> finite_documents({"anyOf": [{"$ref": "#"}, {"type": "null"}]})
    True

    Raises RecursionError for a schema nested past Python's recursion limit (callers bound nesting first).
    """
    known: dict = {}                                   # "$ref" string -> productive (this pass's view)
    for _ in range(MAX_PASSES):
        seen: dict = {}
        root = _productive(schema, schema, known, seen)
        if all(v == known.get(k, False) for k, v in seen.items()):
            return root                                # no value this pass used has changed
        known = {**known, **seen}
    return True


def _resolve(root, ref: str):
    """The subschema a local ``$ref`` ("#", "#/$defs/x", any JSON pointer) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _productive(node, root, known: dict, seen: dict) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True                                    # not a schema: llguidance decides
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref not in seen:
            seen[ref] = None                           # being computed: use the last pass's value inside
            target = _resolve(root, ref)
            seen[ref] = True if target is None else _productive(target, root, known, seen)
        ok = seen[ref] if seen[ref] is not None else known.get(ref, False)
        if not ok:
            return False
    for key, need in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not need(_productive(b, root, known, seen)
                                                                for b in branches):
            return False
    if "const" in node:
        return True
    if isinstance(node.get("enum"), list):
        return bool(node["enum"])
    types = node.get("type", _TYPES)
    types = (types,) if isinstance(types, str) else types
    if not isinstance(types, (list, tuple)):
        return True
    return any(_type_productive(t, node, root, known, seen) for t in types)


def _type_productive(t, node, root, known, seen) -> bool:
    if t == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else ()
        if isinstance(node.get("patternProperties"), dict) and node["patternProperties"]:
            required = [p for p in required if p in props]     # a pattern may admit the others
        return all(_productive(props[p] if p in props else extra, root, known, seen)
                   for p in required if isinstance(p, str))
    if t == "array":
        n = node.get("minItems", 0)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            return True
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True)
        if isinstance(items, list):                    # the old tuple form: items as a list
            prefix, items = items, node.get("additionalItems", True)
        need = prefix[:n] + ([items] if n > len(prefix) else [])
        return all(_productive(s, root, known, seen) for s in need)
    return True
