"""FSDP2 adapter: owner-computes Muon on fully_shard models."""
