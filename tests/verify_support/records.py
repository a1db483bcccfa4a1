"""A synthetic rank record, as `check_model` gathers them, for report and page tests."""

from __future__ import annotations


def rank_record(status: str = "ok", rel: float = 1e-7, error: dict | None = None) -> dict:
    """One rank's record: one op site and an output compared with relative error ``rel`` (or an error)."""
    site = {
        "index": 0,
        "op": "torch.tanh",
        "site": {"file": "m.py", "line": 3, "function": "forward", "code": "y"},
        "calls": 1,
        "handler": "h",
        "provider_kind": "plugin",
        "provider": "p (d==1)",
        "output": "sharded",
        "placements": "(Shard(2))",
        "stayed_sharded": True,
        "forward": {"collectives": 0, "bytes": 0},
        "backward": {"collectives": 1, "bytes": 8},
        "collectives": {},
        "activation_gathers": 0,
        "gathered_elements": 0,
        "error": None,
        "configuration": "",
    }
    record = {"sites": [site], "notes": [], "sizes": {"0": [5, 4]}, "placements": ["Shard(2)"], "plain_calls": 0}
    if error:
        record["error"] = error
    else:
        record["comparison"] = [
            {"tensor": "output", "max_abs_error": rel, "relative_error": rel, "ok": rel <= 1e-4, "detail": ""}
        ]
    return record
