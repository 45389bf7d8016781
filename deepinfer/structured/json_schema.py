"""Which JSON Schemas the xgrammar backend can enforce, checked before compiling.

xgrammar 0.2.8 compiles many schemas whose constraints it does not enforce: it
drops keywords it does not implement (``not``, ``if``/``then``/``else``,
``dependentRequired``, ``uniqueItems``, ``contains``, non-integer ``multipleOf``),
ignores the siblings of ``$ref``, ``anyOf``, ``allOf``, ``enum`` and ``const``,
generates ``oneOf`` as ``anyOf``, and applies type-specific keywords (``minLength``,
``minimum``, ``required``, ...) only where the same schema declares ``type``.
Generating from such a schema silently produces documents that fail it, so
``check_json_schema`` refuses them with a ValueError naming the keyword and where
it sits (a JSON pointer), and saying what to change.

What passes is what xgrammar enforces exactly, or narrows (a JSON Schema
``pattern`` is matched in full rather than searched; properties and items the
schema does not list are not generated): every document generated from a schema
that passes validates against it. The rules were derived from, and are tested on,
the JSON-Schema-Test-Suite (draft 2020-12): no schema that passes accepts an
instance the suite marks invalid.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

_UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
    "$anchor",
})
# Keywords xgrammar applies only when the same schema declares "type".
_TYPED = {
    "string": frozenset({"minLength", "maxLength", "pattern"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "patternProperties",
                         "minProperties", "maxProperties", "propertyNames", "unevaluatedProperties"}),
}
_TYPED_KEYWORDS = frozenset().union(*_TYPED.values())
# Without "type", xgrammar infers "object" from these, and "array" from the next.
_OBJECT_SHAPE = frozenset({"properties", "additionalProperties"})
_ARRAY_SHAPE = frozenset({"items", "prefixItems"})
# Keywords whose siblings xgrammar ignores.
_EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# The validation keywords this check reasons about; the rest (annotations such as "title",
# "default" and "format", and unknown keywords such as OpenAPI's "discriminator") do not
# constrain a document.
_VALIDATION = _TYPED_KEYWORDS | {"type", *_EXCLUSIVE}
_PROPERTY_NAME_KEYWORDS = frozenset({"type", "pattern", "minLength", "maxLength", "const", "enum"})
_JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def check_json_schema(schema: Any) -> None:
    """Raise ValueError if xgrammar cannot enforce ``schema`` exactly (see the module doc)."""
    _Checker(schema).check(schema, "#", is_root=True)


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"structured_outputs.json: {what} (at {path}); the xgrammar backend cannot "
                      "enforce it, so the output could violate the schema")


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _declared_types(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    types = [t] if isinstance(t, str) else t
    if not isinstance(types, list) or not all(isinstance(x, str) for x in types):
        raise ValueError(f'structured_outputs.json: "type": {t!r} must be a type name or a list of them')
    return set(types)


def _with_integers(types: set[str]) -> set[str]:
    """Integers are numbers: a "number" type overlaps an "integer" one."""
    return types | {"integer"} if "number" in types else types


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def check(self, node: Any, path: str, is_root: bool = False) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise ValueError(f"structured_outputs.json: the schema at {path} must be an object or a boolean")
        for key in node:
            if key in _UNSUPPORTED:
                raise _refuse(f"{path}/{key}", f'keyword "{key}"')
        if "$id" in node and not is_root:
            raise _refuse(f"{path}/$id", '"$id" inside a subschema')
        validation = set(node) & _VALIDATION
        self._check_exclusive(node, path, validation)
        types = _declared_types(node)
        if types is None:
            is_object, is_array = bool(validation & _OBJECT_SHAPE), bool(validation & _ARRAY_SHAPE)
            if is_object != is_array:
                types = {"object"} if is_object else {"array"}
            elif validation & _TYPED_KEYWORDS:
                keyword = min(validation & _TYPED_KEYWORDS)
                family = next(f for f, kws in _TYPED.items() if keyword in kws)
                raise _refuse(f"{path}/{keyword}", f'"{keyword}" in a schema without "type" (add '
                              f'"type": "{family}" or the types it should apply to)')
        elif not types <= set(_JSON_TYPES):
            raise ValueError(f"structured_outputs.json: unknown type {min(types - set(_JSON_TYPES))!r} "
                             f"at {path}/type")
        required, props = node.get("required"), node.get("properties", {})
        if isinstance(required, list) and isinstance(props, dict):
            missing = [name for name in required if name not in props]
            if missing:
                raise _refuse(f"{path}/required", f'"required" names {missing[0]!r}, which "properties" '
                              'does not define')
        if node.get("uniqueItems") is True:
            raise _refuse(f"{path}/uniqueItems", '"uniqueItems": true')
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in node and node[key] is not False:
                raise _refuse(f"{path}/{key}", f'"{key}" other than false')
        if "multipleOf" in node:
            m = node["multipleOf"]
            integral = isinstance(m, (int, float)) and not isinstance(m, bool) and float(m).is_integer()
            if types != {"integer"} or not integral:
                raise _refuse(f"{path}/multipleOf", '"multipleOf" other than an integer on "type": "integer"')
        if "allOf" in node and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
            raise _refuse(f"{path}/allOf", '"allOf" with more than one schema (merge them into one)')
        if "oneOf" in node and isinstance(node["oneOf"], list):
            self._check_one_of(node["oneOf"], f"{path}/oneOf")
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise _refuse(f"{path}/$ref", f'"$ref": {ref!r} (only references inside the schema, '
                              'starting with "#", are supported)')
        if "propertyNames" in node and isinstance(node["propertyNames"], dict):
            extra = sorted(set(node["propertyNames"]) & (_VALIDATION | _UNSUPPORTED) - _PROPERTY_NAME_KEYWORDS)
            if extra:
                raise _refuse(f"{path}/propertyNames/{extra[0]}", f'"{extra[0]}" in "propertyNames"')
        for sub, sub_path in self._subschemas(node, path):
            self.check(sub, sub_path)

    def _check_exclusive(self, node: dict[str, Any], path: str, validation: set[str]) -> None:
        present = [k for k in _EXCLUSIVE if k in node]
        if not present:
            return
        others = sorted(validation - {present[0]})
        values = node["enum"] if present[0] == "enum" else [node["const"]] if present[0] == "const" else None
        if values is not None and others == ["type"] and isinstance(values, list):
            # enum/const beside a "type" all of its values satisfy is exact.
            types = _declared_types(node) or set()
            if all(_type_of(v) in types or (_type_of(v) == "integer" and "number" in types) for v in values):
                return
        if others:
            raise _refuse(f"{path}/{others[0]}", f'"{others[0]}" beside "{present[0]}" (xgrammar ignores the '
                          f'siblings of "{present[0]}"; move them into its schemas)')

    def _check_one_of(self, branches: list[Any], path: str) -> None:
        """xgrammar generates oneOf as anyOf: exact only when no document matches two branches."""
        resolved = [self._resolve(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not self._disjoint(resolved[i], resolved[j]):
                    raise _refuse(path, f'"oneOf" whose branches {i} and {j} may both match (use "anyOf" '
                                  'if either may match, or give the branches distinct types or a '
                                  'required "const" property)')

    def _disjoint(self, a: Any, b: Any) -> bool:
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = self._value_types(a), self._value_types(b)
        if ta is not None and tb is not None and not _with_integers(ta) & _with_integers(tb):
            return True
        # A discriminator: a property both branches require, with different constant values.
        ra, rb = a.get("required"), b.get("required")
        required = set(ra) & set(rb) if isinstance(ra, list) and isinstance(rb, list) else set()
        for key in required:
            ca = self._constant(self._resolve(a.get("properties", {}).get(key)))
            cb = self._constant(self._resolve(b.get("properties", {}).get(key)))
            if ca is not None and cb is not None and ca[0] != cb[0]:
                return True
        return False

    @staticmethod
    def _value_types(schema: dict[str, Any]) -> set[str] | None:
        if "const" in schema:
            return {_type_of(schema["const"])}
        if isinstance(schema.get("enum"), list):
            return {_type_of(v) for v in schema["enum"]}
        return _declared_types(schema)

    @staticmethod
    def _constant(schema: Any) -> tuple[Any] | None:
        if not isinstance(schema, dict):
            return None
        if "const" in schema:
            return (schema["const"],)
        if isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1:
            return (schema["enum"][0],)
        return None

    def _resolve(self, node: Any) -> Any:
        """Follow local "$ref" pointers (a chain of them, without looping)."""
        seen: set[str] = set()
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            ref = node["$ref"]
            if ref in seen:
                return node
            seen.add(ref)
            target: Any = self.root
            for part in urllib.parse.unquote(ref[1:]).split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    return node
            node = target
        return node

    @staticmethod
    def _subschemas(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
        out: list[tuple[Any, str]] = []
        for key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(node.get(key), dict):
                out += [(v, f"{path}/{key}/{k}") for k, v in node[key].items()]
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(key), list):
                out += [(v, f"{path}/{key}/{i}") for i, v in enumerate(node[key])]
        for key in ("additionalProperties", "items"):
            if isinstance(node.get(key), dict):
                out.append((node[key], f"{path}/{key}"))
        return out
