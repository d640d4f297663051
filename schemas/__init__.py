"""JSON Schemas of everything hscache and scorer write to disk, and one validator: ``hscache.schemas``.

Each ``*.schema.json`` here describes one on-disk document. Writers validate before they
write, so a file that exists always matches its schema version. The files live in the
repository's ``schemas/`` folder; ``hscache/schemas`` is a symlink to it, so an installed
package carries them as package data (``from hscache import schemas``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["load_schema", "validate", "SchemaError"]

_SCHEMA_DIR = Path(__file__).parent


class SchemaError(ValueError):
    """A document does not match its JSON Schema."""


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """Return the schema ``<name>.schema.json`` (beside this module) as a dict."""
    path = _SCHEMA_DIR / f"{name}.schema.json"
    if not path.is_file():
        raise FileNotFoundError(f"no schema named {name!r} in {_SCHEMA_DIR}")
    return json.loads(path.read_text())


def validate(document: dict[str, Any], name: str) -> None:
    """Raise SchemaError naming the first offending field when ``document`` breaks schema ``name``."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema(name))
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "<root>"
        raise SchemaError(f"{name} document invalid at {where}: {first.message}")
