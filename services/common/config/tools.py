"""The tool YAML of a multi-turn run (`rl_config.tool_config_path`): loading and validation.

MindSpeed-RL's format, read unchanged:

    tools:
      - class_name: "mindspeed_rl.tools.retool.ReTool"
        config: {sandbox_fusion_url: "http://localhost:8080/run_code", num_workers: 128, ...}
        tool_schema: {type: "function", function: {name: "code_interpreter", description: ..., parameters: ...}}

Each upstream class maps onto a tool that `rlfabric tools serve` hosts (services/tools/): the ReTool and
SandboxFusionTool classes onto a code interpreter that posts to a SandboxFusion `/run_code` server, SearchTool onto
a client of a retrieval server's `/retrieve`. Every `config` key the upstream class reads is read here with its
upstream default (the dataclass field: its one home); a key it does not read is refused by name with the closest
valid one, since upstream would ignore it silently (`memory_limit_MB` for `memory_limit_mb` would run with the
default). An unknown `class_name` is refused naming the file and the entry.

`tool_schema` goes through the model MindSpeed-RL validates it with (a pydantic `OpenAIFunctionToolSchema`,
dumped with exclude_unset/exclude_none), so the schema the model sees is upstream's: keys that model has no field
for are dropped, as upstream drops them, and listed in `ToolEntry.ignored` (the search YAML's misspelt `item`).

Errors are `ConfigError`s holding every problem of the file at once, each naming the file:line, the entry index
and the key (`tools[0].config.num_workers`). Standard library and PyYAML only, like the rest of the package.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.schema import closest_key
from services.common.config.yaml_io import SourcedDict, read_yaml

# SandboxFusion's languages, the list MindSpeed-RL checks a call's language against (tool_utils.SUPPORTED_LANGUAGES).
SANDBOX_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket",
)
# verl's tool types: `native` (a class in-process; here, a tool of the tool server) and `mcp` (tools of an MCP
# server). MindSpeed-RL reads neither and instantiates the class; only `native` means that here.
TOOL_TYPES = ("native",)


@dataclass(frozen=True)
class CodeInterpreterConfig:
    """`config` of ReTool / SandboxFusionTool (mindspeed_rl/tools/sandbox_fusion_tool.py reads these keys)."""

    sandbox_fusion_url: str = field(metadata={"help": "SandboxFusion `/run_code` URL the code is posted to."})
    num_workers: int = field(default=10, metadata={"help": "Calls one tool server runs at once; more wait."})
    rate_limit: int = field(default=10, metadata={
        "help": "Calls in flight at once across every tool server of the run (upstream: a cluster-wide semaphore)."})
    enable_global_rate_limit: bool = field(default=True, metadata={
        "help": "Apply rate_limit across servers; false: only num_workers per server limits calls."})
    default_timeout: float = field(default=30, metadata={
        "help": "Seconds the code may compile and run (the call's `timeout` argument overrides it, as upstream)."})
    default_language: str = field(default="python", metadata={
        "help": "SandboxFusion language when the call names none (its `language` argument)."})
    memory_limit_mb: int = field(default=1024, metadata={"help": "Sent as SandboxFusion's memory_limit_MB."})
    type: str = field(default="native", metadata={"help": "verl's tool type; only `native` exists here."})


@dataclass(frozen=True)
class SearchConfig:
    """`config` of SearchTool (mindspeed_rl/tools/search_tool.py reads these keys)."""

    retrieval_service_url: str = field(metadata={"help": "Retrieval server `/retrieve` URL (Search-R1's API)."})
    num_workers: int = field(default=120, metadata={"help": "Calls one tool server runs at once; more wait."})
    rate_limit: int = field(default=120, metadata={
        "help": "Calls in flight at once across every tool server of the run (upstream: a cluster-wide semaphore)."})
    enable_global_rate_limit: bool = field(default=True, metadata={
        "help": "Apply rate_limit across servers; false: only num_workers per server limits calls."})
    timeout: float = field(default=30, metadata={"help": "Seconds one request to the retrieval server may take."})
    topk: int = field(default=3, metadata={"help": "Passages retrieved per query."})
    type: str = field(default="native", metadata={"help": "verl's tool type; only `native` exists here."})


ToolConfig = CodeInterpreterConfig | SearchConfig


@dataclass(frozen=True)
class ToolClass:
    """What an upstream `class_name` becomes: its kind, config dataclass and behaviour switches."""

    kind: str  # "code_interpreter" | "search"
    config_class: type
    # ReTool takes the first ```python block of `code` and prints the last line's value; SandboxFusionTool runs
    # `code` as given.
    retool_code: bool = False


TOOL_CLASSES: dict[str, ToolClass] = {
    "mindspeed_rl.tools.retool.ReTool": ToolClass("code_interpreter", CodeInterpreterConfig, retool_code=True),
    "mindspeed_rl.tools.sandbox_fusion_tool.SandboxFusionTool": ToolClass("code_interpreter", CodeInterpreterConfig),
    "mindspeed_rl.tools.search_tool.SearchTool": ToolClass("search", SearchConfig),
}


@dataclass(frozen=True)
class ToolEntry:
    """One entry of `tools`, validated."""

    index: int
    class_name: str
    tool_class: ToolClass
    config: ToolConfig
    schema: dict[str, Any]  # the OpenAI function-tool object the model sees (upstream's normalisation)
    ignored: tuple[str, ...] = ()  # schema keys dropped as upstream drops them (dotted paths)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def description(self) -> str:
        return self.schema["function"]["description"]

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (upstream's default, an object without properties, when unset)."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}, "required": []})


@dataclass(frozen=True)
class ToolConfigFile:
    """A loaded tool YAML: its entries in file order."""

    path: str
    tools: tuple[ToolEntry, ...]

    def by_name(self) -> dict[str, ToolEntry]:
        return {t.name: t for t in self.tools}


def load_tool_config(path: str | Path) -> ToolConfigFile:
    """Reads and validates the tool YAML at `path`.

    Raises:
        ConfigError: every problem found (a missing file, a YAML error, an unknown class or key, a bad value),
            each naming the file:line, the entry (`tools[i]`) and the key.
    """
    label = str(path)
    doc = read_yaml(Path(path), what="tool config file")
    issues: list[ConfigIssue] = []
    if not isinstance(doc, dict) or "tools" not in doc:
        raise ConfigError([ConfigIssue(label, "expected a mapping with a `tools:` list (MindSpeed-RL's tool "
                                              "YAML: tools: [{class_name, config, tool_schema}])", label)], label)
    for key in doc:
        if key != "tools":
            issues.append(ConfigIssue(str(key), "unknown top-level key; a tool YAML holds only `tools:`",
                                      _where(doc, key, label)))
    raw_tools = doc["tools"]
    if not isinstance(raw_tools, list) or not raw_tools:
        raise ConfigError([*issues, ConfigIssue("tools", "must be a non-empty list of {class_name, config, "
                                                         "tool_schema} entries", _where(doc, "tools", label))], label)
    entries = []
    for index, raw in enumerate(raw_tools):
        entry = _parse_entry(index, raw, label, _where(doc, "tools", label), issues)
        if entry is not None:
            entries.append(entry)
    seen: dict[str, int] = {}
    for entry in entries:
        if entry.name in seen:
            issues.append(ConfigIssue(f"tools[{entry.index}].tool_schema.function.name",
                                      f"tool name {entry.name!r} is already used by tools[{seen[entry.name]}]; the "
                                      "model calls tools by name, so each must be unique", label))
        seen.setdefault(entry.name, entry.index)
    if issues:
        raise ConfigError(issues, label)
    return ToolConfigFile(label, tuple(entries))


def _where(mapping: Any, key: Any, fallback: str) -> str:
    if isinstance(mapping, SourcedDict):
        return mapping.key_sources.get(key, fallback)
    return fallback


def _parse_entry(index: int, raw: Any, label: str, list_source: str,
                 issues: list[ConfigIssue]) -> ToolEntry | None:
    prefix = f"tools[{index}]"
    if not isinstance(raw, dict):
        issues.append(ConfigIssue(prefix, "must be a mapping with class_name, config and tool_schema", list_source))
        return None
    start = next(iter(raw.key_sources.values()), list_source) if isinstance(raw, SourcedDict) else list_source
    where = lambda key: _where(raw, key, start)  # noqa: E731
    count = len(issues)
    for key in raw:
        if key not in ("class_name", "config", "tool_schema"):
            guess = closest_key(str(key), ("class_name", "config", "tool_schema"))
            hint = f"; did you mean `{guess}`?" if guess else "; an entry holds class_name, config and tool_schema"
            issues.append(ConfigIssue(f"{prefix}.{key}", f"unknown key{hint}", where(key)))
    class_name = raw.get("class_name")
    tool_class = TOOL_CLASSES.get(class_name) if isinstance(class_name, str) else None
    if tool_class is None:
        known = ", ".join(TOOL_CLASSES)
        what = "is missing" if class_name is None else f"{class_name!r} is not a tool rlfabric hosts"
        issues.append(ConfigIssue(f"{prefix}.class_name", f"{what} (in {label}, entry {index}); known classes: "
                                                          f"{known}", where("class_name")))
    config = None
    if "config" not in raw or not isinstance(raw["config"], dict):
        issues.append(ConfigIssue(f"{prefix}.config", "must be a mapping of the tool's settings",
                                  where("config")))
    elif tool_class is not None:
        config = _parse_config(tool_class, raw["config"], f"{prefix}.config", where("config"), issues)
    schema, ignored = None, ()
    if "tool_schema" not in raw or raw["tool_schema"] is None:
        issues.append(ConfigIssue(f"{prefix}.tool_schema", "is missing; MindSpeed-RL's tools have no built-in "
                                                           "schema (\"tool_schema is not set\"): give "
                                                           "{type: function, function: {name, description, "
                                                           "parameters}}", where("tool_schema")))
    else:
        schema, ignored = normalize_tool_schema(raw["tool_schema"], f"{prefix}.tool_schema", where("tool_schema"),
                                                issues)
    if len(issues) > count or tool_class is None or config is None or schema is None:
        return None
    return ToolEntry(index, class_name, tool_class, config, schema, ignored)


def _parse_config(tool_class: ToolClass, raw: dict, prefix: str, fallback: str,
                  issues: list[ConfigIssue]) -> ToolConfig | None:
    cls = tool_class.config_class
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    count = len(issues)
    for key, value in raw.items():
        where = _where(raw, key, fallback)
        if key not in fields:
            guess = closest_key(str(key), fields)
            hint = f"did you mean `{guess}`?" if guess else f"valid keys are: {', '.join(fields)}"
            issues.append(ConfigIssue(f"{prefix}.{key}", f"unknown key for {cls.__name__}: upstream would ignore "
                                                         f"it, so it is refused; {hint}", where))
            continue
        problem = _check_value(key, value)
        if problem:
            issues.append(ConfigIssue(f"{prefix}.{key}", problem, where))
            continue
        kwargs[key] = value
    for name, f in fields.items():
        if f.default is dataclasses.MISSING and name not in raw:
            issues.append(ConfigIssue(f"{prefix}.{name}", f"is required ({f.metadata['help']})", fallback))
    if len(issues) > count:
        return None
    return cls(**kwargs)


def _check_value(key: str, value: Any) -> str | None:
    """What is wrong with `value` for config key `key`, or None."""
    if key in ("sandbox_fusion_url", "retrieval_service_url"):
        if not isinstance(value, str) or not value:
            return "must be a non-empty http(s) URL"
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"{value!r} is not an http(s) URL with a host"
        return None
    if key in ("num_workers", "rate_limit", "topk"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"must be an integer >= 1, got {value!r}"
        return None
    if key == "memory_limit_mb":
        if not isinstance(value, int) or isinstance(value, bool) or not (value >= 1 or value == -1):
            return f"must be a positive integer (MB) or -1 (no limit, SandboxFusion's convention), got {value!r}"
        return None
    if key in ("default_timeout", "timeout"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            return f"must be a positive number of seconds, got {value!r}"
        if value > 3600:
            return f"must be at most 3600 seconds (a tool call's longest deadline), got {value!r}"
        return None
    if key == "enable_global_rate_limit":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if key == "default_language":
        if value not in SANDBOX_LANGUAGES:
            guess = closest_key(str(value), SANDBOX_LANGUAGES)
            return (f"{value!r} is not a SandboxFusion language" + (f"; did you mean `{guess}`?" if guess else "")
                    + f" (languages: {', '.join(SANDBOX_LANGUAGES)})")
        return None
    if key == "type":
        if value == "mcp":
            return "`mcp` (tools of an MCP server) is not supported: rlfabric hosts native tools; use `native`"
        return None if value in TOOL_TYPES else f"must be one of {', '.join(TOOL_TYPES)}, got {value!r}"
    return None


# Upstream's pydantic models (mindspeed_rl/tools/utils/schemas.py): field -> (required, check, nested fields).
_PROPERTY_FIELDS = {"type": (True, str), "description": (False, str), "enum": (False, list)}
_PARAMETERS_FIELDS = {"type": (True, str), "properties": (True, dict), "required": (True, list)}
_FUNCTION_FIELDS = {"name": (True, str), "description": (True, str), "parameters": (False, dict),
                    "strict": (False, bool)}
_TOOL_FIELDS = {"type": (True, str), "function": (True, dict)}


def normalize_tool_schema(raw: Any, prefix: str, source: str | None,
                          issues: list[ConfigIssue]) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """`raw` as MindSpeed-RL's `OpenAIFunctionToolSchema` validates and dumps it (exclude_unset, exclude_none).

    Returns (schema or None when invalid, the dotted paths of the keys dropped). Problems go to `issues`.
    """
    ignored: list[str] = []
    count = len(issues)

    def take(value: Any, fields: dict[str, tuple[bool, type]], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (required, kind) in fields.items():
            where = _where(value, name, source)
            if name not in value or value[name] is None:
                if required:
                    issues.append(ConfigIssue(f"{path}.{name}", f"is required ({kind.__name__})", where))
                continue
            item = value[name]
            if not isinstance(item, kind) or (kind is str and not item and name == "name"):
                issues.append(ConfigIssue(f"{path}.{name}", f"must be a {'non-empty ' if name == 'name' else ''}"
                                                            f"{kind.__name__}, got {item!r}", where))
                continue
            out[name] = item
        ignored.extend(f"{path}.{key}" for key in value if key not in fields)
        return out

    if not isinstance(raw, dict):
        issues.append(ConfigIssue(prefix, "must be a mapping {type: function, function: {...}}", source))
        return None, ()
    tool = take(raw, _TOOL_FIELDS, prefix)
    function = tool.get("function")
    if function is not None:
        tool["function"] = fn = take(function, _FUNCTION_FIELDS, f"{prefix}.function")
        params = fn.get("parameters")
        if params is not None:
            fn["parameters"] = p = take(params, _PARAMETERS_FIELDS, f"{prefix}.function.parameters")
            properties = p.get("properties", {})
            for prop_name, prop in list(properties.items()):
                path = f"{prefix}.function.parameters.properties.{prop_name}"
                if not isinstance(prop, dict):
                    issues.append(ConfigIssue(path, f"must be a mapping {{type, description}}, got {prop!r}",
                                              _where(properties, prop_name, source)))
                    continue
                properties[prop_name] = clean = take(prop, _PROPERTY_FIELDS, path)
                if "enum" in clean and not all(isinstance(v, str) for v in clean["enum"]):
                    issues.append(ConfigIssue(f"{path}.enum", "must list strings (upstream's schema model)",
                                              _where(prop, "enum", source)))
            if "properties" in p:
                p["properties"] = dict(properties)
            for name in p.get("required", []):
                if name not in properties:
                    issues.append(ConfigIssue(f"{prefix}.function.parameters.required",
                                              f"names {name!r}, which is not one of the properties "
                                              f"({', '.join(properties) or 'none'})", _where(params, "required",
                                                                                            source)))
    if len(issues) > count:
        return None, ()
    return _plain(tool), tuple(ignored)


def _plain(value: Any) -> Any:
    """`value` with SourcedDicts turned into plain dicts (the schema travels as JSON)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
