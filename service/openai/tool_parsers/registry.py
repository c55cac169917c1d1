"""`--tool-call-parser NAME` -> its parser; unknown names are refused listing the supported ones."""

from __future__ import annotations

from pagedserve.kernels.registry import Registry
from pagedserve.service.openai.tool_parsers.base import ToolParser
from pagedserve.service.openai.tool_parsers.hermes import HermesParser
from pagedserve.service.openai.tool_parsers.llama3_json import Llama3JsonParser
from pagedserve.service.openai.tool_parsers.mistral import MistralParser
from pagedserve.service.openai.tool_parsers.pythonic import PythonicParser
from pagedserve.service.openai.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool-call parser")
for _parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser):
    TOOL_PARSERS.register(_parser.name)(_parser)
# vLLM's other names for the same formats
TOOL_PARSERS.register("qwen")(HermesParser)
TOOL_PARSERS.register("llama4_json")(Llama3JsonParser)
TOOL_PARSERS.register("llama4_pythonic")(PythonicParser)
TOOL_PARSERS.register("qwen3_xml")(Qwen3CoderParser)
