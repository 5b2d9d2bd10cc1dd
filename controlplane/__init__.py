"""CacheTTL's control plane: gRPC service, persistence, tenants and inspection."""
