"""JSON documents from files that others write (a dump's manifest, a bundle's pages) checked against a JSON
Schema, each failure one line of the caller's error type that names the place (`where`): the first place a
document breaks its schema, or nesting past the validator's recursion limit."""
from __future__ import annotations


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
