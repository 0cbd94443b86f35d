"""Tools: typed functions offered to the model, and the parser for its calls."""

from relax_gym.tools.function_tool import (
    TOOL_MARK,
    Tool,
    ToolDefinitionError,
    ToolError,
    ToolResult,
    ToolSet,
    to_parts,
    tool,
)
from relax_gym.tools.parser import ParsedTurn, ToolCall, ToolCallError, parse_tool_calls

__all__ = [
    "TOOL_MARK",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolDefinitionError",
    "ToolError",
    "ToolResult",
    "ToolSet",
    "parse_tool_calls",
    "to_parts",
    "tool",
]
