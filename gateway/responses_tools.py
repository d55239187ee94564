"""Responses API tools in chat terms: function tools, namespaces flattened, hosted tools set aside.

Clients such as Codex group function tools under ``{"type": "namespace",
"name": ..., "tools": [...]}`` and list tools the platform itself would run
(``web_search`` and the like). The model sees one flat list of functions: a
namespaced function keeps its own name (qualified ``<namespace>__<name>``
only where two would clash), and a call comes back under the name and
namespace the client declared. Hosted tools are left out of the prompt and
the grammar: this server runs none of them, and refusing them would refuse
every request of a client that lists them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxd.shared.errors import InvalidRequestError

# Tool types OpenAI's platform executes itself; a client lists them, the server would run them.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer_use",
    "mcp", "tool_search",
})


@dataclass
class ResponsesTools:
    """The chat tools of one request and the way back from a flat name to the client's (name, namespace)."""

    chat: list[dict] = field(default_factory=list)
    origin: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # flat → (name, namespace)
    flat: dict[tuple[str, str | None], str] = field(default_factory=dict)  # (name, namespace) → flat

    def client_name(self, flat: str) -> tuple[str, str | None]:
        """(name, namespace) of a call the model made under ``flat``."""
        return self.origin.get(flat, (flat, None))

    def flat_name(self, name: str, namespace: str | None) -> str:
        """The name the model knows a client's (name, namespace) by."""
        return self.flat.get((name, namespace), name)


def _function(tool: dict, where: str) -> dict:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError("a function tool needs a name", param=f"{where}.name")
    return {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}


def responses_tools(tools: list[dict] | None) -> ResponsesTools:
    """Flatten ``tools``; InvalidRequestError naming a tool this server can neither offer nor set aside."""
    found: list[tuple[dict, str | None]] = []  # (function, namespace)
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            found.append((_function(tool, where), None))
        elif kind == "namespace":
            ns = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise InvalidRequestError("a namespace tool needs a name and a list of tools", param=where)
            for j, t in enumerate(inner):
                if not isinstance(t, dict) or t.get("type", "function") != "function":
                    kind_j = t.get("type") if isinstance(t, dict) else None
                    raise InvalidRequestError(f"only function tools are supported inside a namespace "
                                              f"(got {kind_j!r})", param=f"{where}.tools[{j}]")
                found.append((_function(t, f"{where}.tools[{j}]"), ns))
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            continue
        else:
            raise InvalidRequestError(f"only function and namespace tools are supported (got {kind!r})",
                                      param=where)
    counts: dict[str, int] = {}
    for f, _ in found:
        counts[f["name"]] = counts.get(f["name"], 0) + 1
    out = ResponsesTools()
    for f, ns in found:
        flat = f["name"] if counts[f["name"]] == 1 or ns is None else f"{ns}__{f['name']}"
        if flat in out.origin:
            raise InvalidRequestError(f"two tools are named {flat!r}", param="tools")
        out.origin[flat] = (f["name"], ns)
        out.flat[(f["name"], ns)] = flat
        out.chat.append({"type": "function", "function": {**f, "name": flat}})
    return out
