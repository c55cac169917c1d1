"""Tool-call formats of model families: model text -> content and tool calls (`--tool-call-parser NAME`)."""
