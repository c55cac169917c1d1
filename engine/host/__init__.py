"""pagedserve.engine.host: what a serving process sets up on its host before an engine is built (compute threads
from the CPU budget, the thread governor, the allocator, the main-thread host, CPU features). The engine core never
imports it; the entries (`pagedserve serve`, the offline `LLM`) call `tuning.tune_host` and hand the engine what it
returns. Kept light: `service/entry.py` imports `cpu_threads` before torch loads."""
