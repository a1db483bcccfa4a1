"""JSON Schemas of the ``shardext`` command's ``--json`` outputs, and a small validator (no torch needed).

``shardext schema list|doctor|verify`` prints one (JSON Schema draft 2020-12),
so a CI job can check the output it parses without installing torch. The
schemas describe the shapes documented in ``docs/reference/cli.md``; the test
suite validates real outputs against them with `validate`.

Examples:
    >>> validate({"schema_version": 3, "handlers": [], "plugins": [], "errors": []}, SCHEMAS["list"])
    []
    >>> validate({"schema_version": "3"}, SCHEMAS["list"])[:2]
    ["$: missing 'errors'", "$: missing 'handlers'"]
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMAS", "validate"]

_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_NUM = {"type": "number"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": [schema["type"], "null"]}


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    return {"type": "object", "required": sorted(required), "properties": {**required, **optional}}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


# Plugin health (``problems``, ``load_seconds``, ``slow``) was added within version 3: optional here,
# so that earlier version-3 outputs stay valid.
_PLUGIN_ROW = _object(
    {
        "plugin": _STR,
        "distribution": _nullable(_STR),
        "version": _nullable(_STR),
        "status": _STR,
        "patches": _INT,
        "stage": _nullable(_STR),
        "reason": _nullable(_STR),
        "not_applicable": _array(_STR),
    },
    problems=_array(_STR),
    load_seconds=_nullable(_NUM),
    slow=_BOOL,
    yielded_to_builtins=_array(_STR),
)
_HANDLER_ROW = _object(
    {
        "target": _STR,
        "level": _STR,
        "handler": _nullable(_STR),
        "provider": _nullable(_STR),
        "distribution": _nullable(_STR),
        "priority": _nullable(_INT),
        "status": _STR,
        "drift": _BOOL,
        "claimants": _array(_STR),
    },
    recorded_handler=_nullable(_STR),
    live_provider=_nullable(_STR),
    table=_nullable(_STR),
    drift_reason=_nullable(_STR),
    overrides_builtin=_nullable(_BOOL),
    replaced=_nullable(_STR),
    shadowed=_array(_STR),
    description=_nullable(_STR),
)
_PER_RANK = _array(_NUM)
_PHASE = _object({"collectives": _PER_RANK, "bytes": _PER_RANK})

#: The schema of each command's ``--json`` output, by command name.
SCHEMAS: dict[str, dict[str, Any]] = {
    "list": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "shardext list --json (schema_version 3)",
        **_object(
            {
                "schema_version": {"const": 3},
                "handlers": _array(_HANDLER_ROW),
                "plugins": _array(_PLUGIN_ROW),
                "errors": _array(_STR),
            }
        ),
    },
    "doctor": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "shardext doctor --json (schema_version 3)",
        **_object(
            {
                "schema_version": {"const": 3},
                "versions": {"type": "object"},
                "backends": {"type": "object"},
                "settings": {"type": "object"},
                "plugins": {"type": "object"},
                "plugin_details": _array(_PLUGIN_ROW),
                "conflicts": _array({"type": "object"}),
                "handlers": {"type": "object"},
                "drift": _array({"type": "object"}),
                "errors": _array(_STR),
            },
            torch_support=_object(
                {
                    "torch": _STR,
                    "release": _STR,
                    "declared": _nullable(_STR),
                    "in_declared_range": _nullable(_BOOL),
                    "local_tensor_mode": _BOOL,
                }
            ),
        ),
    },
    "verify": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "shardext verify --json (schema physicsnemo-shardext/verify, version 1)",
        **_object(
            {
                "schema": {"const": "physicsnemo-shardext/verify"},
                "schema_version": {"const": 1},
                "status": {"enum": ["match", "mismatch", "unsupported", "bad-input"]},
                "exit_code": _INT,
                "summary": _STR,
                "config": {"type": "object"},
                "ops": _array(
                    _object(
                        {
                            "index": _INT,
                            "op": _STR,
                            "calls": _INT,
                            "handler": _STR,
                            "provider_kind": _STR,
                            "provider": _STR,
                            "output": _STR,
                            "stayed_sharded": _BOOL,
                            "forward": _PHASE,
                            "backward": _PHASE,
                            "activation_gathers": _INT,
                            "error": _nullable(_STR),
                        },
                        site={"type": ["object", "null"]},
                        configuration=_STR,
                    )
                ),
                "comparison": _array(
                    _object(
                        {"tensor": _STR, "relative_error": _NUM, "ok": _BOOL},
                        max_abs_error=_nullable(_NUM),
                        detail=_STR,
                        worst_index={"type": ["array", "null"], "items": _INT},
                        elements_outside=_INT,
                        description=_STR,
                    )
                ),
                "next_steps": _array(_STR),
            },
            error={"type": ["object", "null"]},
            totals={"type": "object"},
            tolerance=_NUM,
            rtol=_NUM,
            atol=_NUM,
            rule=_STR,
            ranks=_INT,
            split={"type": "object"},
            notes=_array(_STR),
        ),
    },
}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def validate(instance: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Problems of ``instance`` against the subset of JSON Schema used here (type, const, enum, required,
    properties, items); ``[]`` when it conforms."""
    problems: list[str] = []
    if "const" in schema and instance != schema["const"]:
        return [f"{where}: {instance!r} is not {schema['const']!r}"]
    if "enum" in schema and instance not in schema["enum"]:
        return [f"{where}: {instance!r} is not one of {schema['enum']}"]
    kinds = schema.get("type")
    if kinds is not None:
        names = [kinds] if isinstance(kinds, str) else kinds
        matches = any(
            isinstance(instance, _TYPES[name]) and not (name in ("integer", "number") and isinstance(instance, bool))
            for name in names
        )
        if not matches:
            return [f"{where}: {type(instance).__name__} is not {' or '.join(names)}"]
    if isinstance(instance, dict):
        problems += [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in instance]
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                problems += validate(instance[key], sub, f"{where}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for index, item in enumerate(instance):
            problems += validate(item, schema["items"], f"{where}[{index}]")
    return problems
