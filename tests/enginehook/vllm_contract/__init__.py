"""vLLM's own v1 core scheduler tests, run against the CacheTTL hook (see ``runner``)."""
