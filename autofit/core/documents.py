"""JSON documents where autofit meets them: one name for what `json.loads` gives before it is read.

A document is read into typed objects in one place (a `from_dict` or a reader that checks each field and says
what is wrong); past it the code works with those objects. `JSONObject` is the reader's input and the writer's
output, the boundary with JSON: its `Any` is what JSON (or YAML) can hold, not a hole in the types.
"""

from __future__ import annotations

from typing import Any

JSONObject = dict[str, Any]
"""A JSON (or YAML) object as `json.loads` gives it: its fields are read and checked where it is parsed."""
