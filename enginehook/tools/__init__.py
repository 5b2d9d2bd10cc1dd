"""Tools around the hook: real-engine benchmarks, the agent runner and the model builders."""
