"""The tool YAML: upstream's files load unchanged with their values; every mistake names file:line, entry, key."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config.errors import ConfigError
from services.common.config.tools import CodeInterpreterConfig, SearchConfig, load_tool_config
from tests.tools.conftest import REFERENCE_TOOLS


def test_upstream_retool_yaml_loads_with_its_values():
    config = load_tool_config(REFERENCE_TOOLS / "retool_config.yaml")
    (tool,) = config.tools
    assert tool.name == "code_interpreter"
    assert tool.tool_class.kind == "code_interpreter" and tool.tool_class.retool_code
    assert tool.config == CodeInterpreterConfig(
        sandbox_fusion_url="http://localhost:8080/run_code", num_workers=128, rate_limit=128,
        enable_global_rate_limit=True, default_timeout=30, default_language="python", memory_limit_mb=1024,
        type="native")
    assert tool.schema == {"type": "function", "function": {
        "name": "code_interpreter", "description": "A tool for executing code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                 "description": "The code to execute."}},
                       "required": ["code"]}}}
    assert tool.ignored == ()


def test_upstream_search_yaml_loads_and_drops_what_upstream_drops():
    (tool,) = load_tool_config(REFERENCE_TOOLS / "search_tool_config.yaml").tools
    assert tool.config == SearchConfig(retrieval_service_url="http://localhost:8080/retrieve", num_workers=120,
                                       rate_limit=120, enable_global_rate_limit=True, timeout=30, topk=3)
    # upstream's schema model has no `item` (nor `items`): the model never sees it
    assert tool.parameters["properties"]["query_list"] == {
        "type": "array",
        "description": "A list of fully-formed semantic queries. The tool will return search results for each query."}
    assert tool.ignored == ("tools[0].tool_schema.function.parameters.properties.query_list.item",)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


GOOD_SCHEMA = """
    tool_schema:
      type: function
      function:
        name: {name}
        description: d
        parameters: {{type: object, properties: {{code: {{type: string}}}}, required: [code]}}
"""


@pytest.mark.parametrize(("entry", "expected"), [
    # an unknown class, named with the file and the entry
    ("  - class_name: mindspeed_rl.tools.nope.Nope\n    config: {}\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\.yaml:2: tools\[0\]\.class_name: 'mindspeed_rl\.tools\.nope\.Nope' is not a tool rlfabric hosts \(in "
     r".*tools\.yaml, entry 0\); known classes: mindspeed_rl\.tools\.retool\.ReTool"),
    # upstream reads memory_limit_mb; the SandboxFusion spelling would be ignored there, so it is refused here
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/run_code\n"
     "      memory_limit_MB: 512\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\.yaml:5: tools\[0\]\.config\.memory_limit_MB: unknown key for CodeInterpreterConfig.*did you mean "
     r"`memory_limit_mb`\?"),
    # the search tool's key in a code tool
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/run_code\n"
     "      topk: 3\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\[0\]\.config\.topk: unknown key for CodeInterpreterConfig"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config: {num_workers: 4}\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\[0\]\.config\.sandbox_fusion_url: is required"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/run_code\n"
     "      num_workers: 0\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\.yaml:5: tools\[0\]\.config\.num_workers: must be an integer >= 1, got 0"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: localhost:8080\n"
     + GOOD_SCHEMA.format(name="x"),
     r"sandbox_fusion_url: 'localhost:8080' is not an http\(s\) URL with a host"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/run_code\n"
     "      default_language: pyhton\n" + GOOD_SCHEMA.format(name="x"),
     r"default_language: 'pyhton' is not a SandboxFusion language; did you mean `python`\?"),
    ("  - class_name: mindspeed_rl.tools.search_tool.SearchTool\n    config:\n"
     "      retrieval_service_url: http://h/retrieve\n      type: mcp\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\[0\]\.config\.type: `mcp` \(tools of an MCP server\) is not supported"),
    ("  - class_name: mindspeed_rl.tools.search_tool.SearchTool\n    config:\n"
     "      retrieval_service_url: http://h/retrieve\n      timeout: -1\n" + GOOD_SCHEMA.format(name="x"),
     r"tools\[0\]\.config\.timeout: must be a positive number of seconds, got -1"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config: {sandbox_fusion_url: 'http://h/run_code'}\n",
     r"tools\[0\]\.tool_schema: is missing"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config: {sandbox_fusion_url: 'http://h/run_code'}\n"
     "    tool_schema: {type: function, function: {name: x}}\n",
     r"tools\[0\]\.tool_schema\.function\.description: is required"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config: {sandbox_fusion_url: 'http://h/run_code'}\n"
     "    tool_schema: {type: function, function: {name: x, description: d, parameters: "
     "{type: object, properties: {}, required: [code]}}}\n",
     r"required: names 'code', which is not one of the properties \(none\)"),
    ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config: {sandbox_fusion_url: 'http://h/run_code'}\n"
     "    toolschema: {}\n",
     r"tools\[0\]\.toolschema: unknown key; did you mean `tool_schema`\?"),
])
def test_mistakes_are_named(tmp_path, entry, expected):
    with pytest.raises(ConfigError, match=expected):
        load_tool_config(_write(tmp_path, "tools:\n" + entry))


def test_every_problem_is_reported_at_once_and_names_are_unique(tmp_path):
    entry = ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/x\n"
             + GOOD_SCHEMA.format(name="same"))
    unknown = "  - class_name: nope\n    config: {}\n" + GOOD_SCHEMA.format(name="other")
    bad = ("  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      sandbox_fusion_url: http://h/x\n"
           "      rate_limit: many\n" + GOOD_SCHEMA.format(name="third"))
    with pytest.raises(ConfigError) as info:
        load_tool_config(_write(tmp_path, "tools:\n" + entry + entry + unknown + bad + "extra: 1\n"))
    keys = [issue.key for issue in info.value.issues]
    assert keys == ["extra", "tools[2].class_name", "tools[3].config.rate_limit",
                    "tools[1].tool_schema.function.name"], info.value.errors
    assert "already used by tools[0]" in info.value.errors[-1]


@pytest.mark.parametrize(("text", "expected"), [
    ("tools: []\n", r"tools: must be a non-empty list"),
    ("- a\n", r"expected a mapping with a `tools:` list"),
    ("tools:\n  - [1]\n", r"tools\[0\]: must be a mapping"),
])
def test_malformed_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_tool_config(_write(tmp_path, text))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: tool config file not found"):
        load_tool_config(tmp_path / "nope.yaml")
