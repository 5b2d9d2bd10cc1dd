"""The control plane on the wire: the gRPC server, its servicers, authentication, the
admission gate, metrics, and the Python client engines and routers use."""
