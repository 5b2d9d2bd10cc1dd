"""CacheTTL's vLLM engine hook: TTL pinning, program-level priority, tool-call tracking."""
