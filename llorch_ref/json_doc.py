"""JSON documents from files that others write (a dump's manifest, a safetensors header, a bundle's pages): read
as JSON and checked against a JSON Schema, each failure one line of the caller's error type that names the
place (`where`): text that is not JSON, bytes that are not UTF-8, a number past Python's digit limit, nesting
past the parser's or the validator's recursion limit, the first place a document breaks its schema."""
from __future__ import annotations

import json


def parse_json(raw, where, error):
    """raw (str or bytes) as JSON, or `error` naming `where`."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise error(f"{where} is JSON nested too deeply to read") from None
    except ValueError as e:              # JSONDecodeError, UnicodeDecodeError, integers of too many digits
        raise error(f"{where} is not JSON in UTF-8 ({type(e).__name__}: {str(e)[:120]})") from None


def json_object(raw, where, error) -> dict:
    """raw as a JSON object, or `error` naming `where`."""
    doc = parse_json(raw, where, error)
    if not isinstance(doc, dict):
        raise error(f"{where} is not a JSON object")
    return doc


def check_schema(doc, schema: dict, where, error):
    """doc against a JSON Schema, or `error` naming `where` and the first place that breaks it."""
    import jsonschema

    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as e:
        at = "/".join(str(x) for x in e.absolute_path) or "(top level)"
        raise error(f"{where}: invalid at {at}: {e.message[:200]}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply to check") from None
