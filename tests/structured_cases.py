"""JSON schemas for the structured-output tests (tests/test_structured.py, test_serve_http.py): nested
objects, arrays with min/max items, enums, numbers with ranges, strings with patterns and formats,
required and optional fields, anyOf, $ref. Strings are bounded, and numbers
have a step (multipleOf), so that every completion fits its token budget, sampled ones too."""

S = {"type": "string", "maxLength": 12}

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested_address": {"type": "object", "properties": {"name": S, "address": {
        "type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}}, "required": ["name", "address"],
        "additionalProperties": False},
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
                  "maxItems": 4},
    "colour_enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                    "required": ["colour"], "additionalProperties": False},
    "number_range": {"type": "object", "properties": {"score": {"type": "number", "exclusiveMinimum": 0,
                                                                "maximum": 10, "multipleOf": 0.25}},
                     "required": ["score"], "additionalProperties": False},
    "code_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                     "required": ["code"], "additionalProperties": False},
    "date_format": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                    "required": ["when"], "additionalProperties": False},
    "email_format": {"type": "object", "properties": {"email": {"type": "string", "format": "email",
                                                                "maxLength": 30}},
                     "required": ["email"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"title": S, "subtitle": S, "pages": {"type": "integer",
                                                                                           "minimum": 1,
                                                                                           "maximum": 999}},
                        "required": ["title"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                  "maximum": 9999}, S]}},
               "required": ["id"], "additionalProperties": False},
    "ref_defs": {"type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"], "additionalProperties": False,
                 "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                          "maximum": 9},
                                                                    "y": {"type": "integer", "minimum": -9,
                                                                          "maximum": 9}},
                                     "required": ["x", "y"], "additionalProperties": False}}},
    "object_array": {"type": "array", "maxItems": 3, "minItems": 1, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "boolean": {"type": "object", "properties": {"done": {"type": "boolean"}, "note": S},
                "required": ["done"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "name": S}, "required": ["version", "name"],
              "additionalProperties": False},
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "closed_object": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["a", "b"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8,
                                                                 "pattern": "^[a-z]+$"}},
                       "required": ["word"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10}},
                 "required": ["middle_name"], "additionalProperties": False},
    "int_enum": {"type": "object", "properties": {"level": {"enum": [1, 2, 3, 5, 8]}}, "required": ["level"],
                 "additionalProperties": False},
    "datetime_format": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}},
                        "required": ["at"], "additionalProperties": False},
    "uuid_format": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"], "additionalProperties": False},
    "mixed_five": {"type": "object", "properties": {
        "name": S, "age": {"type": "integer", "minimum": 0, "maximum": 99}, "tall": {"type": "boolean"},
        "height": {"type": "number", "minimum": 0, "maximum": 3, "multipleOf": 0.01}, "pet": {"enum": ["cat", "dog", "none"]}},
        "required": ["name", "age", "tall", "height", "pet"], "additionalProperties": False},
    "tuple": {"type": "array", "prefixItems": [S, {"type": "integer", "minimum": 0, "maximum": 9}],
              "items": False, "minItems": 2},
    "any_of_objects": {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 9, "multipleOf": 0.5}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["square"], "additionalProperties": False}]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"],
        "additionalProperties": False},
    "enum_array": {"type": "array", "items": {"enum": ["north", "south", "east", "west"]}, "minItems": 1,
                   "maxItems": 3},
    "negative_range": {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -40,
                                                                    "maximum": -1}},
                       "required": ["celsius"], "additionalProperties": False},
    "ipv4_format": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                    "required": ["ip"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
             "required": ["tags"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {
        "dish": S, "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
        "required": ["dish", "minutes", "steps"], "additionalProperties": False},
    "bare_string": {"type": "string", "maxLength": 20},
    "bare_integer": {"type": "integer", "minimum": 10, "maximum": 20},
}

PROMPT = "Answer with JSON only. Describe a {} as JSON."


def prompt_for(name: str) -> str:
    return PROMPT.format(name.replace("_", " "))


def validate(schema: dict, text: str) -> None:
    """Raise unless ``text`` is one JSON document valid against ``schema`` (formats checked)."""
    import json
    import jsonschema
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
