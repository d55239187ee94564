"""Whether a JSON schema admits any finite JSON value, decided before a grammar is built from it.

A schema can require itself: ``{"type": "object", "properties": {"a": {"$ref":
"#"}}, "required": ["a"]}`` holds only infinitely nested objects. llguidance
compiles such a schema without complaint and fails only while generating
(its parser runs out of items on the first token), so the gateway refuses it
up front with a 400 that says why.

The question is the one asked of a context-free grammar's symbols: which are
productive. Each subschema is a node that holds a finite value when all
(``and``) or any (``or``) of its children do: a schema needs its ``$ref``,
every ``allOf`` part, one ``anyOf`` / ``oneOf`` branch and one of its types;
an object type needs every required property, an array type its first
``minItems`` items and a ``contains`` match. Everything else (scalars,
``enum``, ``const``, an absent ``type``, keywords not modelled, references
outside the document) counts as finite, so only a schema that is surely empty
is refused. Productive nodes are propagated from the leaves up, each edge once:
time and memory are linear in the schema's size, which the request body bounds.
"""

from __future__ import annotations

from urllib.parse import unquote

from mlxd.shared.errors import InvalidRequestError


def check_finite(schema, param: str, what: str = "the JSON schema") -> None:
    """InvalidRequestError (``param``) unless ``schema`` admits some finite JSON value."""
    if not has_finite_value(schema):
        raise InvalidRequestError(
            f"{what} admits no finite JSON value: a required property or item refers back to its own "
            "schema with no way to end (make it optional, or give the recursion a branch that stops)",
            param=param)


def has_finite_value(schema) -> bool:
    """True unless ``schema`` is surely empty because every value it allows would be infinitely nested."""
    graph = _Graph(schema)
    return graph.productive(graph.root)


class _Graph:
    """And/or nodes of a schema's subschemas (one node per schema object, so that references meet)."""

    def __init__(self, root):
        self.document = root
        self.need: list[int] = []  # children still to become productive: all for "and", one for "or"
        self.parents: list[list[int]] = []
        self._ids: dict[int, int] = {}  # id(schema object) -> node
        self._todo: list[tuple[int, object]] = []
        self.root = self._node_of(root)
        while self._todo:
            node, schema = self._todo.pop()
            self._expand(node, schema)

    def _new(self, op: str, children: list[int]) -> int:
        node = len(self.need)
        self.need.append(len(children) if op == "and" else 1)
        self.parents.append([])
        for child in children:
            self.parents[child].append(node)
        return node

    def _node_of(self, schema) -> int:
        """The node of a subschema; its children are filled in later (``_todo``), so depth costs no stack."""
        if not isinstance(schema, dict):
            return self._new("or" if schema is False else "and", [])
        node = self._ids.get(id(schema))
        if node is None:
            node = self._ids[id(schema)] = self._new("and", [])
            self._todo.append((node, schema))
        return node

    def _expand(self, node: int, s: dict) -> None:
        children = []
        target = self._resolve(s.get("$ref"))
        if target is not None:
            children.append(self._node_of(target))
        for part in _list(s.get("allOf")):
            children.append(self._node_of(part))
        for key in ("anyOf", "oneOf"):
            branches = _list(s.get(key))
            if branches:
                children.append(self._new("or", [self._node_of(b) for b in branches]))
        if "const" not in s and "enum" not in s and "type" in s:
            kinds = s["type"] if isinstance(s["type"], list) else [s["type"]]
            children.append(self._new("or", [self._kind(k, s) for k in kinds]))
        self.need[node] = len(children)
        for child in children:
            self.parents[child].append(node)

    def _kind(self, kind, s: dict) -> int:
        """The node of ``s`` read as one of its types."""
        needs = []
        if kind == "object":
            props = s.get("properties")
            props = props if isinstance(props, dict) else {}
            needs = [self._node_of(props[k]) for k in _list(s.get("required")) if isinstance(k, str) and k in props]
        elif kind == "array":
            count = s.get("minItems", 0)
            count = count if isinstance(count, int) else 0
            prefix = s.get("prefixItems", s.get("items") if isinstance(s.get("items"), list) else None)
            prefix = _list(prefix)
            rest = s.get("items") if isinstance(s.get("items"), (dict, bool)) else None
            needs = [self._node_of(p) for p in prefix[:count]]
            if count > len(prefix) and rest is not None:
                needs.append(self._node_of(rest))
            if "contains" in s and s.get("minContains", 1) != 0:
                needs.append(self._node_of(s["contains"]))
        return self._new("and", needs)

    def _resolve(self, ref):
        """The subschema a local reference (``#``, ``#/$defs/x``) points at; None for anything else."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        at = self.document
        for raw in ref[2:].split("/") if ref != "#" else []:
            key = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and key in at:
                at = at[key]
            elif isinstance(at, list) and key.isdigit() and int(key) < len(at):
                at = at[int(key)]
            else:
                return None
        return at if isinstance(at, (dict, bool)) else None

    def productive(self, node: int) -> bool:
        done = [False] * len(self.need)
        ready = [n for n, k in enumerate(self.need) if k == 0]
        for n in ready:
            done[n] = True
        while ready:
            n = ready.pop()
            for p in self.parents[n]:
                if not done[p]:
                    self.need[p] -= 1
                    if self.need[p] == 0:
                        done[p] = True
                        ready.append(p)
        return done[node]


def _list(value) -> list:
    return value if isinstance(value, list) else []
