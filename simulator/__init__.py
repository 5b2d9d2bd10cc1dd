"""A discrete-event model of a serving engine, agent workloads and baseline policies."""
