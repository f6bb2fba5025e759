"""Validates replies printed by the examples (JSON lines {"step","reply"})
against the JSON Schemas of docs/schema: python3 validate.py SCHEMA_DIR < lines.
Exits 1 naming the first reply that does not match its schema."""
import json
import pathlib
import sys

import jsonschema

schemas = pathlib.Path(sys.argv[1])
checked = 0
for line in sys.stdin:
    if not line.strip():
        continue
    step = json.loads(line)
    reply = step["reply"]
    schema = json.loads((schemas / f"{reply['type']}.json").read_text())
    try:
        jsonschema.validate(reply, schema, cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as e:
        print(f"{step['step']}: {reply['type']} does not match its schema: {e.message} at {list(e.absolute_path)}")
        sys.exit(1)
    checked += 1
print(f"{checked} replies match their schemas")
