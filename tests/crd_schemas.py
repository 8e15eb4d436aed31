"""Validate objects of custom resource kinds against their CRDs' schemas, as the API server
would under strict field validation.

kubernetes-validate carries the schemas of Kubernetes' own kinds only. For the kinds the
chart renders or the agent writes that come from CRDs (ServiceMonitor, PrometheusRule,
NodeFeature), ``tests/fixtures/crd-schemas/`` holds each CRD's openAPIV3Schema, written down
from the upstream CRD named in the file. The API server's behaviour followed here
(apiextensions-apiserver, structural schemas): an object is validated against
``openAPIV3Schema``; under ``kubectl apply --validate=strict`` (server-side field
validation ``Strict``) a field the schema does not declare is an error, unless the schema
says ``x-kubernetes-preserve-unknown-fields`` or gives ``additionalProperties``; ``metadata``
is the ObjectMeta of every object (checked here for the fields objects use: name,
namespace, labels, annotations, ownerReferences).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

FIXTURES = Path(__file__).parent / "fixtures" / "crd-schemas"

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
#: ObjectMeta, for the fields the objects here carry (the API server owns the rest).
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "ownerReferences": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["apiVersion", "kind", "name", "uid"],
                "additionalProperties": False,
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string"},
                    "uid": {"type": "string"},
                    "controller": {"type": "boolean"},
                    "blockOwnerDeletion": {"type": "boolean"},
                },
            },
        },
    },
}


def _strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever the API server would refuse
    an undeclared field (an object with ``properties`` and neither ``additionalProperties``
    nor ``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def _documents() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(FIXTURES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        found[(doc["apiVersion"], doc["kind"])] = doc
    return found


def kinds() -> set[tuple[str, str]]:
    """(apiVersion, kind) of every CRD kind with a schema here."""
    return set(_documents())


@lru_cache(maxsize=None)
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    doc = _documents()[(api_version, kind)]
    schema = _strict(copy.deepcopy(doc["openAPIV3Schema"]))
    schema["properties"]["metadata"] = OBJECT_META
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of ``obj`` (a CRD kind with a schema here), as
    ``path: message``; empty when it is valid."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key not in _documents():
        raise KeyError(f"no CRD schema for {key[1]} {key[0]} in {FIXTURES}")
    found = sorted(_validator(*key).iter_errors(obj), key=lambda e: list(map(str, e.path)))
    return [f"{'.'.join(map(str, e.path)) or '(object)'}: {e.message}" for e in found]
